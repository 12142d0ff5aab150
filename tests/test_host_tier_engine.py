"""Host tier on the real engine (tiny random Llama): lossless, and the copies really happen.

Workload: four shared prefixes of three blocks, asked in waves; the GPU pool holds about two
requests, so each wave's prefixes are evicted by the next and the last wave hits them in
the host tier (recompute without it). Greedy outputs must be identical with the tier on and
off; with it on, the last wave is served from host copies (tier_in > 0) and nothing leaks.
"""
from __future__ import annotations

import random

import pytest

from paged import telemetry

pytest.importorskip("transformers")

BS = 4
CACHE = dict(block_size=BS, num_blocks=14, max_num_batched_tokens=64, max_model_len=64, max_num_seqs=2)


def _prompts():
    rng = random.Random(0)
    prefixes = [[rng.randrange(256) for _ in range(3 * BS)] for _ in range(4)]
    waves = [[0, 1], [2, 3], [0, 1], [2, 3], [0, 2]]
    return [[prefixes[p] + [rng.randrange(256) for _ in range(rng.randrange(1, 6))] for p in w] for w in waves]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from paged.models.testing import make_tiny_checkpoint
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def _run(path, **kw):
    from paged.engine import LLM, SamplingParams
    llm = LLM(path, device="cpu", **{**CACHE, **kw})
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs, rows = [], []
    eng = llm.engine
    for i, wave in enumerate(_prompts()):
        for j, p in enumerate(wave):
            eng.add_request(f"{i}.{j}", p, params)
        while eng.has_unfinished_requests():
            s = eng.step()
            rows.append(s.to_row())
            eng.kv_manager.check_invariants()
            for o in s.finished:
                outs.append((o.request_id, tuple(o.outputs[0].token_ids)))
    return sorted(outs), telemetry.steps_frame(rows), eng.kv_manager


@pytest.mark.parametrize("policy,threshold", [("lru", 1.0), ("score", 1.0), ("lru", 0.7)])
def test_greedy_outputs_identical_with_host_tier(path, policy, threshold):
    base, st0, kv0 = _run(path)
    tier, st1, kv1 = _run(path, enable_host_tier=True, num_cpu_blocks=16, eviction=policy, host_eviction=policy,
                          host_tier_threshold=threshold)
    assert tier == base
    assert st1["num_tier_out_blocks"].sum() > 0 and st1["num_tier_in_blocks"].sum() > 0
    assert (st0[["num_tier_out_blocks", "num_tier_in_blocks", "host_cache_hits"]] == 0).all().all()
    # hits per tier: host hits are tokens of tier-in blocks counted at first admission
    host_hits = int(st1["host_cache_hits"].iloc[-1])
    assert host_hits == kv1.host_cache_hits > 0
    assert host_hits <= BS * int(st1["num_tier_in_blocks"].sum())
    assert kv1.prefix_cache_hits > kv0.prefix_cache_hits  # the host tier saved recompute
    assert kv1.prefix_cache_hits - kv1.host_cache_hits <= kv0.prefix_cache_hits + BS * 3 * 4
    # nothing leaked: no GPU block in use, every CPU block free or a tier entry
    assert kv1.num_used_blocks == 0
    assert kv1.num_free_cpu_blocks + kv1.num_host_cached_blocks == kv1.num_cpu_blocks
    kv1.check_invariants()


def test_host_tier_with_swap_preemption_is_lossless(path):
    """The CPU pool is shared: swap-outs evict tier entries when they need room."""
    tight = dict(preemption_mode="swap", num_cpu_blocks=8, num_blocks=9)
    base, st0, _ = _run(path, **tight)
    tier, st, kv = _run(path, **tight, enable_host_tier=True)
    assert tier == base
    assert st0["num_swapped_out_blocks"].sum() > 0 and st["num_swapped_out_blocks"].sum() > 0
    assert st["num_tier_in_blocks"].sum() > 0 and st["num_host_evicted_blocks"].sum() > 0
    assert kv.num_used_blocks == 0 and kv.num_free_cpu_blocks + kv.num_host_cached_blocks == 8


def test_failed_cache_ops_drop_the_tier_copies(path):
    """A step whose cache ops fail never made its tier copies: the blocks it brought back are
    dropped from the prefix cache and its demoted entries from the host tier, so the same
    prompts run again later give the reference outputs (no hit on K/V that was never copied)."""
    from paged.engine import LLM, SamplingParams
    from paged.errors import StepFailedError

    base, _, _ = _run(path)
    llm = LLM(path, device="cpu", **{**CACHE, "enable_host_tier": True, "num_cpu_blocks": 16})
    eng, runner = llm.engine, llm.engine.runner
    real, failed = runner.apply_cache_ops, []

    def flaky(plan):
        if plan.tier_in and not failed:
            failed.append(plan.step)
            raise RuntimeError("copy failed")
        return real(plan)

    runner.apply_cache_ops = flaky
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = {}
    for i, wave in enumerate(_prompts() * 2):  # the second pass hits whatever the tier kept
        for j, p in enumerate(wave):
            eng.add_request(f"{i}.{j}", p, params)
        while eng.has_unfinished_requests():
            try:
                s = eng.step()
            except StepFailedError:
                continue
            eng.kv_manager.check_invariants()
            outs.update((o.request_id, tuple(o.outputs[0].token_ids)) for o in s.finished)
    assert failed
    ref = dict(base)
    n = len(_prompts())
    for rid, toks in outs.items():
        i, j = rid.split(".")
        assert toks == ref[f"{int(i) % n}.{j}"], rid
    assert eng.kv_manager.num_used_blocks == 0


@pytest.mark.parametrize("dtype", ["int8", "int4_kivi"])
def test_host_tier_lossless_over_quantized_caches(path, dtype):
    """Tier copies move a block's quantized payload and its scales (and int4_kivi's staging
    never holds a full block): outputs equal the same cache format without the tier."""
    base, _, _ = _run(path, kv_cache_dtype=dtype)
    tier, st, kv = _run(path, kv_cache_dtype=dtype, enable_host_tier=True, num_cpu_blocks=16)
    assert tier == base and st["num_tier_in_blocks"].sum() > 0 and kv.num_used_blocks == 0


# the engine and the simulator on one tiered workload: the same schedule, tier columns included
SIM_CACHE = dict(block_size=BS, num_blocks=12, max_num_batched_tokens=32, max_model_len=128, max_num_seqs=2,
                 enable_host_tier=True)
PREFIX = 3 * BS
# (prefix id, own prompt tokens, output tokens), all arriving at t=0
REQS = [(0, 3, 4), (1, 2, 5), (2, 5, 3), (0, 1, 4), (3, 4, 2), (1, 3, 3), (2, 2, 4), (0, 6, 2)]


def test_engine_and_simulator_make_the_same_tiered_schedule(path):
    import pandas as pd

    from paged.engine import LLM, SamplingParams
    from paged.sim.simulator import SimConfig, Simulator

    rng = random.Random(0)
    prefixes = [[rng.randrange(256) for _ in range(PREFIX)] for _ in range(4)]
    llm = LLM(path, device="cpu", num_cpu_blocks=16, **SIM_CACHE)
    for i, (p, own, out) in enumerate(REQS):
        llm.engine.add_request(str(i), prefixes[p] + [rng.randrange(256) for _ in range(own)],
                               SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True))
    steps = []
    while llm.engine.has_unfinished_requests():
        steps.append(llm.engine.step())
    trace = pd.DataFrame({"arrival_time": 0.0, "prompt_tokens": [PREFIX + own for _, own, _ in REQS],
                          "output_tokens": [o for *_, o in REQS], "prefix_id": [p for p, *_ in REQS],
                          "prefix_tokens": PREFIX})
    gib = 16 * Simulator(SimConfig(model=f"{path}/config.json", **SIM_CACHE)).block_bytes / 2**30
    res = Simulator(SimConfig(model=f"{path}/config.json", swap_space_gib=gib, **SIM_CACHE)).run(trace)
    cols = [c for c in telemetry.STEP_COLUMNS if c not in ("time_s", "step_time_s")]
    eng = telemetry.steps_frame(steps)[cols]
    assert eng["num_tier_in_blocks"].sum() > 0 and eng["num_tier_out_blocks"].sum() > 0
    pd.testing.assert_frame_equal(eng, res.steps[cols].reset_index(drop=True), check_dtype=False)
