"""The compiled fused decode over quantized KV (kernels/native/quant_decode.c) computes what the
torch references compute, for every served format, and the engine's greedy outputs and prompt
log-probs do not change when it takes that path."""
from __future__ import annotations

import platform

import pytest
import torch

import kernels
from kernels import native
from kernels.native import quant as nq
from kernels.reference import decode_attention_ref
from kernels.split import split_decode_ref

from test_kernels_split import _fill, _layer

SPLIT = ["kivi3+pre+alloc+q8/cb3+rot@sink4@win16", "kivi4+pre/cb4", "kivi2+q8/cb2_g32+rot", "fp16/cb3+rot@win16",
         "kivi3/fp16", "kivi5+alloc/cb5+rot@win8", "kivi4+pre+alloc+q8/cb4+rot@sink4@win16",
         "kivi2+pre+alloc+q8/cb2+rot@sink4@win16", "kivi2.5+pre+alloc+q8/cb2+rot@sink4@win16"]
PLAIN = ["int8", "int4", "fp8_e4m3", "fp8_e5m2", "fp16", "bf16", "int4_kivi"]


def _tables(g, n, nb, width):
    return [torch.randperm(nb, generator=g)[:width].tolist() for _ in range(n)]


def _q(g, s, hq, d):
    fused = torch.randn(s, hq * d + 16, generator=g)  # a strided view, as the model passes it
    return fused[:, :hq * d].view(s, hq, d)


@pytest.mark.parametrize("name", SPLIT)
@pytest.mark.parametrize("step", [None, 5])
def test_split_decode_matches_the_reference(name, step):
    """Sealed and unsealed KIVI blocks, the sink and window rows, written at once or in pieces."""
    g = torch.Generator().manual_seed(7)
    bs, h, d, nb = 8, 2, 64, 24
    layer = _layer(name, nb=nb, bs=bs, h=h, d=d, slots=24)
    lens = [1, 7, 8, 9, 23, 33, 40]
    tabs = _tables(g, len(lens), nb, 5)
    _fill(layer, lens, tabs, seed=3, step=step)
    q = _q(g, len(lens), 3 * h, d)
    bt, sl = torch.tensor(tabs, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    ref = split_decode_ref(q, layer, bt, sl, 0.125)[0]
    got = nq.decode(q, layer, bt, sl, 0.125)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(kernels.paged_decode_attention(q, layer, None, bt, sl, scale=0.125, backend="native"), got)


@pytest.mark.parametrize("group", [1, 2, 4, 5])
@pytest.mark.parametrize("name", ["kvq3", "kivi4+pre/cb4_g16"])
def test_split_decode_for_each_query_group(name, group):
    """Query heads per KV head 1-4 (the fused value path keeps that many heads' sums in registers)
    and 5 (the tiled path): the same references."""
    g = torch.Generator().manual_seed(9)
    bs, h, d, nb = 8, 2, 64, 24
    layer = _layer(kernels.get_format(name).name, nb=nb, bs=bs, h=h, d=d, slots=24)
    lens = [1, 8, 23, 40]
    tabs = _tables(g, len(lens), nb, 5)
    _fill(layer, lens, tabs, seed=3, step=7)
    q = _q(g, len(lens), group * h, d)
    bt, sl = torch.tensor(tabs, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    ref = split_decode_ref(q, layer, bt, sl, 0.125)[0]
    torch.testing.assert_close(nq.decode(q, layer, bt, sl, 0.125), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("name", ["kvq3", "kivi4+pre/cb4", "kivi2.5+pre+alloc+q8/cb2+rot@sink4@win48",
                                  "kivi5+alloc/cb5+rot@win32"])
def test_split_decode_in_long_blocks(name, d):
    """Blocks of 32 tokens, so that a run of coded key rows spans whole and partial 16-token chunks
    (the AVX-512 key scores reduce 16 tokens at a time) and stops at the window, at head_dim 64 and
    128 (5-bit keys at 128: rows over 64 bytes, unpacked through memory): the same references."""
    g = torch.Generator().manual_seed(11)
    bs, h, nb = 32, 2, 24
    layer = _layer(kernels.get_format(name).name, nb=nb, bs=bs, h=h, d=d, slots=24)
    lens = [1, 16, 17, 47, 64, 100, 129]
    tabs = _tables(g, len(lens), nb, 5)
    _fill(layer, lens, tabs, seed=5, step=13)
    q = _q(g, len(lens), 3 * h, d)
    bt, sl = torch.tensor(tabs, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    ref = split_decode_ref(q, layer, bt, sl, 0.125)[0]
    torch.testing.assert_close(nq.decode(q, layer, bt, sl, 0.125), ref, atol=1e-5, rtol=1e-5)


def _fill_plain(layer, lens, tabs, g):
    """Random K/V (one outlier channel) written through the torch path in pieces of 6 tokens
    (int4_kivi: blocks sealed and staged)."""
    bs, h, d = layer.block_size, layer.num_kv_heads, layer.head_dim
    for L, tb in zip(lens, tabs):
        k, v = torch.randn(L, h, d, generator=g), torch.randn(L, h, d, generator=g)
        k[:, :, 5] += 3
        slots = torch.tensor(tb, dtype=torch.long)[torch.arange(L) // bs] * bs + torch.arange(L) % bs
        for a in range(0, L, 6):
            kernels.write_kv(k[a:a + 6], v[a:a + 6], layer, slots[a:a + 6].int(), backend="torch")


@pytest.mark.parametrize("name", PLAIN)
def test_plain_decode_matches_the_reference(name):
    g = torch.Generator().manual_seed(11)
    bs, h, d, nb = 16, 3, 64, 30
    layer = kernels.allocate_kv_cache(nb, bs, h, d, name, dtype=torch.float32)
    if layer.kv_format.is_fp8:
        layer.k_scale[:] = torch.tensor([0.01, 0.02, 0.05])
        layer.v_scale[:] = torch.tensor([0.03, 0.01, 0.02])
    lens = [1, 15, 16, 17, 40, 0, 77]
    tabs = _tables(g, len(lens), nb, 5)
    _fill_plain(layer, lens, tabs, g)
    q = _q(g, len(lens), 9, d)
    bt, sl = torch.tensor(tabs, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    ref = decode_attention_ref(q, layer, bt, sl, 0.125, need_lse=False)[0]
    got = nq.decode(q, layer, bt, sl, 0.125)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[5], torch.zeros(9, d))  # an empty context attends to nothing


# instruction sets below -march=native that this CPU can run: each has its own code paths in
# quant_decode.c (AVX-512 16 lanes, AVX2 8 lanes, portable C), and -march=native tests only one
_NARROWER = [v for v, need in ((["-mavx2", "-mfma", "-mf16c"], {"avx2", "fma", "f16c"}), ([], set()))
             if platform.machine() == "x86_64" and need <= set(native._cpu_key().split())]


@pytest.mark.parametrize("flags", _NARROWER, ids=lambda v: " ".join(v) or "baseline")
def test_every_instruction_set_path_matches_the_reference(flags, tmp_path, monkeypatch):
    """The library built for a narrower instruction set than this CPU's (AVX2, or x86-64's
    baseline) computes the same references: the paths -march=native does not take here."""
    monkeypatch.setenv("PAGED_NATIVE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_VARIANTS", [flags])
    native._library.cache_clear()
    try:
        g = torch.Generator().manual_seed(5)
        bs, h, d, nb = 8, 2, 64, 24
        lens = [1, 9, 23, 40]
        for name in ["kvq3", "kvq25", "kivi4+pre/cb4", "int4_kivi", "int8"]:
            fmt = kernels.get_format(name)
            tabs = _tables(g, len(lens), nb, 5)
            if fmt.split:
                layer = _layer(fmt.name, nb=nb, bs=bs, h=h, d=d, slots=24)
                _fill(layer, lens, tabs, seed=3, step=5)
            else:
                layer = kernels.allocate_kv_cache(nb, bs, h, d, name, dtype=torch.float32)
                _fill_plain(layer, lens, tabs, g)
            q = _q(g, len(lens), 3 * h, d)
            bt, sl = torch.tensor(tabs, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
            ref = (split_decode_ref(q, layer, bt, sl, 0.125) if fmt.split
                   else decode_attention_ref(q, layer, bt, sl, 0.125, need_lse=False))[0]
            torch.testing.assert_close(nq.decode(q, layer, bt, sl, 0.125), ref, atol=1e-5, rtol=1e-5)
        built = list(tmp_path.glob("paged_native_*.so"))
        assert len(built) == 1  # the narrower build was the one that ran
    finally:
        monkeypatch.undo()
        native._library.cache_clear()


def test_native_backend_is_selectable_and_says_when_it_cannot_run(monkeypatch):
    assert kernels.resolve_backend("native", torch.device("cpu")) == "native"
    monkeypatch.setattr(native, "ENABLED", False)
    with pytest.raises(kernels.BackendUnavailableError, match="PAGED_NATIVE=0"):
        kernels.resolve_backend("native", torch.device("cpu"))
    layer = kernels.allocate_kv_cache(4, 8, 1, 64, "int8", dtype=torch.float32)
    assert not nq.supports(layer)
    with pytest.raises(kernels.ShapeError, match="does not take"):
        nq.decode(torch.zeros(1, 1, 64), layer, torch.zeros(1, 1, dtype=torch.int32),
                  torch.ones(1, dtype=torch.int32), 0.1)


def test_native_decode_checks_tables_before_c_reads_them():
    layer = _layer("kivi3+pre+alloc+q8/cb3+rot@sink4@win16", nb=6, bs=8, h=2, d=64, slots=6)
    q = torch.zeros(1, 2, 64)
    with pytest.raises(kernels.ShapeError, match="not a block of this cache"):
        kernels.paged_decode_attention(q, layer, None, torch.tensor([[9, 0]], dtype=torch.int32),
                                       torch.tensor([10], dtype=torch.int32), backend="native")


@pytest.mark.parametrize("fmt", ["int8", "int4_kivi", "kvq3", "kivi2.5+pre+alloc+q8/cb2+rot@sink4@win32"])
def test_engine_outputs_unchanged_by_the_native_path(smollm2, fmt, monkeypatch):
    """Every decode call of a real engine run: the native output within 1e-5 of the torch
    reference on the same cache; greedy tokens identical to a torch-path run. Log-probs of the
    two runs agree closely but not bit for bit: float noise of ~1e-6 in one step's attention
    flips a few codes of the next tokens' K/V at rounding boundaries (docs/quant.md)."""
    from paged.engine import LLM, SamplingParams
    prompts = [list(range(200, 200 + n)) for n in (5, 40, 70)]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    orig, diffs = kernels.paged_decode_attention, []

    def both(q, layer, v, bt, sl, **kw):
        out = orig(q, layer, v, bt, sl, **kw)
        if kw.get("backend") == "native":
            ref = orig(q, layer, v, bt, sl, **{**kw, "backend": "torch"})
            diffs.append(float((out - ref).abs().max()))
        return out

    def run(backend):
        llm = LLM(smollm2, num_blocks=24, block_size=32, kv_cache_dtype=fmt, enable_prefix_caching=False,
                  attention_backend=backend, record_events=False)
        return [o.outputs[0] for o in llm.generate(prompts, sp)]

    monkeypatch.setattr(kernels, "paged_decode_attention", both)
    fast = run("native")
    monkeypatch.undo()
    ref = run("torch")
    assert len(diffs) >= 30 * 11 and max(diffs) < 1e-5  # at least 11 decode steps x 30 layers
    assert [o.token_ids for o in fast] == [o.token_ids for o in ref]
    lp = lambda outs: torch.tensor([next(iter(d.values())) for o in outs for d in o.logprobs])  # noqa: E731
    assert (lp(fast) - lp(ref)).abs().mean() < 0.01
