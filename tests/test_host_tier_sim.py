"""Host tier in the simulator: the same schedule (tier columns included) as the engine on the
same workload, transfers charged, the studies' frames."""
from __future__ import annotations

import random

import pandas as pd
import pytest

from paged import telemetry
from paged.sim.simulator import SimConfig, Simulator

BS = 4
CACHE = dict(block_size=BS, num_blocks=12, max_num_batched_tokens=32, max_model_len=128, max_num_seqs=2,
             enable_host_tier=True)
PREFIX = 3 * BS
# (prefix id, own prompt tokens, output tokens), all arriving at t=0
REQS = [(0, 3, 4), (1, 2, 5), (2, 5, 3), (0, 1, 4), (3, 4, 2), (1, 3, 3), (2, 2, 4), (0, 6, 2)]


def test_engine_and_simulator_make_the_same_tiered_schedule(tmp_path):
    pytest.importorskip("transformers")
    from paged.engine import LLM, SamplingParams
    from paged.models.testing import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path, "llama")
    rng = random.Random(0)
    prefixes = [[rng.randrange(256) for _ in range(PREFIX)] for _ in range(4)]
    llm = LLM(path, device="cpu", num_cpu_blocks=16, **CACHE)
    for i, (p, own, out) in enumerate(REQS):
        llm.engine.add_request(str(i), prefixes[p] + [rng.randrange(256) for _ in range(own)],
                               SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True))
    steps = []
    while llm.engine.has_unfinished_requests():
        steps.append(llm.engine.step())
    trace = pd.DataFrame({"arrival_time": 0.0, "prompt_tokens": [PREFIX + own for _, own, _ in REQS],
                          "output_tokens": [o for *_, o in REQS], "prefix_id": [p for p, *_ in REQS],
                          "prefix_tokens": PREFIX})
    gib = 16 * Simulator(SimConfig(model=f"{path}/config.json", **CACHE)).block_bytes / 2**30
    res = Simulator(SimConfig(model=f"{path}/config.json", swap_space_gib=gib, **CACHE)).run(trace)
    cols = [c for c in telemetry.STEP_COLUMNS if c not in ("time_s", "step_time_s")]
    eng = telemetry.steps_frame(steps)[cols]
    assert eng["num_tier_in_blocks"].sum() > 0 and eng["num_tier_out_blocks"].sum() > 0
    pd.testing.assert_frame_equal(eng, res.steps[cols].reset_index(drop=True), check_dtype=False)


def test_simulator_charges_tier_copies():
    from paged.sim.tiers import tier_study
    df = tier_study(model="llama-2-7b", gpu="a100-40gb", tensor_parallel=1, num_blocks=300, swap_space_gib=2.0,
                    num_requests=40, num_prefixes=16, prefix_tokens=512, rate=20.0,
                    variants=["recompute (no host tier)", "host tier, LRU", "host tier, score"])
    off, lru, score = (df.iloc[i] for i in range(3))
    assert off["swaps"] == 0 and lru["tier_out_blocks"] > 0 and lru["tier_in_blocks"] > 0
    assert lru["prefill_tokens_saved"] > off["prefill_tokens_saved"]
    assert lru["host_hit_rate"] > 0 and lru["gpu_hit_rate"] + lru["host_hit_rate"] == pytest.approx(lru["prefix_hit_rate"])
    assert (df["blocks_in_use_at_end"] == 0).all()
    assert lru["gib_moved"] == pytest.approx(lru["swaps"] * lru["block_bytes"] / 2**30)
    from paged.sim.tiers import swap_claim
    assert "seed claims 40% fewer" in swap_claim(df)


def test_transfer_time_is_in_the_step_time():
    """The same plan with tier copies costs more simulated time than without them."""
    from paged.sim.cost_model import CostModel, step_shape
    from paged.core.scheduler import ScheduledChunk
    from paged.core.request import Request

    cost = CostModel("llama-2-7b", "a100-40gb")
    chunk = [ScheduledChunk(Request("a", [1] * 64, 4), 0, 64, True)]
    assert cost.step_time(step_shape(chunk, 10, 0, 1 << 20)) > cost.step_time(step_shape(chunk, 0, 0, 1 << 20))
