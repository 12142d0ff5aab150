"""Cross-layer KV sharing (``EngineConfig.kv_share_with``): shared layers allocate nothing, the
byte budget counts only owner layers, a shared layer attends over its owner's cache (checked
against a cache-per-sequence reference), no map = today's outputs, bad maps are rejected
before anything is built; and the study's Jensen–Shannon distance behaves as a distance."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from paged.engine import LLM, SamplingParams  # noqa: E402
from paged.engine.kv_sharing import cache_index, check_share_map, owner_layers  # noqa: E402
from paged.errors import ConfigError  # noqa: E402
from paged.models.testing import make_tiny_checkpoint  # noqa: E402
from paged.quant.runs import greedy  # noqa: E402
from paged.studies.sharing import SharedKVAttention, disjoint_pairs, js_distance  # noqa: E402

PROMPTS = [list(range(3, 30)), list(range(40, 49)), [7, 8, 9]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny4"), "llama", num_layers=4)


@pytest.fixture(scope="module")
def loaded(tiny):
    return LLM(tiny, device="cpu", num_blocks=4).loaded


def _run(llm):
    outs = llm.generate(PROMPTS, GREEDY)
    lps = [torch.tensor([next(iter(d.values())) for d in o.prompt_logprobs[1:]]) for o in outs]
    return [list(o.outputs[0].token_ids) for o in outs], lps


def _reference(model, share):
    """Greedy tokens and prompt log-probs with a per-sequence cache that shares as ``share`` says."""
    cfg = model.config
    toks, lps = [], []
    for p in PROMPTS:
        toks.append(greedy(model, p, SharedKVAttention(cfg.num_layers, share), 6))
        cache = SharedKVAttention(cfg.num_layers, share)
        with torch.inference_mode():
            h = model(torch.tensor(p), torch.arange(len(p)), cache)
            logp = torch.log_softmax(model.compute_logits(h[:-1]), -1)
        lps.append(logp.gather(1, torch.tensor(p[1:])[:, None])[:, 0])
    return toks, lps


def test_shared_layers_allocate_nothing_and_budget_counts_owners(tiny):
    plain = LLM(tiny, device="cpu", kv_cache_memory_bytes=1 << 20)
    shared = LLM(plain.loaded, kv_cache_memory_bytes=1 << 20, kv_share_with={1: 0, 3: 2})
    r = shared.engine.runner
    assert len(r.layers) == 2 and len(plain.engine.runner.layers) == 4
    assert len(r.layer_caches) == 4 and r.layer_caches[1] is r.layers[0] and r.layer_caches[3] is r.layers[1]
    assert r.layer_caches[2] is r.layers[1] and r.shared == {1, 3}
    assert shared.engine.kv.num_blocks == 2 * plain.engine.kv.num_blocks  # same bytes, twice the blocks
    assert r.cache_bytes() <= 1 << 20
    fixed = LLM(plain.loaded, num_blocks=16, kv_share_with={1: 0, 2: 0, 3: 0})
    assert fixed.engine.runner.cache_bytes() * 4 == LLM(plain.loaded, num_blocks=16).engine.runner.cache_bytes()


def test_no_map_means_unchanged_outputs(tiny):
    base = LLM(tiny, device="cpu", num_blocks=64, block_size=8)
    want = _run(base)
    for m in (None, {}):
        llm = LLM(base.loaded, num_blocks=64, block_size=8, kv_share_with=m)
        assert llm.engine.config.kv_share_with is None and len(llm.engine.runner.layers) == 4
        got = _run(llm)
        assert got[0] == want[0]
        for a, b in zip(got[1], want[1]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("planned", [True, False], ids=["torch_plan", "kernels_path"])
@pytest.mark.parametrize("chunk", [None, 8], ids=["one_chunk", "chunked"])
def test_shared_layer_reads_owner_cache(tiny, planned, chunk):
    share = {1: 0, 3: 0}
    llm = LLM(tiny, device="cpu", num_blocks=64, block_size=4, kv_share_with=share, enable_prefix_caching=False,
              max_num_batched_tokens=chunk)
    llm.engine.runner.planned = planned
    toks, lps = _run(llm)
    ref_toks, ref_lps = _reference(llm.loaded.model, share)
    assert toks == ref_toks
    for a, b in zip(lps, ref_lps):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0)
    plain_toks, plain_lps = _reference(llm.loaded.model, None)
    assert any(not torch.allclose(a, b, atol=1e-3) for a, b in zip(lps, plain_lps))  # the map took effect


@pytest.mark.parametrize("swap_mode", ["sync", "overlap"])
def test_sharing_under_swap_preemption_is_lossless(loaded, swap_mode):
    roomy = LLM(loaded, num_blocks=64, block_size=4, kv_share_with={2: 1})
    tight = LLM(loaded, num_blocks=14, block_size=4, kv_share_with={2: 1}, preemption_mode="swap",
                swap_mode=swap_mode)  # 14 blocks: the three requests swap (7 blocks out)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in roomy.generate(PROMPTS, sp)]
    got = [o.outputs[0].token_ids for o in tight.generate(PROMPTS, sp)]
    assert got == want and tight.engine.runner.swap.bytes_out > 0  # the tight pool did swap
    assert tight.engine.runner.swap.host_layers and len(tight.engine.runner.cpu_layers) == 3


@pytest.mark.parametrize("share, needle", [
    ({1: 1}, "shares with itself"), ({0: 1}, "earlier layer"), ({1: 0, 2: 1}, "is itself shared"),
    ({9: 0}, "out of range"), ({-1: 0}, ">= 0"), ({"1": 0}, "integer layer"), ({1: True}, "integer layer"),
    ([(1, 0)], "dict"),
])
def test_bad_maps_rejected_before_anything_is_built(loaded, share, needle):
    with pytest.raises(ConfigError, match=needle):
        LLM(loaded, num_blocks=10 ** 12, kv_share_with=share)  # a cache that size would fail differently


def test_map_helpers():
    assert check_share_map({2: 0, 1: 0}, 4) == {2: 0, 1: 0}
    assert owner_layers({1: 0, 3: 2}, 4) == [0, 2] and cache_index({1: 0, 3: 2}, 4) == [0, 0, 1, 1]
    assert cache_index(None, 3) == [0, 1, 2]
    assert disjoint_pairs([3, 2, 0, 4], 2) == {1: 0, 4: 3}
    with pytest.raises(ConfigError, match="lower k"):
        disjoint_pairs([0, 1], 2)


def test_js_distance_is_a_distance():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, 5, 7, generator=g), -1)
    q = torch.softmax(torch.randn(3, 5, 7, generator=g), -1)
    assert torch.allclose(js_distance(p, p), torch.zeros(3, 5, dtype=torch.float64), atol=1e-7)
    assert torch.equal(js_distance(p, q), js_distance(q, p))
    d = js_distance(p, q)
    assert (d > 0).all() and (d <= 1).all()
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    assert float(js_distance(a, b)) == pytest.approx(1.0)  # disjoint supports: the maximum


def test_simulator_counts_owner_layers_for_capacity_not_for_reads():
    import dataclasses

    from paged.sim.cost_model import CostModel, StepShape
    from paged.sim.specs import get_model, kv_cache_sizing
    full = get_model("llama-3-70b")
    shared = dataclasses.replace(full, kv_layers=56)  # 24 of 80 layers share: 30% less KV
    assert shared.kv_bytes_per_token() * 80 == full.kv_bytes_per_token() * 56
    a, b = (kv_cache_sizing(m, "a100-80gb", tensor_parallel=4) for m in (full, shared))
    assert b.num_blocks >= int(a.num_blocks * 80 / 56)  # more blocks in the same KV bytes
    step = StepShape.make([1] * 8, [4000] * 8)  # decode reads every layer's (owner's) K/V either way
    t_full, t_shared = (CostModel(m, "a100-80gb", 4).step_time(step) for m in (full, shared))
    assert t_shared == pytest.approx(t_full)
    with pytest.raises(ConfigError, match="kv_layers"):
        dataclasses.replace(full, kv_layers=81)


@pytest.mark.parametrize("fmt", ["int8", "int4_kivi"])
def test_sharing_over_quantized_caches(loaded, fmt):
    """The general kernels path (quantized formats, int4_kivi's staging pool) with a shared layer."""
    llm = LLM(loaded, num_blocks=32, block_size=4, kv_cache_dtype=fmt, kv_share_with={1: 0, 2: 0})
    assert len(llm.engine.runner.layers) == 2 and not llm.engine.runner.planned
    toks, lps = _run(llm)
    assert all(len(t) == 6 for t in toks) and all(torch.isfinite(x).all() for x in lps)
