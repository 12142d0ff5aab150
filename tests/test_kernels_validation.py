"""Bad block ids and sequence lengths are refused with a ShapeError that names the bad value,
before any backend runs (they used to read another block, or raise a raw IndexError)."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import ShapeError

H, D, BS, NB = 2, 16, 4, 6
BACKENDS = ["torch"]
try:
    from kernels.backend import interpreter_enabled
    if interpreter_enabled():
        BACKENDS.append("interpreter")
except ImportError:  # no triton: the torch reference alone
    pass


def _layer() -> kernels.KVCacheLayer:
    layer = kernels.allocate_kv_cache(NB, BS, H, D, "fp16")
    x = torch.randn(NB * BS, H, D)
    kernels.write_kv(x, x, layer, torch.arange(NB * BS, dtype=torch.int32))
    return layer


def _i32(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int32)


def _decode(layer, table, lens, backend):
    q = torch.randn(len(lens), H, D, generator=torch.Generator().manual_seed(0))
    return kernels.paged_decode_attention(q, layer, None, _i32(table), _i32(lens), backend=backend)


def _prefill(layer, table, lens, backend):
    qsl = _i32([0] + torch.tensor(lens).cumsum(0).tolist())
    q = torch.randn(int(qsl[-1]), H, D, generator=torch.Generator().manual_seed(0))
    return kernels.paged_prefill_attention(q, layer, None, _i32(table), _i32(lens), qsl, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("run", [_decode, _prefill], ids=["decode", "prefill"])
@pytest.mark.parametrize("bad", [NB, 99, -1])
def test_out_of_range_block_id_is_named(run, bad, backend):
    layer = _layer()
    table = [[0, 1, 2], [3, bad, 5]]
    with pytest.raises(ShapeError, match=rf"block_tables\[1, 1\] = {bad} is not a block of this cache"):
        run(layer, table, [3, 2 * BS], backend)


@pytest.mark.parametrize("run", [_decode, _prefill], ids=["decode", "prefill"])
def test_padding_past_the_used_blocks_is_not_checked(run):
    """Entries past ceil(seq_len / block_size) are padding (the engine pads with 0; -1 and junk are fine)."""
    layer = _layer()
    out = run(layer, [[2, -1, 77], [4, 5, -9]], [BS, BS + 1], "torch")
    ref = run(layer, [[2, 0, 0], [4, 5, 0]], [BS, BS + 1], "torch")
    assert torch.equal(out, ref)


@pytest.mark.parametrize("run", [_decode, _prefill], ids=["decode", "prefill"])
def test_bad_seq_lens_name_the_offending_value(run):
    layer = _layer()
    with pytest.raises(ShapeError, match=r"got seq_lens\[0\] = -3"):
        run(layer, [[0, 1], [2, 3]], [-3, 8], "torch")
    with pytest.raises(ShapeError, match=r"lie in \[0, 8\].*got seq_lens\[1\] = 9"):
        run(layer, [[0, 1], [2, 3]], [1, 9], "torch")


def test_device_checks_follow_the_debug_flag(monkeypatch):
    """Value checks on device tensors cost a sync: they run only with PAGED_KERNEL_CHECKS=1."""
    from kernels.api import _check_values
    meta = torch.empty(1, device="meta")
    assert _check_values(torch.empty(1)) and not _check_values(meta)
    monkeypatch.setenv("PAGED_KERNEL_CHECKS", "1")
    assert _check_values(meta)


def test_write_kv_takes_a_layer_only():
    """One calling convention: loose cache tensors are refused (with the way to wrap them), nothing written."""
    k = torch.zeros(NB, BS, H, D, dtype=torch.float16)
    x = torch.ones(1, H, D)
    with pytest.raises(ShapeError, match="as_layer"):
        kernels.write_kv(x, x, k, torch.zeros(1, dtype=torch.int32))
    assert not k.any()
    layer = kernels.as_layer(k, torch.zeros_like(k))
    kernels.write_kv(x, x, layer, torch.zeros(1, dtype=torch.int32))
    assert bool((k[0, 0] == 1).all())
