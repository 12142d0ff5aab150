"""Exact rows as codes (``@krows<b>`` / ``@vrows<b>``): the grammar and its errors, the row codec
(the lab's symmetric rows), the staging and sink pools holding codes and scales, what a write
seals from, copies and swaps, the bits counted, and the engine serving the <= 3-bit format as the
study's cache measures it."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import kernels
from benchmarks.harness import spread_widths
from kernels import format_table as ft
from kernels import split as S
from kernels.split_codec import row_dequantize, row_quantize
from kernels.split_read import _sink_rows
from paged.quant.split_cache import served_bits

KVQ3B = "kivi2.5+pre+alloc+q8/cb2+rot@sink4@win64@krows8@vrows6"  # the alias kvq25


def _layer(name: str, nb: int = 12, bs: int = 8, h: int = 2, d: int = 64, slots: int = 16):
    fmt = kernels.get_format(name)
    tables = kernels.default_tables(fmt, h, d, k_width=spread_widths(fmt.k_side.bits, h, d, 0)) \
        if fmt.k_side.alloc else None
    return kernels.allocate_kv_cache(nb, bs, h, d, fmt, dtype=torch.float32, num_staging_blocks=slots, tables=tables)


def _kv(n: int, h: int = 2, d: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(n, h, d, generator=g), torch.randn(n, h, d, generator=g)
    k[:, :, 3] += 4  # an outlier channel
    return k, v


def test_names_parse_and_bad_ones_say_what_to_change():
    f = ft.lookup("kivi3+pre/cb3@vrows6@win32@krows8@sink4")
    assert f.name == "kivi3+pre/cb3@sink4@win32@krows8@vrows6" and (f.k_rows, f.v_rows) == (8, 6)
    assert ft.lookup("kvq3").k_rows == ft.lookup("kvq3").v_rows == 16
    assert ft.lookup("kvq25").name == KVQ3B
    for bad, match in (("kivi3/cb3@krows8", "add @win"), ("kivi3/cb3@win32@krows9", "b in 2..8"),
                       ("kivi3/cb3@win32@vrows1", "b in 2..8"), ("kivi3/cb3@win32@rows8", "@krows<b>")):
        with pytest.raises(kernels.KVFormatError, match=match):
            ft.lookup(bad)
    with pytest.raises(kernels.ShapeError, match="whole bytes"):
        kernels.allocate_kv_cache(4, 8, 2, 12, "kivi4/cb4_g4@win8@vrows3", dtype=torch.float32)


@pytest.mark.parametrize("bits", [8, 6, 4, 3])
def test_row_codes_are_the_labs_symmetric_rows(bits):
    """The served rows are the lab's ``levels="sym"`` per-token side (fp16 absmax per token-head,
    2**b levels evenly on [-s, s]); packed in b * D / 8 bytes; the error is at most half a step."""
    from paged.quant.lab import quantize_tokens
    from paged.quant.lab_spec import SideSpec
    x = _kv(40)[0] * 3
    codes, scale = row_quantize(x, bits)
    assert codes.dtype == torch.uint8 and codes.shape == (40, 2, bits * 64 // 8) and scale.dtype == torch.float16
    y = row_dequantize(codes, scale, bits, 64)
    lab = quantize_tokens(x, SideSpec(bits, "sym", group=64), None)
    assert torch.allclose(y, lab, rtol=0, atol=1e-5)
    step = 2 * scale.float() / ((1 << bits) - 1)
    assert bool(((y - x).abs() <= step[..., None] / 2 + 1e-6).all())
    assert torch.equal(row_dequantize(*row_quantize(torch.zeros(3, 2, 64), bits), bits, 64), torch.zeros(3, 2, 64))


def test_pools_hold_codes_and_every_reader_sees_them():
    """Staging and sink pools keep uint8 codes + fp16 scales (fewer bytes than fp16 rows); the
    gathered exact rows are the written rows' round trip, sink and window both."""
    coded, plain = _layer("kivi3+pre/cb3+rot@sink4@win16@krows8@vrows6"), _layer("kivi3+pre/cb3+rot@sink4@win16")
    for pool, bits in ((coded.staging, (8, 6)), (coded.sink, (8, 6))):
        assert (pool.k.dtype, pool.k.shape[-1], pool.v.shape[-1]) == (torch.uint8, 64, 48)
        assert pool.k_scale.shape == pool.k.shape[:3] and (pool.k_bits, pool.v_bits) == bits
    assert coded.nbytes() < plain.nbytes()
    k, v = _kv(20)
    slots = torch.arange(20, dtype=torch.int32)  # blocks 0, 1, 2 (block size 8)
    kernels.write_kv(k, v, coded, slots, positions=torch.arange(20))
    _, ke, _, ve, staged = S.gather_split(coded, torch.arange(3))
    kr = row_dequantize(*row_quantize(k.half().float(), 8), 8, 64)
    vr = row_dequantize(*row_quantize(v.half().float(), 6), 6, 64)
    assert bool(staged[:20].all())
    assert torch.equal(ke[:20], kr) and torch.equal(ve[:20], vr)  # rows 0..3 from the sink pool, coded alike
    assert torch.equal(_sink_rows(coded, torch.tensor([0]))[0][0], kr[:4])


def test_a_block_sealed_after_earlier_writes_is_quantized_from_its_staged_codes():
    """What a write seals a KIVI block from: rows staged by earlier writes as their codes read
    back (rounded to fp16), this write's rows as written; one write of the whole block seals
    from the rows as written."""
    k, v = _kv(8)
    pos = torch.arange(8)
    one, two = _layer("kivi3/cb3@win8@krows8"), _layer("kivi3/cb3@win8@krows8")
    kernels.write_kv(k, v, one, torch.arange(8, dtype=torch.int32), positions=pos)
    kernels.write_kv(k[:5], v[:5], two, torch.arange(5, dtype=torch.int32), positions=pos[:5])
    kernels.write_kv(k[5:], v[5:], two, torch.arange(5, 8, dtype=torch.int32), positions=pos[5:])
    t = one.tables
    staged = row_dequantize(*row_quantize(k[:5].half().float(), 8), 8, 64).half()
    for layer, rows in ((one, k.half()), (two, torch.cat([staged, k[5:].half()]))):
        codes, step, zero, _ = S.kivi_quantize(rows.float()[None], t.k_width, False)
        assert torch.equal(layer.k[0], S.pack_bits(codes, t.k_width, t.k_offset, t.k_row_bytes)[0])
        assert torch.equal(layer.k_scale[0], step[0]) and torch.equal(layer.k_zero[0], zero[0])
    assert not torch.equal(one.k[0], two.k[0]) or not torch.equal(one.k_scale[0], two.k_scale[0])


def test_copies_and_swaps_move_codes_and_scales():
    src, dst = _layer(KVQ3B.replace("@win64", "@win16"), nb=6), _layer(KVQ3B.replace("@win64", "@win16"), nb=6)
    k, v = _kv(14)
    kernels.write_kv(k, v, src, torch.arange(14, dtype=torch.int32), positions=torch.arange(14))
    kernels.copy_blocks(src, [[0, 3], [1, 4]])
    want = S.gather_split(src, torch.tensor([0, 1]))
    got = S.gather_split(src, torch.tensor([3, 4]))
    assert torch.equal(want[1][:14], got[1][:14]) and torch.equal(want[3][:14], got[3][:14])
    kernels.swap_blocks(src, dst, [[0, 2], [1, 5]])
    moved = S.gather_split(dst, torch.tensor([2, 5]))
    assert torch.equal(want[1][4:14], moved[1][4:14]) and torch.equal(want[3][4:14], moved[3][4:14])
    src.staging.check()
    dst.staging.check()


def test_the_served_format_is_at_most_three_bits():
    """2.5-bit keys (160 bits per head row), 2-bit values, 96 window rows (three blocks of 32) and 4
    sink rows per sequence in 8- and 6-bit codes with an fp16 scale each, at 2,048 tokens."""
    h, d = 3, 64
    kb, vb, mean = served_bits(KVQ3B, 32, h, d, context=2048)
    k_codes = 2.5 + (2 * d + 4) * 8 / 32 / d  # codes + q8 step/zero codes and two super-scales per block
    assert kb == pytest.approx(k_codes + 100 * (8 + 16 / d) / 2048)
    assert vb == pytest.approx(2 + 16 / 64 + 100 * (6 + 16 / d) / 2048)
    assert mean <= 3.0 and mean == pytest.approx(2.9868, abs=1e-4)
    rows = kernels.bytes_per_token("kivi2.5+pre+alloc+q8/cb2+rot@sink4@win64", h, d, block_size=32)
    assert kernels.bytes_per_token(KVQ3B, h, d, block_size=32) == rows  # the rows are staging, not per token


def test_engine_serves_the_format_as_the_study_measures_it(smollm2):
    """Prompt NLL through the engine == the study's SplitCache on a 200-token prompt (sealed and
    unsealed blocks, the coded sink, a 64-token window that retires blocks), and the engine's
    staging pools hold codes."""
    from paged.engine.llm import LLM
    from paged.quant import chunk_nll, load_texts, make_chunks
    from tests.test_quant_split import _study_nll
    ids = smollm2.tokenizer.encode(load_texts(["kjv"])["kjv"][:3000], add_special_tokens=False)
    n = 200
    chunk = make_chunks({"kjv": ids[:n]}, smollm2.tokenizer, n, max_chunks=1)[0]
    llm = LLM(smollm2, num_blocks=40, block_size=32, kv_cache_dtype=KVQ3B, max_num_batched_tokens=2048,
              enable_prefix_caching=False)
    engine = chunk_nll(llm, [chunk])[0]
    assert np.abs(_study_nll(smollm2, KVQ3B, chunk, n) - engine).max() < 1e-4
    layer = llm.engine.runner.layers[0]
    assert layer.staging.k.dtype == torch.uint8 and layer.sink.v.shape[-1] == 48
