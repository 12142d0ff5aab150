"""The one record schema: the engine and the simulator write the same step and request columns,
and, run on the same workload, make the same schedule (same scheduler, same KV-cache manager)."""
from __future__ import annotations

import math

import pandas as pd
import pytest

from paged import telemetry
from paged.sim.simulator import SimConfig, Simulator

# columns the executor does not decide: the same plan gives the same values on either
SCHEDULE_COLUMNS = [c for c in telemetry.STEP_COLUMNS if c not in ("time_s", "step_time_s")]
PROMPTS, OUTPUTS = (37, 5, 22, 61, 9, 14), (6, 11, 3, 8, 12, 5)
CACHE = dict(block_size=4, num_blocks=20, max_num_batched_tokens=32, max_model_len=128,
             enable_prefix_caching=False)


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """The same six requests (all at t=0) through the engine (tiny random Llama) and the simulator."""
    pytest.importorskip("transformers")
    import torch

    from paged.engine import LLM, SamplingParams
    from paged.models.testing import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")
    llm = LLM(path, device="cpu", **CACHE)
    g = torch.Generator().manual_seed(0)
    for i, (p, o) in enumerate(zip(PROMPTS, OUTPUTS)):
        llm.engine.add_request(str(i), torch.randint(0, 256, (p,), generator=g).tolist(),
                               SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True))
    steps = []
    while llm.engine.has_unfinished_requests():
        steps.append(llm.engine.step())
    trace = pd.DataFrame({"arrival_time": [0.0] * len(PROMPTS), "prompt_tokens": PROMPTS, "output_tokens": OUTPUTS})
    sim = Simulator(SimConfig(model=f"{path}/config.json", **CACHE))
    return steps, llm.engine.request_rows(), sim.run(trace)


def test_step_rows_have_exactly_the_schema(both):
    steps, _, res = both
    assert all(list(s.to_row()) == list(telemetry.STEP_COLUMNS) for s in steps)
    assert set(telemetry.STEP_COLUMNS) <= set(res.steps.columns)
    assert list(telemetry.steps_frame(steps).columns) == list(res.steps.columns[:len(telemetry.STEP_COLUMNS)])


def test_engine_and_simulator_make_the_same_schedule(both):
    steps, _, res = both
    eng = telemetry.steps_frame(steps)[SCHEDULE_COLUMNS].reset_index(drop=True)
    sim = res.steps[SCHEDULE_COLUMNS].reset_index(drop=True)
    assert eng["num_preempted"].sum() > 0  # the pool is tight: the schedule includes preemptions
    pd.testing.assert_frame_equal(eng, sim, check_dtype=False)


def test_request_rows_agree(both):
    _, rows, res = both
    eng = telemetry.requests_frame(rows).sort_values("request_id").reset_index(drop=True)
    sim = res.requests
    assert list(eng.columns) == list(telemetry.REQUEST_COLUMNS) and set(telemetry.REQUEST_COLUMNS) <= set(sim.columns)
    cols = ["request_id", "num_prompt_tokens", "num_output_tokens", "num_preemptions", "num_cached_tokens"]
    pd.testing.assert_frame_equal(eng[cols], sim[cols].sort_values("request_id").reset_index(drop=True),
                                  check_dtype=False)
    for df in (eng, sim):
        assert (df["ttft_s"] > 0).all() and (df["e2e_s"] >= df["ttft_s"]).all() and (df["queueing_s"] >= 0).all()
        assert (df["tbt_mean_s"] > 0).all()


def test_simulator_is_steppable():
    from paged.sim.workload import synthetic_trace

    trace = synthetic_trace("sharegpt", 30, trace_seed=0, max_model_len=1024)
    sim = Simulator(SimConfig(model="llama-2-7b", gpu="a100-40gb", max_model_len=1024, num_blocks=120,
                              record_events=True))
    rows, used = [], []
    for s in sim.iter_steps(trace):
        assert list(s.row) == list(telemetry.STEP_COLUMNS) and s.events
        used.append(sim.kv.num_used_blocks)  # the live manager, between steps
        rows.append(s.row)
    res = sim.result()
    assert res.summary["requests_finished"] == 30 and sim.kv.num_used_blocks == 0
    assert rows == res.steps[list(telemetry.STEP_COLUMNS)].to_dict("records")
    assert max(used) > 0 and res.recorder is sim.recorder
    gaps = sim.tbt_samples()
    assert len(gaps) and res.summary["tbt_max_s"] == gaps.max()
    assert math.isclose(rows[-1]["time_s"] + rows[-1]["step_time_s"], res.requests["finish_s"].max())
