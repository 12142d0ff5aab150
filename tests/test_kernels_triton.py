"""Triton kernels == torch references, under Triton's interpreter on CPU (or compiled on a GPU).

Backend: ``interpreter`` when ``TRITON_INTERPRET=1`` (tests/conftest.py sets it); run
``TRITON_INTERPRET=0 pytest tests/test_kernels_triton.py`` on a GPU machine to check the compiled
kernels (``triton`` backend, CUDA tensors).

Grid: every pair of (KV format x block size {1, 8, 16, 32} x head_dim {64, 128} x GQA group
{1, 3, 4, 8}) occurs in some case (a 28-row pairwise design instead of the 224-case product),
and every case holds a mixed-length batch: lengths 1, block_size - 1, block_size, block_size + 1
and several blocks, unused slots and side tensors filled with NaN, block-table padding with
invalid ids.

Tolerances (kernel vs reference). Both sides read the *same stored codes* and dequantize them
exactly in float32 (code * scale [+ zero] is one rounding in both), so every format has the same
error budget, set by the output dtype: float32 accumulation in a different order (~1e-6
relative) plus one final rounding to ``q.dtype``:
  fp32 out (fp32): 1e-5;  fp16 out (fp16, fp8_*, int8, int4 with fp16 q): 2e-3 (2 ulp near 1);
  bf16 out (bf16, and quantized formats with bf16 q): 1.6e-2 (2 ulp near 1).
On a GPU the kernels feed 16-bit operands to tl.dot (probabilities and dequantized K/V rounded to
the model dtype), so the compiled check uses 2e-2 (fp16) / 6e-2 (bf16).
KV writes must match bit for bit (same integer fp8 encoding, same fp32 op order for int8/int4).
How far each *format* is from unquantized values is tested in test_kernels_quant.py.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

pytest.importorskip("triton")

import kernels  # noqa: E402
from kernels.backend import interpreter_enabled  # noqa: E402

if interpreter_enabled():
    BACKEND, DEVICE = "interpreter", "cpu"
elif torch.cuda.is_available():
    BACKEND, DEVICE = "triton", "cuda"
else:
    pytest.skip("needs TRITON_INTERPRET=1 or a CUDA GPU", allow_module_level=True)

FORMATS = ["fp16", "bf16", "fp32", "fp8_e4m3", "fp8_e5m2", "int8", "int4"]
BLOCK_SIZES = [1, 8, 16, 32]
HEAD_DIMS = [64, 128]
GROUPS = [1, 3, 4, 8]
NUM_KV_HEADS = 2

# pairwise design: format i x block size j; head_dim and group follow Latin-square offsets
CASES = [(f, bs, HEAD_DIMS[(i + j // 2) % 2], GROUPS[(i + j) % 4])
         for i, f in enumerate(FORMATS) for j, bs in enumerate(BLOCK_SIZES)]


def test_design_is_pairwise():
    levels = [FORMATS, BLOCK_SIZES, HEAD_DIMS, GROUPS]
    for a, b in itertools.combinations(range(4), 2):
        seen = {(c[a], c[b]) for c in CASES}
        assert seen == set(itertools.product(levels[a], levels[b])), (a, b)


def _q_dtype(fmt: str, i: int) -> torch.dtype:
    if fmt in ("fp16", "bf16", "fp32"):
        return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[fmt]
    return (torch.float16, torch.bfloat16)[i % 2]


def _tol(dtype: torch.dtype) -> dict:
    if BACKEND == "triton":
        t = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}[dtype]
    else:
        t = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    return dict(atol=t, rtol=t)


def _nan_fill(layer: kernels.KVCacheLayer) -> None:
    """Fill data and per-token side tensors with NaN (or NaN-decoding bytes)."""
    for t in layer.block_tensors():
        if t.dtype.is_floating_point and t.element_size() > 1:
            t.fill_(float("nan"))
        else:
            t.view(torch.uint8).fill_(0x7F)  # fp8 NaN; int8/int4 codes are finite, their scales are NaN


def _make_batch(fmt: str, bs: int, hd: int, group: int, lens: list[int], seed: int, dtype: torch.dtype):
    """A NaN-filled layer holding random K/V for sequences of ``lens`` tokens in shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    nblk = [max(1, -(-n // bs)) for n in lens]
    num_blocks = sum(nblk) + 3
    layer = kernels.allocate_kv_cache(num_blocks, bs, NUM_KV_HEADS, hd, fmt, dtype=dtype, device=DEVICE)
    _nan_fill(layer)
    if layer.kv_format.scale == "head":
        layer.k_scale.copy_(torch.tensor([0.01, 0.02]))
        layer.v_scale.copy_(torch.tensor([0.015, 0.005]))
    perm = torch.randperm(num_blocks, generator=g)
    width = max(nblk) + 2
    tables = torch.full((len(lens), width), -1, dtype=torch.int32)
    tables[:, -1] = 10**6  # padding ids past the pool: must never be dereferenced
    slots = []
    used = 0
    for s, n in enumerate(lens):
        ids = perm[used:used + nblk[s]]
        used += nblk[s]
        tables[s, :nblk[s]] = ids.int()
        slots.append((ids[:, None] * bs + torch.arange(bs)).reshape(-1)[:n])
    slot_mapping = torch.cat(slots).int()
    k = torch.randn(slot_mapping.numel(), NUM_KV_HEADS, hd, generator=g).to(dtype)
    v = torch.randn(slot_mapping.numel(), NUM_KV_HEADS, hd, generator=g).to(dtype)
    kernels.write_kv(k.to(DEVICE), v.to(DEVICE), layer, slot_mapping.to(DEVICE), backend="torch")
    return layer, tables.to(DEVICE), torch.tensor(lens, dtype=torch.int32, device=DEVICE), g


@pytest.mark.parametrize("fmt,bs,hd,group", CASES, ids=[f"{f}-bs{b}-d{h}-g{g}" for f, b, h, g in CASES])
def test_decode_matches_reference(fmt, bs, hd, group):
    i = CASES.index((fmt, bs, hd, group))
    dtype = _q_dtype(fmt, i)
    lens = [1, max(0, bs - 1), bs, bs + 1, 3 * bs + 5]
    layer, tables, seq_lens, g = _make_batch(fmt, bs, hd, group, lens, seed=i, dtype=dtype)
    q = torch.randn(len(lens), NUM_KV_HEADS * group, hd, generator=g).to(dtype).to(DEVICE)
    splits = (None, 3)[i % 2]
    out, lse = kernels.paged_decode_attention(q, layer, None, tables, seq_lens, backend=BACKEND,
                                              return_lse=True, num_splits=splits)
    ref, ref_lse = kernels.paged_decode_attention(q, layer, None, tables, seq_lens, backend="torch",
                                                  return_lse=True)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.float(), **_tol(dtype))
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("fmt,bs,hd,group", CASES, ids=[f"{f}-bs{b}-d{h}-g{g}" for f, b, h, g in CASES])
def test_prefill_matches_reference(fmt, bs, hd, group):
    """Mixed batch: a decode, a prompt from scratch, a chunk after a cached prefix, an idle sequence."""
    i = CASES.index((fmt, bs, hd, group))
    dtype = _q_dtype(fmt, i + 1)
    lens = [bs + 1, 2 * bs + 3, 3 * bs + 5, bs, max(1, bs - 1)]
    q_lens = [1, 2 * bs + 3, 5, 0, max(1, bs - 1)]
    layer, tables, seq_lens, g = _make_batch(fmt, bs, hd, group, lens, seed=100 + i, dtype=dtype)
    qsl = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(q_lens), NUM_KV_HEADS * group, hd, generator=g).to(dtype).to(DEVICE)
    out = kernels.paged_prefill_attention(q, layer, None, tables, seq_lens, qsl, backend=BACKEND)
    ref = kernels.paged_prefill_attention(q, layer, None, tables, seq_lens, qsl, backend="torch")
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.float(), **_tol(dtype))


@pytest.mark.parametrize("fmt", ["fp16", "fp8_e5m2", "int8", "int4"])
def test_head_dim_not_a_power_of_two(fmt):
    """head_dim 96 (tiles padded to 128 and masked; int4 has 3 groups of 32)."""
    lens = [1, 17, 40]
    layer, tables, seq_lens, g = _make_batch(fmt, 16, 96, 2, lens, seed=11, dtype=torch.float16)
    q = torch.randn(3, 4, 96, generator=g).half().to(DEVICE)
    out = kernels.paged_decode_attention(q, layer, None, tables, seq_lens, backend=BACKEND, num_splits=2)
    ref = kernels.paged_decode_attention(q, layer, None, tables, seq_lens, backend="torch")
    torch.testing.assert_close(out, ref, **_tol(torch.float16))
    k = torch.randn(5, NUM_KV_HEADS, 96, generator=g).half().to(DEVICE)
    twin = kernels.allocate_kv_cache(layer.num_blocks, 16, NUM_KV_HEADS, 96, fmt, device=DEVICE)
    for a, b in zip(twin.block_tensors(), layer.block_tensors()):
        a.copy_(b)
    if layer.kv_format.scale == "head":
        twin.k_scale.copy_(layer.k_scale)
        twin.v_scale.copy_(layer.v_scale)
    slots = torch.tensor([0, 5, -1, 17, 33], dtype=torch.int32, device=DEVICE)
    kernels.write_kv(k, -k, layer, slots, backend=BACKEND)
    kernels.write_kv(k, -k, twin, slots, backend="torch")
    for a, b in zip(layer.block_tensors(), twin.block_tensors()):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_decode_is_prefill_with_one_token():
    layer, tables, seq_lens, g = _make_batch("fp16", 8, 64, 4, [9, 1, 30], seed=7, dtype=torch.float16)
    q = torch.randn(3, 16, 64, generator=g).half().to(DEVICE)[:, ::2]  # a strided view
    qsl = torch.arange(4, dtype=torch.int32, device=DEVICE)
    a = kernels.paged_decode_attention(q, layer, None, tables, seq_lens, backend=BACKEND)
    b = kernels.paged_prefill_attention(q, layer, None, tables, seq_lens, qsl, backend=BACKEND)
    ref = kernels.paged_decode_attention(q, layer, None, tables, seq_lens, backend="torch")
    torch.testing.assert_close(a, b, **_tol(torch.float16))
    torch.testing.assert_close(a, ref, **_tol(torch.float16))


_IN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@pytest.mark.parametrize("fmt,hd,in_dtype", [(f, (64, 128)[i % 2], _IN_DTYPES[i % 3]) for i, f in enumerate(FORMATS)])
def test_write_kv_bit_exact(fmt, hd, in_dtype):
    """Quantize-on-write equals the torch reference bit for bit; slot -1 is skipped."""
    if fmt in ("fp16", "bf16", "fp32"):
        in_dtype = {"fp16": torch.float32, "bf16": torch.float32, "fp32": torch.float16}[fmt]
    g = torch.Generator().manual_seed(hd)
    layers = [kernels.allocate_kv_cache(5, 8, 3, hd, fmt, device=DEVICE) for _ in range(2)]
    for layer in layers:
        _nan_fill(layer)
        if layer.kv_format.scale == "head":
            layer.k_scale.copy_(torch.tensor([0.01, 1.0, 3.0]))
            layer.v_scale.copy_(torch.tensor([0.5, 0.02, 1.0]))
    n = 25
    k = (torch.randn(n, 3, hd, generator=g) * torch.logspace(-3, 2, n)[:, None, None]).to(in_dtype)
    v = torch.randn(n, 3, hd, generator=g).to(in_dtype)
    k[0, 0, :4] = torch.tensor([6e4, -6e4, 0.0, -0.0])  # fp8 saturation (scale 0.01) and signed zero
    v[1, 1] = 0.0  # constant row: zero scale
    slots = torch.randperm(40, generator=g)[:n].int()
    slots[[3, 11]] = -1
    kernels.write_kv(k.to(DEVICE), v.to(DEVICE), layers[0], slots.to(DEVICE), backend=BACKEND)
    kernels.write_kv(k.to(DEVICE), v.to(DEVICE), layers[1], slots.to(DEVICE), backend="torch")
    for a, b in zip(layers[0].block_tensors(), layers[1].block_tensors()):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("fmt", ["fp16", "fp8_e4m3", "int4"])
def test_copy_blocks_matches_reference(fmt):
    layers = []
    for _ in range(2):
        ls = [kernels.allocate_kv_cache(6, 4, 2, 64, fmt, device=DEVICE) for _ in range(2)]
        for j, layer in enumerate(ls):
            for t in layer.block_tensors():
                u = t.view(torch.uint8)
                u.copy_((torch.arange(u.numel()) % 251 + j).reshape(u.shape))
        layers.append(ls)
    mapping = [(0, 3), (1, 4), (0, 5)]
    kernels.copy_blocks(layers[0], mapping, backend=BACKEND)
    kernels.copy_blocks(layers[1], mapping, backend="torch")
    for a, b in zip(kernels.blocks.block_tensors_of(layers[0]), kernels.blocks.block_tensors_of(layers[1])):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    chain = [(0, 1), (1, 2), (2, 0)]  # overlapping pairs: simultaneous semantics (torch path)
    kernels.copy_blocks(layers[0], chain, backend=BACKEND)
    kernels.copy_blocks(layers[1], chain, backend="torch")
    for a, b in zip(kernels.blocks.block_tensors_of(layers[0]), kernels.blocks.block_tensors_of(layers[1])):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ---- fp8 encoding, bit for bit against torch's casts --------------------------------------------------

def _fp8_probe_values() -> torch.Tensor:
    """Random values over many decades, every finite fp8 value, every midpoint and its neighbours, specials."""
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(2000, generator=g) * s for s in (1e-8, 1e-4, 1e-2, 1, 30, 300, 1e4, 1e5)]
    for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        vals = torch.arange(256, dtype=torch.uint8).view(dt).float()
        vals = vals[torch.isfinite(vals)].unique()
        mids = (vals[1:] + vals[:-1]) / 2
        parts += [vals, mids, mids.nextafter(torch.tensor(math.inf)), mids.nextafter(torch.tensor(-math.inf))]
    parts.append(torch.tensor([math.nan, -math.nan, math.inf, -math.inf, 0.0, -0.0, 1.97, 7.8, 31.5, 120.0,
                               500.0, 464.0, 60000.0, 61440.0, 1e-45, -1e-40]))
    return torch.cat(parts).contiguous()


@pytest.mark.parametrize("name,dtype,mant,bias,max_code,clamp", [
    ("e4m3fn", torch.float8_e4m3fn, 3, 7, 0x7E, None),         # torch's cast saturates by itself
    ("e5m2-saturating", torch.float8_e5m2, 2, 15, 0x7B, 57344.0),  # what quantize-on-write uses
    ("e5m2-overflow-inf", torch.float8_e5m2, 2, 15, 0x7C, None),  # torch's raw cast
])
def test_fp8_encode_decode_bit_exact(name, dtype, mant, bias, max_code, clamp):
    x = _fp8_probe_values()
    ref = (x.clamp(-clamp, clamp) if clamp else x).to(dtype)
    codes = torch.empty(x.numel(), dtype=torch.uint8, device=DEVICE)
    back = torch.empty(x.numel(), dtype=torch.float32, device=DEVICE)
    block = 4096
    _fp8_probe[(triton.cdiv(x.numel(), block),)](x.to(DEVICE), codes, back, x.numel(), mant, bias, max_code,
                                                 dtype == torch.float8_e4m3fn, block)
    bad = codes.cpu() != ref.view(torch.uint8)
    assert not bad.any(), f"{int(bad.sum())} mismatches, e.g. {x[bad][:5].tolist()}"
    torch.testing.assert_close(back.cpu(), ref.float(), atol=0, rtol=0, equal_nan=True)


import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels.triton_impl.common import decode_fp8, encode_fp8  # noqa: E402


@triton.jit
def _fp8_probe(x_ptr, code_ptr, back_ptr, n, MANT: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr,
               IS_E4M3: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    code = encode_fp8(tl.load(x_ptr + offs, mask=m, other=0.0), MANT, BIAS, MAX_CODE).to(tl.uint8)
    tl.store(code_ptr + offs, code, mask=m)
    tl.store(back_ptr + offs, decode_fp8(code, IS_E4M3), mask=m)
