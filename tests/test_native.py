"""The compiled CPU kernels (kernels/native) compute what the torch references compute, check
their indices before C reads memory, and step aside cleanly when they cannot be built."""
import pytest
import torch
import torch.nn.functional as F

from kernels import allocate_kv_cache, native
from kernels.errors import BackendUnavailableError, ShapeError
from kernels.reference import decode_attention_ref


def test_ci_has_a_compiler():
    """The suite runs where the kernels build (a missing compiler fails here instead of skipping)."""
    assert native.available(), native.unavailable_reason()


def _case(g, s, hkv, hq, d, bs, lens, num_blocks=40):
    layer = allocate_kv_cache(num_blocks, bs, hkv, d, dtype=torch.float32)
    layer.k.copy_(torch.randn(layer.k.shape, generator=g))
    layer.v.copy_(torch.randn(layer.v.shape, generator=g))
    width = max(1, -(-max(lens) // bs))
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in range(s)]).to(torch.int32)
    fused = torch.randn(s, hq * d + 2 * hkv * d, generator=g)  # q as a strided view, as the model passes it
    q = fused[:, :hq * d].view(s, hq, d)
    return layer, tables, torch.tensor(lens, dtype=torch.int32), q


@pytest.mark.parametrize("hkv,hq,d,bs", [(3, 9, 64, 16),   # SmolLM2: g = 3, vector path
                                         (2, 16, 32, 8),   # g = 8: heads in fours
                                         (2, 10, 64, 4),   # g = 5: scalar scores
                                         (1, 2, 12, 5)])   # d not a multiple of 8: scalar path
def test_decode_matches_reference(hkv, hq, d, bs):
    g = torch.Generator().manual_seed(hq * d + bs)
    lens = [1, bs, bs + 1, 3 * bs - 1, 0, 37]
    layer, tables, seq_lens, q = _case(g, len(lens), hkv, hq, d, bs, lens)
    ref, _ = decode_attention_ref(q, layer, tables, seq_lens, need_lse=False)
    plan = native.DecodePlan(tables, seq_lens, layer.num_blocks, bs, d ** -0.5)
    got = plan(q, layer.k, layer.v)
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5)
    assert torch.equal(got[4], torch.zeros(hq, d))  # an empty context attends to nothing


def test_decode_plan_rejects_indices_outside_the_cache():
    g = torch.Generator().manual_seed(1)
    layer, tables, lens, q = _case(g, 2, 1, 2, 16, 4, [5, 8], num_blocks=8)
    bad = tables.clone()
    bad[1, 1] = 8  # block 8 of an 8-block cache, inside the used length
    with pytest.raises(ShapeError, match=r"block ids must lie in \[0, 8\)"):
        native.DecodePlan(bad, lens, 8, 4, 0.25)
    bad[1, 1] = -1
    with pytest.raises(ShapeError, match="block ids"):
        native.DecodePlan(bad, lens, 8, 4, 0.25)
    with pytest.raises(ShapeError, match="lens must lie"):
        native.DecodePlan(tables, torch.tensor([5, 9]), 8, 4, 0.25)  # 9 > 2 blocks x 4
    unused = tables.clone()
    unused[0, 1] = 99  # past row 0's length (5 tokens = 2 blocks): padding, never read
    native.DecodePlan(unused[:, :2], torch.tensor([4, 8]), 8, 4, 0.25)
    plan = native.DecodePlan(tables, lens, 8, 4, 0.25)
    with pytest.raises(ShapeError, match="k_cache must be"):
        plan(q, layer.k[:4], layer.v)  # a cache of another size than the plan checked
    with pytest.raises(ShapeError, match="q must be"):
        plan(q.double(), layer.k, layer.v)


def test_rms_norm_and_silu_mul_match_torch():
    g = torch.Generator().manual_seed(2)
    for rows, dim in ((1, 576), (16, 576), (7, 33)):
        x, w = torch.randn(rows, dim, generator=g) * 3, torch.randn(dim, generator=g)
        ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
        torch.testing.assert_close(native.rms_norm(x, w, 1e-5), ref, atol=1e-5, rtol=1e-5)
        gu = torch.randn(rows, 2 * dim, generator=g) * 4
        torch.testing.assert_close(native.silu_mul(gu), F.silu(gu[:, :dim]) * gu[:, dim:], atol=1e-5, rtol=1e-5)
    with pytest.raises(ShapeError, match="weight must be"):
        native.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-5)
    with pytest.raises(ShapeError, match="contiguous 2-D float32"):
        native.silu_mul(torch.randn(2, 8).t())
    with pytest.raises(ShapeError, match="even width"):
        native.silu_mul(torch.randn(2, 7))


def test_disabled_is_unavailable_with_a_reason(monkeypatch):
    monkeypatch.setattr(native, "ENABLED", False)
    assert not native.available() and "disabled" in native.unavailable_reason()
    with pytest.raises(BackendUnavailableError, match="PAGED_NATIVE=0"):
        native.rms_norm(torch.randn(2, 8), torch.randn(8), 1e-5)


def test_no_compiler_leaves_the_torch_path(monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    native._library.cache_clear()
    try:
        assert not native.available() and "no C compiler" in native.unavailable_reason()
    finally:
        monkeypatch.undo()
        native._library.cache_clear()
    assert native.available()


def test_build_goes_to_the_cache_folder_and_is_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_NATIVE_DIR", str(tmp_path))
    cc = native.os.environ.get("CC") or native.shutil.which("cc") or native.shutil.which("gcc")
    lib = native._build(cc)
    assert lib.startswith(str(tmp_path)) and native.os.path.exists(lib)
    mtime = native.os.path.getmtime(lib)
    assert native._build(cc) == lib and native.os.path.getmtime(lib) == mtime  # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [native.os.path.basename(lib)]  # no temp files left


def test_engine_greedy_outputs_equal_with_and_without_native(smollm2, monkeypatch):
    """The whole engine on SmolLM2 (decode kernel, norms, SiLU): same greedy tokens, close logprobs."""
    from paged.engine import LLM, SamplingParams
    prompts = [list(range(100, 100 + n)) for n in (5, 23, 40)]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)

    def run():
        llm = LLM(smollm2, num_blocks=32, block_size=16, record_events=False)
        return [o.outputs[0] for o in llm.generate(prompts, sp)]

    on = run()
    monkeypatch.setattr(native, "ENABLED", False)
    off = run()
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    lp = lambda outs: torch.tensor([next(iter(d.values())) for o in outs for d in o.logprobs])  # noqa: E731
    torch.testing.assert_close(lp(on), lp(off), atol=1e-4, rtol=0)


def test_rope_is_bit_identical_to_the_torch_ops():
    """Compiled without FMA contraction: each product and the sum round as torch's ops round them."""
    g = torch.Generator().manual_seed(3)
    t, h, d = 7, 5, 64
    fused = torch.randn(t, h * d + 32, generator=g) * 10  # heads as a strided view of a wider row
    x = fused[:, :h * d].view(t, h, d)
    cos, sin = torch.randn(t, d, generator=g), torch.randn(t, d, generator=g)
    ref = x * cos[:, None] + x.roll(d // 2, -1) * sin[:, None]
    assert torch.equal(native.rope(x, cos, sin), ref)
    with pytest.raises(ShapeError, match="cos must be"):
        native.rope(x, cos[:3], sin)
    with pytest.raises(ShapeError, match="x must be"):
        native.rope(x.double(), cos, sin)


def test_a_compiler_without_march_native_or_openmp_still_builds(tmp_path, monkeypatch):
    """The flag variants: a cc that rejects -march=native and -fopenmp (some clang builds) gets
    the plain -O3 library, and its kernels still compute the reference."""
    real = native.shutil.which("cc") or native.shutil.which("gcc")
    picky = tmp_path / "picky-cc"
    picky.write_text(f'#!/bin/sh\nfor a in "$@"; do case "$a" in -march=native|-fopenmp) exit 1;; esac; done\n'
                     f'exec {real} "$@"\n')
    picky.chmod(0o755)
    monkeypatch.setenv("PAGED_NATIVE_DIR", str(tmp_path / "cache"))
    lib = native.ctypes.CDLL(native._build(str(picky)))
    x, w = torch.randn(3, 40), torch.randn(40)
    out = torch.empty_like(x)
    lib.rms_norm_f32.argtypes = [native.ctypes.c_void_p] * 2 + [native.ctypes.c_float, native.ctypes.c_int64,
                                                                 native.ctypes.c_int64, native.ctypes.c_void_p]
    lib.rms_norm_f32(x.data_ptr(), w.data_ptr(), 1e-5, 3, 40, out.data_ptr())
    torch.testing.assert_close(out, w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)))


def test_decode_with_openmp_threads_equals_one_thread():
    """Rows are split across OpenMP threads (torch.get_num_threads()); each row's arithmetic is the
    same on any thread, so the result is bit-identical to one thread."""
    g = torch.Generator().manual_seed(4)
    lens = [17, 1, 40, 0, 33, 8, 25, 16]
    layer, tables, seq_lens, q = _case(g, len(lens), 3, 9, 64, 16, lens)
    plan = native.DecodePlan(tables, seq_lens, layer.num_blocks, 16, 0.125)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = plan(q, layer.k, layer.v)
        torch.set_num_threads(2)
        two = plan(q, layer.k, layer.v)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
