"""The native decode (kernels/native/quant_decode.c) reads exact rows kept as codes
(``@krows<b>``/``@vrows<b>``: the staging and sink pools' rows as b-bit symmetric codes with an
fp16 scale per token-head) as the torch reference does (split_decode_ref, row_dequantize)."""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels.native import quant as nq
from kernels.split import split_decode_ref

from test_kernels_split import _fill, _layer
from test_native_quant import _q, _tables

ROWS = ["kivi2.5+pre+alloc+q8/cb2+rot@sink4@win64@krows8@vrows6",
        "kivi3+pre+alloc+q8/cb3+rot@sink4@win32@krows6@vrows4",
        "fp16/cb2+rot@sink4@win32@krows8", "kivi4+pre/cb3@win16@krows2@vrows3",
        "kivi2+q8/fp16@sink4@win16@vrows5", "kivi3+pre+alloc+q8/cb4+rot@sink8@win16@krows4@vrows7"]


def _case(name: str, step: int | None, bs: int = 16):
    """A layer of ``name`` filled with sequences that cross the window and block boundaries."""
    g = torch.Generator().manual_seed(11)
    h, d, nb = 3, 64, 48
    layer = _layer(name, nb=nb, bs=bs, h=h, d=d, slots=nb)
    lens = [1, 3, 4, 5, 16, 17, 31, 33, 64, 65, 97, 120]
    tabs = _tables(g, len(lens), nb, 8)
    _fill(layer, lens, tabs, seed=5, step=step)
    q = _q(g, len(lens), 3 * h, d)
    return layer, q, torch.tensor(tabs, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("name", ROWS)
@pytest.mark.parametrize("step", [None, 7])
def test_native_decode_reads_coded_exact_rows(name, step):
    layer, q, bt, sl = _case(name, step)
    fmt = layer.kv_format
    assert fmt.k_rows != 16 or fmt.v_rows != 16
    assert layer.staging.k_bits == fmt.k_rows and layer.sink is None or layer.sink.v_bits == fmt.v_rows
    assert nq.supports(layer), "the native decode must take coded exact rows"
    ref = split_decode_ref(q, layer, bt, sl, 0.125)[0]
    got = kernels.paged_decode_attention(q, layer, None, bt, sl, scale=0.125, backend="native")
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch_out = kernels.paged_decode_attention(q, layer, None, bt, sl, scale=0.125, backend="torch")
    torch.testing.assert_close(got, torch_out, atol=1e-5, rtol=1e-5)
    assert torch.equal(nq.decode(q, layer, bt, sl, 0.125), got)


def test_coded_rows_are_what_the_native_decode_reads():
    """Doubling the scales of the newest block's coded rows changes the native output as it changes
    the reference (the native path reads the pool's codes and scales, not some other copy)."""
    layer, q, bt, sl = _case(ROWS[0], None)
    before = nq.decode(q, layer, bt, sl, 0.125)
    pool = layer.staging
    slot = int(pool.map_host[bt[-1, (int(sl[-1]) - 1) // layer.block_size]])
    pool.v_scale[slot] *= 2
    pool.k_scale[slot] *= 2
    after = nq.decode(q, layer, bt, sl, 0.125)
    assert not torch.equal(after[-1], before[-1])
    torch.testing.assert_close(after, split_decode_ref(q, layer, bt, sl, 0.125)[0], atol=1e-5, rtol=1e-5)


def _pool_state(layer) -> dict[str, torch.Tensor]:
    """Every tensor a write may change, the staging and sink pools' codes and scales included."""
    out = {n: getattr(layer, n) for n in ("k", "v", "k_scale", "v_scale", "k_zero", "k_super")}
    for which in ("staging", "sink"):
        pool = getattr(layer, which)
        if pool is not None:
            out.update({f"{which}.{i}": t for i, t in enumerate(pool.tensors())})
            out[f"{which}.map"] = pool.map_host
    return {n: (t.view(torch.uint8) if t.is_floating_point() else t).clone() for n, t in out.items() if t is not None}


@pytest.mark.parametrize("name", ROWS)
def test_native_write_of_coded_rows_is_bit_identical_to_the_reference(name, monkeypatch):
    """Prompts in pieces, then one token per call: codes and scales of both pools, seals of KIVI
    blocks from coded staged rows (on the reference, reading what the native write staged)."""
    from kernels.native import quant_write
    from test_native_write import _writes, count_native_writes
    g = torch.Generator().manual_seed(5)
    bs, h, d, nb = 8, 2, 64, 48
    ref, nat = _layer(name, nb=nb, bs=bs, h=h, d=d, slots=nb), _layer(name, nb=nb, bs=bs, h=h, d=d, slots=nb)
    assert quant_write.supports(nat)
    taken = count_native_writes(monkeypatch)
    lens, tabs = [5, 17, 30], [list(range(0, 10)), list(range(10, 20)), list(range(20, 30))]
    for k, v, sl, pos in _writes(g, lens, tabs, bs, h, d, extreme=True):
        k[0, 1] = 0.0  # an all-zero row: scale 0, every code the middle level
        kernels.write_kv(k, v, ref, sl.int(), positions=pos, backend="torch")
        kernels.write_kv(k, v, nat, sl.int(), positions=pos, backend="native")
        a, b = _pool_state(ref), _pool_state(nat)
        for n in a:
            assert torch.equal(a[n], b[n]), n
    assert sum(taken) >= 80, "the compiled write took too few of the tokens"
