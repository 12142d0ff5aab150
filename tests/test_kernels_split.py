"""Split KV formats (kernels/split.py): the format table, bit packing, codecs, writes with staging,
the Triton kernels against the torch reference (interpreter), copies and swaps, bad input."""
from __future__ import annotations

import itertools

import pytest
import torch

import kernels
from benchmarks.harness import spread_widths
from kernels import format_table as ft
from kernels import split as S
from kernels.backend import interpreter_enabled

FORMATS = ["kivi3+pre+alloc+q8/cb3+rot@sink4@win16", "kivi4+pre/cb4", "kivi2+q8/cb2_g32+rot",
           "fp16/cb3+rot@win16", "kivi3/fp16", "kivi5+alloc/cb5+rot@win8",
           "kivi2.5+pre+alloc+q8/cb2+rot@sink4@win16"]


def _widths(fmt, h, d, seed=0):
    return spread_widths(fmt.k_side.bits, h, d, seed)


def _layer(name, nb=12, bs=8, h=2, d=64, slots=16, seed=0):
    fmt = kernels.get_format(name)
    tables = None
    if fmt.k_side.alloc:
        tables = kernels.default_tables(fmt, h, d, k_width=_widths(fmt, h, d, seed))
    return kernels.allocate_kv_cache(nb, bs, h, d, fmt, dtype=torch.float32, num_staging_blocks=slots, tables=tables)


def _fill(layer, lens, tables, seed=0, step=None):
    """Write sequences of ``lens`` tokens through ``tables`` (in pieces of ``step``, or at once)."""
    g = torch.Generator().manual_seed(seed)
    bs, h, d = layer.block_size, layer.num_kv_heads, layer.head_dim
    for L, tb in zip(lens, tables):
        k, v = torch.randn(L, h, d, generator=g), torch.randn(L, h, d, generator=g)
        k[:, :, 3] += 4  # an outlier channel
        slots = torch.tensor(tb)[torch.arange(L) // bs] * bs + torch.arange(L) % bs
        pieces = [(0, L)] if step is None else [(a, min(L, a + step)) for a in range(0, L, step)]
        for a, b in pieces:
            kernels.write_kv(k[a:b], v[a:b], layer, slots[a:b].int(), positions=torch.arange(a, b))


def test_names_parse_to_canonical_split_formats():
    f = ft.lookup("kivi3+q8+alloc+pre/cb3+rot@win32@sink4")
    assert f.split and f.name == "kivi3+pre+alloc+q8/cb3+rot@sink4@win32" and f.staged and f.calibrated
    assert (f.k_side.bits, f.k_side.pre_rope, f.k_side.alloc, f.k_side.compact) == (3, True, True, True)
    assert (f.v_side.bits, f.v_side.group, f.v_side.rotate) == (3, 64, True)
    assert ft.lookup(f.name) == f
    plain = ft.lookup("kivi4/fp16")
    assert not plain.calibrated and plain.staged and plain.v_side.exact


@pytest.mark.parametrize("bad,match", [
    ("kivi9/cb3", "2..8"), ("cb3/cb3", "value format"), ("kivi3/kivi3", "key format"),
    ("kivi3/cb3@foo", "@sink<S>, @win<W>, @krows<b> or @vrows<b>"), ("fp16/fp16", "nothing quantized"),
    ("kivi3+rot/cb3", "not a side"),
    ("int3/int3", "unknown"), ("kivi3/cb3+pre", "not a side"), ("kivi2.5/cb3", "add \\+alloc"),
    ("kivi1.5+alloc/cb3", "2..8")])
def test_bad_names_say_what_to_change(bad, match):
    with pytest.raises(kernels.KVFormatError, match=match):
        ft.lookup(bad)


@pytest.mark.parametrize("bad,bs,match", [
    ("kivi3/cb3_g48", 16, "divide head_dim 64"), ("kivi3/cb3@win8", 16, "at least one block"),
    ("kivi3/cb3@sink4", 16, "add @win"), ("kivi3/cb3@sink32@win32", 16, "fit in the first block"),
    ("kivi2.49+alloc/cb3", 16, "multiple of 0.125 bits")])
def test_bad_geometry_says_what_to_change(bad, bs, match):
    with pytest.raises(kernels.ShapeError, match=match):
        ft.bytes_per_token(bad, 2, 64, block_size=bs)
    with pytest.raises(kernels.ShapeError, match=match):
        kernels.allocate_kv_cache(4, bs, 2, 64, bad, dtype=torch.float32)


@pytest.mark.parametrize("name,bs", [(n, b) for n in FORMATS for b in (8, 16)
                                     if not 0 < kernels.get_format(n).window < b])  # a window spans a block
def test_bytes_per_token_is_what_the_allocator_allocates(name, bs):
    nb, h, d = 6, 3, 64
    layer = _layer(name, nb=nb, bs=bs, h=h, d=d, slots=2)
    fixed = sum(p.nbytes() for p in (layer.staging, layer.sink) if p is not None)
    per_tok = ft.bytes_per_token(name, h, d, block_size=bs)
    assert abs((layer.nbytes() - fixed) - nb * bs * per_tok) < nb * bs  # per-block bytes rounded up per token
    f = kernels.get_format(name)
    assert (ft.staging_tokens_per_seq(name, bs) - f.sink) % bs == 0  # whole staged blocks + the sink rows


@pytest.mark.parametrize("name,bs,rows", [
    ("kvq3", 16, 3 * 16 + 4), ("kvq3", 32, 2 * 32 + 4), ("kvq3", 64, 2 * 64 + 4),  # ceil(32 / bs) + 1 blocks + sink
    ("kivi3+pre+alloc+q8/cb3+rot@sink4@win16", 16, 2 * 16 + 4), ("kivi4+pre/cb4", 32, 32),  # no window: one block
    ("kivi2+q8/cb2_g32+rot", 8, 8), ("int8", 16, 0)])
def test_staging_rows_per_sequence_are_the_window_blocks_and_the_sink(name, bs, rows):
    assert ft.staging_tokens_per_seq(name, bs) == rows


def test_bit_packing_round_trips_any_widths_and_is_int4_at_four_bits():
    g = torch.Generator().manual_seed(1)
    fmt = kernels.get_format("kivi3/fp16")
    w = _widths(fmt, 3, 64, seed=5)
    off, rb = S.bit_layout(w, 3)
    codes = (torch.rand(7, 3, 64, generator=g) * (1 << w).float()).long()
    packed = S.pack_bits(codes, w, off, rb)
    assert packed.shape == (7, 3, 24) and torch.equal(S.unpack_bits(packed, w, off), codes)
    w4 = S.uniform_widths(3, 64, 4)
    off4, rb4 = S.bit_layout(w4, 4)
    c4 = torch.randint(0, 16, (5, 3, 64), generator=g)
    assert torch.equal(S.pack_bits(c4, w4, off4, rb4), kernels.pack_int4(c4))
    with pytest.raises(kernels.KVFormatError, match="sum to 192"):
        S.bit_layout(w4, 3)


def test_codecs_bound_their_error():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, 2, 64, generator=g)
    lv = S.normal_levels(4, 64)
    codes, s = S.cb_quantize(x, lv, 64)
    y = S.cb_dequantize(codes, s, lv)
    gap = (lv[1:] - lv[:-1]).max() * x.abs().amax(-1, keepdim=True) / lv.abs().max()
    assert ((y - x).abs() <= gap / 2 + 1e-3).all()
    w = _widths(kernels.get_format("kivi3/fp16"), 2, 64)
    blk = torch.randn(5, 8, 2, 64, generator=g)
    for compact in (False, True):
        c, st, z, sup = S.kivi_quantize(blk, w, compact)
        assert int(c.max()) <= 255 and bool((c < (1 << w.long())).all() | (w == 0).all())
        y = S.kivi_dequantize(c, w, st, z, sup)
        step, zero = S.kivi_step_zero(st, z, sup)
        assert ((y - blk).abs() <= step.unsqueeze(1) * (0.5 + (w == 0).float()) + 2e-3 * blk.abs().amax()).all()


@pytest.mark.parametrize("name", FORMATS)
def test_token_by_token_writes_store_what_one_write_stores(name):
    bs = 8
    lens, tables = [45, 7, 17], [[3, 7, 1, 0, 5, 9], [2], [4, 6, 8]]
    a, b = _layer(name, bs=bs), _layer(name, bs=bs)
    _fill(a, lens, tables)
    _fill(b, lens, tables, step=1)
    for x, y in zip(a.block_tensors(), b.block_tensors()):
        assert torch.equal(x, y)
    if a.staging is not None:
        for blk in range(a.num_blocks):
            sa, sb = int(a.staging.map_host[blk]), int(b.staging.map_host[blk])
            assert (sa >= 0) == (sb >= 0)
            if sa >= 0:
                assert torch.equal(a.staging.k[sa], b.staging.k[sb])
        a.staging.check()
        b.staging.check()


def test_positions_are_required_where_the_format_uses_them():
    layer = _layer("kivi3+pre/cb3")
    k = torch.randn(3, 2, 64)
    with pytest.raises(kernels.ShapeError, match="positions="):
        kernels.write_kv(k, k, layer, torch.arange(3, dtype=torch.int32))


def test_staging_exhaustion_changes_nothing():
    layer = _layer("kivi3/cb3@win8", bs=8, slots=2)
    before = [t.clone() for t in layer.block_tensors()]
    k = torch.randn(24, 2, 64)
    with pytest.raises(kernels.StagingExhaustedError, match="staging pool is full"):
        kernels.write_kv(k, k, layer, torch.arange(24, dtype=torch.int32), positions=torch.arange(24))
    assert all(torch.equal(x, y) for x, y in zip(before, layer.block_tensors()))
    assert layer.staging.num_used == 0


def test_window_blocks_leave_staging_once_no_query_reads_them():
    fmt = kernels.get_format("kivi3/cb3@sink2@win8")
    assert S.window_out_blocks([[5, 6, 7, 8]], [32], fmt, 8) == [5, 6, 7]  # the sink has its own pool
    assert S.window_out_blocks([[5, 6, 7, 8]], [25], fmt, 8) == [5, 6]
    assert S.window_out_blocks([[5, 6]], [9], fmt, 8) == []
    assert S.window_out_blocks([[5, 6]], [9], kernels.get_format("kivi3/cb3"), 8) == []


def _reads(layer, lens, tables, backend, seed=3):
    g = torch.Generator().manual_seed(seed)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    sl = torch.tensor(lens, dtype=torch.int32)
    hq = 4 * layer.num_kv_heads
    q = torch.randn(len(lens), hq, layer.head_dim, generator=g)
    dec = kernels.paged_decode_attention(q, layer, None, bt, sl, backend=backend)
    qn = [min(5, L) for L in lens]
    qsl = torch.tensor([0] + torch.tensor(qn).cumsum(0).tolist(), dtype=torch.int32)
    qp = torch.randn(int(qsl[-1]), hq, layer.head_dim, generator=g)
    pre = kernels.paged_prefill_attention(qp, layer, None, bt, sl, qsl, backend=backend)
    return dec, pre


@pytest.mark.skipif(not interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (tests/conftest.py sets it)")
@pytest.mark.parametrize("name,bs", list(zip(FORMATS, itertools.cycle([8, 16]))))
def test_triton_kernels_equal_the_torch_reference(name, bs):
    pytest.importorskip("triton")
    fmt = kernels.get_format(name)
    if fmt.window and fmt.window < bs:
        bs = 8
    layer = _layer(name, bs=bs, nb=16, slots=16)
    lens, tables = [45, 7, 17], [[3, 7, 1, 0, 5, 9], [2], [4, 6, 8]]
    _fill(layer, lens, tables)
    ref = _reads(layer, lens, tables, "torch")
    tri = _reads(layer, lens, tables, "interpreter")
    for a, b in zip(ref, tri):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), float((a - b).abs().max())


def test_decode_equals_the_prefill_reference_at_the_last_position():
    layer = _layer("kivi3+pre+alloc+q8/cb3+rot@sink4@win16", bs=8)
    lens, tables = [45, 17], [[3, 7, 1, 0, 5, 9], [4, 6, 8]]
    _fill(layer, lens, tables)
    q = torch.randn(2, 8, 64)
    bt = torch.tensor([[3, 7, 1, 0, 5, 9], [4, 6, 8, 0, 0, 0]], dtype=torch.int32)
    sl = torch.tensor(lens, dtype=torch.int32)
    dec = kernels.paged_decode_attention(q, layer, None, bt, sl, backend="torch")
    pre = kernels.paged_prefill_attention(q, layer, None, bt, sl, torch.tensor([0, 1, 2], dtype=torch.int32),
                                          backend="torch")
    assert torch.allclose(dec, pre, atol=1e-5)


@pytest.mark.parametrize("name", ["kivi3+pre+alloc+q8/cb3+rot@sink4@win16", "kivi4/cb4+rot"])
def test_copies_and_swaps_move_codes_and_exact_rows(name):
    lens, tables = [21], [[0, 1, 2]]
    a = _layer(name, bs=8)
    _fill(a, lens, tables)
    kernels.copy_blocks([a], [(0, 5), (1, 6), (2, 7)])
    ref = _reads(a, lens, tables, "torch")
    moved = _reads(a, lens, [[5, 6, 7]], "torch")
    assert all(torch.equal(x, y) for x, y in zip(ref, moved))
    host = _layer(name, bs=8)
    host.tables = a.tables
    kernels.swap_blocks([a], [host], [(5, 9), (6, 10), (7, 11)])
    back = _reads(host, lens, [[9, 10, 11]], "torch")
    assert all(torch.equal(x, y) for x, y in zip(ref, back))


@pytest.mark.parametrize("name", ["kivi3+pre+alloc+q8/cb3+rot@sink4@win16", "fp16/cb3+rot@sink2@win8"])
def test_retired_window_blocks_are_not_read_and_the_sink_pool_serves_the_first_tokens(name):
    """After a step, blocks out of every window leave staging; the next token's decode (and a
    one-token extend) reads the same values as without retirement, on the torch path and in the
    Triton kernels (interpreter)."""
    bs = 8
    lens, tables = [45, 17], [[3, 7, 1, 0, 5, 9], [4, 6, 8]]
    fmt = kernels.get_format(name)
    kept, retired = _layer(name, bs=bs, nb=16), _layer(name, bs=bs, nb=16)
    for layer in (kept, retired):
        _fill(layer, lens, tables)
    out = S.window_out_blocks(torch.tensor([t + [0] * (6 - len(t)) for t in tables]), lens, fmt, bs)
    assert out  # some blocks left every window
    kernels.release_window(retired, out)
    assert all(int(retired.staging.map_host[b]) < 0 for b in out)
    assert int(retired.sink.map_host[tables[0][0]]) >= 0  # the sink slot stays until the block is freed
    g = torch.Generator().manual_seed(9)
    k, v = torch.randn(2, 2, 64, generator=g), torch.randn(2, 2, 64, generator=g)
    slots = torch.tensor([tables[0][45 // bs] * bs + 45 % bs, tables[1][17 // bs] * bs + 17 % bs], dtype=torch.int32)
    for layer in (kept, retired):
        kernels.write_kv(k, v, layer, slots, positions=torch.tensor([45, 17]))
    lens1 = [46, 18]
    backends = ["torch"] + (["interpreter"] if interpreter_enabled() else [])
    ref = _reads(kept, lens1, tables, "torch")
    for be in backends:
        got = _reads(retired, lens1, tables, be)
        # decode reads position L-1 = the new token: identical; the 5-token extend's first queries
        # sit before it and may read retired rows, so only the last row of each sequence is compared
        assert torch.allclose(ref[0], got[0], atol=1e-5), (be, float((ref[0] - got[0]).abs().max()))


# exact rows as codes (@krows/@vrows): (format, block size); 6- and 3-bit codes straddle bytes
ROWS_FORMATS = [("kivi2.5+pre+alloc+q8/cb2+rot@sink4@win64@krows8@vrows6", 16),
                ("kivi3+pre+alloc+q8/cb3+rot@sink4@win32@krows6@vrows4", 8),
                ("fp16/cb2+rot@sink4@win32@krows8", 16),  # exact fp16 K side, coded K rows, fp16 V rows
                ("kivi4/cb4@sink2@win16@krows3@vrows2", 8)]


def _chunked_extend_and_decode(layer, lens, tables, step, queries=7, seed=0):
    """Write ``lens`` tokens per sequence ``step`` at a time; after each chunk run an extend of its
    last ``queries`` tokens (prefill over everything cached; few rows keep the interpreter quick),
    then retire the blocks out of every window, as an engine step does; finally write one token
    more per sequence and decode it (``tables`` hold ``L + 1`` tokens). Yields ``(what, torch
    output, interpreter output)``."""
    g = torch.Generator().manual_seed(seed)
    bs, h, d = layer.block_size, layer.num_kv_heads, layer.head_dim
    hq = 4 * h
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    kv = []
    for L in lens:
        k, v = torch.randn(L + 1, h, d, generator=g), torch.randn(L + 1, h, d, generator=g)
        k[:, :, 3] += 4  # an outlier channel
        kv.append((k, v))

    def write(spans: list[tuple[int, int]]) -> torch.Tensor:
        for (k, v), tb, (a, e) in zip(kv, tables, spans):
            if e > a:
                slots = torch.tensor(tb)[torch.arange(a, e) // bs] * bs + torch.arange(a, e) % bs
                kernels.write_kv(k[a:e], v[a:e], layer, slots.int(), positions=torch.arange(a, e))
        return torch.tensor([e for _, e in spans], dtype=torch.int32)

    for a in range(0, max(lens), step):
        spans = [(min(L, a), min(L, a + step)) for L in lens]
        sl = write(spans)
        qn = torch.tensor([min(queries, e - b) for b, e in spans])
        qsl = torch.tensor([0] + qn.cumsum(0).tolist(), dtype=torch.int32)
        qp = torch.randn(int(qsl[-1]), hq, d, generator=g)
        yield (f"extend [{a}, {a + step})",
               *(kernels.paged_prefill_attention(qp, layer, None, bt, sl, qsl, backend=be)
                 for be in ("torch", "interpreter")))
        kernels.release_window(layer, S.window_out_blocks(bt, sl, layer.kv_format, bs))
    sl = write([(L, L + 1) for L in lens])
    q = torch.randn(len(lens), hq, d, generator=g)
    yield ("decode", *(kernels.paged_decode_attention(q, layer, None, bt, sl, backend=be)
                       for be in ("torch", "interpreter")))


@pytest.mark.skipif(not interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (tests/conftest.py sets it)")
@pytest.mark.parametrize("name,bs", ROWS_FORMATS)
def test_triton_kernels_read_coded_exact_rows_like_the_torch_reference(name, bs):
    """``@krows``/``@vrows``: the sink pool's and the window's rows are codes with per-row scales;
    the Triton kernels (interpreter) read both pools as the torch reference does, for sequences
    longer and shorter than sink + window, crossing blocks, written and extended in chunks."""
    pytest.importorskip("triton")
    fmt = kernels.get_format(name)
    layer = _layer(name, bs=bs, nb=16, slots=16)
    for pool in (layer.staging, layer.sink):  # both pools keep coded rows, with scales
        assert (pool.k_bits, pool.v_bits) == (fmt.k_rows, fmt.v_rows)
        assert (pool.k_scale is not None, pool.v_scale is not None) == (fmt.k_rows < 16, fmt.v_rows < 16)
    w = fmt.window
    # past sink + window (codes, sink and window rows); just past the window; one block and a bit
    lens = [w + fmt.sink + bs + 3, w + 5, 9]
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(7)).tolist()
    tables, used = [], 0
    for L in lens:
        n = -(-(L + 1) // bs)
        tables.append(perm[used:used + n])
        used += n
    assert used <= 16
    step = max(bs, w // 2) + 5  # chunks end mid-block
    for what, ref, got in _chunked_extend_and_decode(layer, lens, tables, step):
        assert torch.allclose(ref, got, atol=1e-5, rtol=1e-5), (what, float((ref - got).abs().max()))
