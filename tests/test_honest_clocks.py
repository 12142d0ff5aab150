"""Latencies come from the engine's own time: pausing a dashboard, stepping it by hand or slowing it
down changes no request's TTFT, TBT or e2e (paged.engine.clock); the first-call costs of a process are
paid by a warm-up before anything is timed (paged.engine.warmup)."""
from __future__ import annotations

import time

import numpy as np
import pytest

import paged
from paged import runs

PAUSE_S = 3.0


@pytest.fixture(scope="module")
def llm():
    return paged.LLM(num_blocks=48, block_size=16)


def _run(llm, pause_after: int | None = None, dashboard: bool = False, steps_per_second: float | None = None):
    run = runs.Run(llm.engine.__class__(llm.engine.loaded, llm.engine.config),
                         runs.chat_workload(llm.tokenizer, 5, max_tokens=10, arrive_every=1))
    if dashboard:
        pytest.importorskip("anywidget")
        from paged.viz import live
        dash = live.Dashboard(run, views=("grid", "usage"), steps_per_second=steps_per_second)
        step = dash.step_once
    else:
        step = run.step
    k = 0
    while not run.done:
        t = time.perf_counter()
        step()
        k += 1
        if k == pause_after:
            time.sleep(PAUSE_S)  # the dashboard's pause button, or a lecturer talking
        if steps_per_second:
            time.sleep(max(0.0, 1 / steps_per_second - (time.perf_counter() - t)))
    return run.requests_frame().set_index("request_id").sort_index(), run.tbt_samples()


def test_a_pause_mid_run_changes_no_latency(llm) -> None:
    base, base_tbt = _run(llm)
    paused, paused_tbt = _run(llm, pause_after=4, dashboard=True)
    assert list(base.index) == list(paused.index) and len(base) == 5
    # the pause fell on requests in flight: counted, it would add 3 s to their TTFT or e2e and a 3-s TBT gap;
    # two runs on a busy machine differ by up to ~1 s (steps slowed by other jobs), so half the pause decides
    noise = PAUSE_S / 2
    for col in ("ttft_s", "e2e_s", "queueing_s"):
        diff = (paused[col] - base[col]).abs()
        assert (diff < noise).all(), f"{col} moved by the pause: {diff.to_dict()}"
    assert paused_tbt.max() < PAUSE_S / 2 and len(paused_tbt) == len(base_tbt)


def test_playback_speed_changes_no_latency(llm) -> None:
    base, _ = _run(llm)
    slow, slow_tbt = _run(llm, dashboard=True, steps_per_second=4)  # ~4x slower than the engine here
    wall = slow["e2e_s"]
    assert ((slow["ttft_s"] - base["ttft_s"]).abs() < 1.0).all()
    assert ((wall - base["e2e_s"]).abs() < 1.5).all()


def test_records_read_the_engine_clock(llm) -> None:
    run = runs.Run(llm.engine.__class__(llm.engine.loaded, llm.engine.config),
                         runs.chat_workload(llm.tokenizer, 3, max_tokens=6, arrive_every=1))
    run.step()
    time.sleep(1.0)
    run.run_to_completion()
    steps = run.steps_frame()
    start, end = steps["time_s"].to_numpy(), (steps["time_s"] + steps["step_time_s"]).to_numpy()
    assert np.all(start[1:] >= end[:-1] - 1e-9)            # one step after the other
    assert start[1] - end[0] < 0.5                          # the 1-s sleep between steps is not engine time
    assert abs(run.engine.clock.now() - end[-1]) < 0.05     # the clock stands at the last step's end


def test_warm_up_runs_once_and_leaves_no_trace() -> None:
    from paged.engine import warmup
    llm = paged.LLM(num_blocks=16, block_size=8)  # a block size no engine of this module used: a new key
    eng = llm.engine
    assert eng.warmup_s > 0
    assert eng.clock.now() == 0.0 and not eng.request_rows() and not len(eng.recorder)
    assert eng.kv.num_free_blocks == eng.kv.num_blocks and eng.kv.prefix_cache_queries == 0
    again = paged.LLM(num_blocks=16, block_size=8)
    assert again.engine.warmup_s == 0.0 and len(warmup._warmed) >= 1
