"""Host tier in the simulator: transfers charged, the studies' frames (the engine and the
simulator make the same tiered schedule: tests/test_host_tier_engine.py)."""
from __future__ import annotations

import pytest


def test_simulator_charges_tier_copies():
    from paged.studies.host_tier import tier_study
    df = tier_study(model="llama-2-7b", gpu="a100-40gb", tensor_parallel=1, num_blocks=300, swap_space_gib=2.0,
                    num_requests=40, num_prefixes=16, prefix_tokens=512, rate=20.0,
                    variants=["recompute (no host tier)", "host tier, LRU", "host tier, score"])
    off, lru, score = (df.iloc[i] for i in range(3))
    assert off["swaps"] == 0 and lru["tier_out_blocks"] > 0 and lru["tier_in_blocks"] > 0
    assert lru["prefill_tokens_saved"] > off["prefill_tokens_saved"]
    assert lru["host_hit_rate"] > 0
    assert lru["gpu_hit_rate"] + lru["host_hit_rate"] == pytest.approx(lru["prefix_hit_rate"])
    assert (df["blocks_in_use_at_end"] == 0).all()
    assert lru["gib_moved"] == pytest.approx(lru["swaps"] * lru["block_bytes"] / 2**30)
    from paged.studies.host_tier import swap_claim
    assert "seed claims 40% fewer" in swap_claim(df)


def test_transfer_time_is_in_the_step_time():
    """The same plan with tier copies costs more simulated time than without them."""
    from paged.sim.cost_model import CostModel, step_shape
    from paged.core.scheduler import ScheduledChunk
    from paged.core.request import Request

    cost = CostModel("llama-2-7b", "a100-40gb")
    chunk = [ScheduledChunk(Request("a", [1] * 64, 4), 0, 64, True)]
    assert cost.step_time(step_shape(chunk, 10, 0, 1 << 20)) > cost.step_time(step_shape(chunk, 0, 0, 1 << 20))
