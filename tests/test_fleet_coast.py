"""The decode fast-forward (paged.fleet.coast) changes nothing but speed: a fleet run with coasting
gives exactly the frames of the same run stepped one by one (on a pool that preempts and swaps too),
most of its steps are coasted, and CostModel.decode_run_times is step_time row by row, bit for bit.
The KV-event tap's kinds filter: a listener hears its kinds only, recording is unchanged."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import paged.fleet.coast as coast_mod
from paged.connect import tap
from paged.core import events as ev
from paged.fleet.sim import SimFleet
from paged.fleet.workloads import shared_prefix_trace
from paged.sim.config import SimConfig, build_cost_model
from paged.sim.cost_model import StepShape
from paged.sim.simulator import Simulator
from paged.sim.specs import get_model

TRACE = shared_prefix_trace(120, rate=5.0, num_prefixes=6, output_tokens=48, seed=3)


def frames(cfg, policy, monkeypatch, coast_on):
    monkeypatch.setattr(coast_mod, "MIN_STEPS", coast_mod.MIN_STEPS if coast_on else 10**9)
    taken = []
    real = coast_mod.coast

    def counting(replica, horizon):
        n = real(replica, horizon)
        taken.append(n)
        return n
    monkeypatch.setattr("paged.fleet.sim_replica.coast", counting)
    fleet = SimFleet(cfg, policy, num_replicas=3)
    res = fleet.run(TRACE, down_at={2: 12.0})
    return res, sum(taken)


@pytest.mark.parametrize("cfg", [
    SimConfig(model="llama-2-7b", gpu="a100-80gb", block_size=16, num_blocks=1200),
    SimConfig(model="llama-2-7b", gpu="a100-80gb", block_size=16, num_blocks=160, preemption_mode="swap",
              num_cpu_blocks=400),
    SimConfig(model="llama-2-7b", gpu="a100-80gb", block_size=16, num_blocks=160, enable_prefix_caching=False),
], ids=["roomy", "swap", "no_caching"])
def test_coasting_gives_the_frames_of_stepping_one_by_one(cfg, monkeypatch):
    with pytest.warns(Warning):
        a, coasted = frames(cfg, "kv_aware", monkeypatch, True)
    with pytest.warns(Warning):
        b, none = frames(cfg, "kv_aware", monkeypatch, False)
    assert none == 0 and coasted > len(a.steps) // 3          # most decode steps were coasted
    for x, y in ((a.requests, b.requests), (a.steps, b.steps), (a.routing, b.routing)):
        pd.testing.assert_frame_equal(x, y, check_exact=True)
    assert {k: v for k, v in a.summary.items() if k != "wall_s"} == \
        {k: v for k, v in b.summary.items() if k != "wall_s"}


@pytest.mark.parametrize("tp,n", [(1, 1), (4, 3), (8, 7), (2, 8), (8, 13)])
def test_decode_run_times_is_step_time_row_by_row(tp, n):
    cfg = SimConfig(model="llama-3.1-70b" if tp > 1 else "llama-2-7b", gpu="a100-80gb", tensor_parallel=tp)
    cost = build_cost_model(cfg, get_model(cfg.model))
    rng = np.random.default_rng(n)
    ctx = rng.integers(1, 60_000, n).tolist()
    got = cost.decode_run_times(ctx, 40)
    want = [cost.step_time(StepShape(np.ones(n), np.array(ctx, dtype=np.float64) + s, n)) for s in range(40)]
    assert got.tolist() == want


def test_the_tap_calls_a_listener_for_its_kinds_only_and_keeps_recording():
    sim = Simulator(SimConfig(model="llama-2-7b", gpu="a100-80gb", num_blocks=200, record_events=True))
    heard, every = [], []
    t = tap.install(sim, lambda *e: heard.append(e[1]), {ev.CACHE_BLOCK, ev.EVICT})
    tap.install(sim, lambda *e: every.append(e[1]))
    sim.run(shared_prefix_trace(10, rate=5.0, num_prefixes=2, output_tokens=8))
    kinds = [e[1] for e in t.events]
    assert ev.CACHE_BLOCK in heard and heard == [k for k in kinds if k in (ev.CACHE_BLOCK, ev.EVICT)]
    assert every == kinds and ev.ALLOCATE in kinds     # the unfiltered one hears all, all recorded
    tap.remove(sim, every.append)                     # not a listener: nothing changes
    assert t.kinds is None


def test_step_log_refuses_a_run_without_its_moving_fields_and_keeps_its_rows():
    from paged.fleet.step_log import StepLog
    log = StepLog()
    with pytest.raises(ValueError, match="moving fields"):
        log.add_run(1, (0,) * 20, [0.1, 0.2])
    assert len(log) == 0 and log.runs == [] and len(log.step_time_s) == 0
