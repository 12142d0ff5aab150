"""The torch references against dense SDPA on contiguous K/V, plus API contracts and errors.

These run on the ``torch`` backend only (fast); the Triton kernels are compared with these
references in ``test_kernels_triton.py``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import (BackendUnavailableError, KVFormatError, ShapeError, allocate_kv_cache, dequantize_kv,
                     paged_decode_attention, paged_prefill_attention, quantize_kv)

FORMATS = ["fp16", "bf16", "fp32", "fp8_e4m3", "fp8_e5m2", "int8", "int4"]


def test_package_is_ours():
    """PyPI's unrelated `kernels` must not shadow ours in this repo."""
    root = Path(__file__).resolve().parents[1]
    assert Path(kernels.__file__).resolve() == root / "kernels" / "__init__.py"
    assert kernels.WORKBENCH


def test_import_does_not_import_triton():
    import subprocess
    import sys
    code = "import sys, kernels; assert 'triton' not in sys.modules, 'triton imported eagerly'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


def _paged(num_blocks, block_size, fmt, k, v, perm, dtype=torch.float32):
    """Write contiguous k/v [T, H, D] into a paged layer at the blocks listed in perm."""
    layer = allocate_kv_cache(num_blocks, block_size, k.shape[1], k.shape[2], fmt, dtype=dtype)
    if layer.kv_format.scale == "head":
        layer.k_scale[:] = kernels.fp8_scale(k, fmt)
        layer.v_scale[:] = kernels.fp8_scale(v, fmt)
    slots = (perm[:, None] * block_size + torch.arange(block_size)).reshape(-1)[: k.shape[0]].int()
    kernels.write_kv(k, v, layer, slots, backend="torch")
    return layer


def _dequant_ref(x, fmt, layer, which):
    fm = layer.kv_format
    if not fm.quantized:
        return x.to(fm.storage_dtype).float()
    s = getattr(layer, which + "_scale") if fm.scale == "head" else None
    return dequantize_kv(quantize_kv(x, fm, scale=s), fm)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block_size,group", [(1, 1), (16, 4), (8, 3)])
def test_reference_matches_sdpa(fmt, block_size, group):
    """Paged reference == SDPA on contiguous, identically quantized K/V (decode and prefill)."""
    g = torch.Generator().manual_seed(block_size * 7 + group)
    h, d, t = 2, 64, 37
    k, v = torch.randn(t, h, d, generator=g), torch.randn(t, h, d, generator=g)
    nb = -(-t // block_size)
    perm = torch.randperm(nb + 3, generator=g)[:nb]
    layer = _paged(nb + 3, block_size, fmt, k, v, perm)
    kd, vd = _dequant_ref(k, fmt, layer, "k"), _dequant_ref(v, fmt, layer, "v")
    bt = perm[None].repeat(3, 1).int()
    lens = torch.tensor([t, 1, block_size + 1], dtype=torch.int32)
    q = torch.randn(3, h * group, d, generator=g)
    out, lse = paged_decode_attention(q, layer, None, bt, lens, backend="torch", return_lse=True)
    for i, n in enumerate(lens.tolist()):
        qi, ki, vi = q[i][:, None], kd[:n].transpose(0, 1), vd[:n].transpose(0, 1)
        ref = F.scaled_dot_product_attention(qi, ki, vi, enable_gqa=True)[:, 0]
        torch.testing.assert_close(out[i], ref, atol=2e-6, rtol=2e-6)
        scores = (qi @ ki.repeat_interleave(group, 0).transpose(1, 2))[:, 0] / math.sqrt(d)
        torch.testing.assert_close(lse[i], torch.logsumexp(scores, -1), atol=2e-6, rtol=2e-6)
    # prefill: a 9-token chunk at the end of the full sequence plus a 1-token decode, mixed
    qp = torch.randn(10, h * group, d, generator=g)
    qsl = torch.tensor([0, 9, 10], dtype=torch.int32)
    sl = torch.tensor([t, 5], dtype=torch.int32)
    o = paged_prefill_attention(qp, layer, None, bt[:2], sl, qsl, backend="torch")
    mask = torch.arange(t)[None] <= torch.arange(t - 9, t)[:, None]
    ref = F.scaled_dot_product_attention(qp[:9].transpose(0, 1), kd.transpose(0, 1), vd.transpose(0, 1),
                                         attn_mask=mask, enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(o[:9], ref, atol=2e-6, rtol=2e-6)
    ref1 = F.scaled_dot_product_attention(qp[9][:, None], kd[:5].transpose(0, 1), vd[:5].transpose(0, 1),
                                          enable_gqa=True)[:, 0]
    torch.testing.assert_close(o[9], ref1, atol=2e-6, rtol=2e-6)


def test_reference_ignores_nan_slots():
    """Stale NaN in unused slots (past seq_len, in the last block) never reaches the output."""
    layer = allocate_kv_cache(4, 8, 1, 64, "fp16", dtype=torch.float16)
    layer.k.fill_(float("nan"))
    layer.v.fill_(float("nan"))
    k = torch.randn(5, 1, 64)
    kernels.write_kv(k, k, layer, torch.arange(8, 13, dtype=torch.int32), backend="torch")
    out = paged_decode_attention(torch.randn(1, 2, 64, dtype=torch.float16), layer, None,
                                 torch.tensor([[1, 3]], dtype=torch.int32), torch.tensor([5], dtype=torch.int32),
                                 backend="torch")
    assert torch.isfinite(out).all()


def test_write_skips_negative_slots_and_copy_swap():
    layer = allocate_kv_cache(4, 2, 1, 64, "int4", dtype=torch.float32)
    k = torch.randn(3, 1, 64)
    kernels.write_kv(k, -k, layer, torch.tensor([0, -1, 3], dtype=torch.int32), backend="torch")
    assert (layer.k[0, 1] == 0).all() and (layer.k[1, 0] == 0).all() and (layer.k[1, 1] != 0).any()
    before = [t.clone() for t in layer.block_tensors()]
    kernels.copy_blocks([layer], [(0, 2), (1, 3)], backend="torch")
    for b, t in zip(before, layer.block_tensors()):
        assert torch.equal(t[2], b[0]) and torch.equal(t[3], b[1]) and torch.equal(t[0], b[0])
    cpu = allocate_kv_cache(3, 2, 1, 64, "int4", dtype=torch.float32)
    kernels.swap_blocks(layer, cpu, torch.tensor([[2, 0], [3, 2]]))
    for a, b in zip(layer.block_tensors(), cpu.block_tensors()):
        assert torch.equal(b[0], a[2]) and torch.equal(b[2], a[3])


def test_errors_say_what_to_change():
    layer = allocate_kv_cache(4, 2, 2, 64, "fp16")
    bt = torch.zeros(1, 2, dtype=torch.int32)
    sl = torch.ones(1, dtype=torch.int32)
    with pytest.raises(KVFormatError, match="use one of"):
        allocate_kv_cache(4, 2, 2, 64, "int3")
    with pytest.raises(ShapeError, match="multiple of num_kv_heads"):
        paged_decode_attention(torch.randn(1, 3, 64, dtype=torch.float16), layer, None, bt, sl)
    with pytest.raises(ShapeError, match="head_dim"):
        paged_decode_attention(torch.randn(1, 2, 32, dtype=torch.float16), layer, None, bt, sl)
    with pytest.raises(ShapeError, match=r"seq_lens must lie in \[0, 4\]"):
        paged_decode_attention(torch.randn(1, 2, 64, dtype=torch.float16), layer, None, bt, sl + 4)
    with pytest.raises(ShapeError, match="v_cache=None"):
        paged_decode_attention(torch.randn(1, 2, 64, dtype=torch.float16), layer, layer.v, bt, sl)
    with pytest.raises(KVFormatError, match="allocate it with"):
        paged_decode_attention(torch.randn(1, 2, 64), layer.k, layer.v, bt, sl, kv_format="bf16")
    with pytest.raises(BackendUnavailableError, match="CUDA"):
        paged_decode_attention(torch.randn(1, 2, 64, dtype=torch.float16), layer, None, bt, sl, backend="triton")
    with pytest.raises(BackendUnavailableError, match="unknown backend"):
        paged_decode_attention(torch.randn(1, 2, 64, dtype=torch.float16), layer, None, bt, sl, backend="cuda")
    with pytest.raises(ShapeError, match="count the new query tokens"):
        paged_prefill_attention(torch.randn(3, 2, 64, dtype=torch.float16), layer, None, bt, sl,
                                torch.tensor([0, 3], dtype=torch.int32))
    x = torch.randn(1, 2, 64)
    with pytest.raises(ShapeError, match="past the cache"):
        kernels.write_kv(x, x, layer, torch.tensor([8], dtype=torch.int32))


def test_bytes_per_token():
    assert kernels.bytes_per_token("fp16", 8, 128) == 2 * 8 * 256
    assert kernels.bytes_per_token("fp8_e4m3", 8, 128) == 2 * 8 * 128
    assert kernels.bytes_per_token("int8", 8, 128) == 2 * 8 * 130
    assert kernels.bytes_per_token("int4", 8, 128) == 2 * 8 * (64 + 16)
    layer = allocate_kv_cache(3, 16, 8, 128, "int4")
    assert layer.nbytes() == 3 * 16 * kernels.bytes_per_token("int4", 8, 128)


def _run(code: str, **env) -> None:
    import os
    import subprocess
    import sys
    e = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    e.update(env)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1], env=e)


def test_backends_without_triton_and_without_interpreter():
    """No triton: auto falls back to torch, asking for Triton says what to install.
    Triton present but TRITON_INTERPRET unset: CPU tensors default to torch, 'interpreter' says what to set."""
    common = """
import torch, kernels
layer = kernels.allocate_kv_cache(2, 4, 1, 64)
args = (torch.randn(1, 2, 64, dtype=torch.float16), layer, None, torch.zeros(1, 1, dtype=torch.int32),
        torch.ones(1, dtype=torch.int32))
assert kernels.resolve_backend(None, torch.device("cpu")) == "torch"
kernels.paged_decode_attention(*args)
try:
    kernels.paged_decode_attention(*args, backend="interpreter")
except kernels.BackendUnavailableError as e:
    assert MSG in str(e), e
else:
    raise AssertionError("no error")
"""
    _run("import sys; sys.modules['triton'] = None; MSG = 'pip install triton'" + common)
    _run("MSG = 'TRITON_INTERPRET=1'" + common)
