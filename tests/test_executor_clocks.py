"""The time columns of both executors (``paged.telemetry``): seconds, one clock per run, and the
same story of when each request was served.

The schedule tests (tests/test_telemetry.py) compare every column except the time ones; here the
time columns are checked on their own terms, for the engine (a tiny random Llama on CPU), the
simulator and an ``Run`` over the same engine:

- steps: ``time_s`` starts at or after 0 and never goes back, ``step_time_s > 0``, and a step ends
  before the next one starts (``time_s + step_time_s <= next time_s``, within float rounding);
- units: the engine's steps fit in the wall time the test measured around them (milliseconds
  would not), and a simulated step of this model costs about the cost model's step overhead
  (2e-3 s, not 2 ms as a number);
- requests: arrival <= first scheduled <= first token <= finish, TTFT <= e2e, and the derived
  columns equal their definitions; the first scheduling is a step's start, and the first token and
  finish fall inside a step;
- across executors: the same plan serves the same requests in the same steps, so each request's
  first token and finish fall in the same step index on both.
"""
from __future__ import annotations

import math
import time

import numpy as np
import pandas as pd
import pytest

from paged import telemetry

PROMPTS, OUTPUTS = (37, 5, 22, 61, 9, 14), (6, 11, 3, 8, 12, 5)
CACHE = dict(block_size=4, num_blocks=20, max_num_batched_tokens=32, max_model_len=128,
             enable_prefix_caching=False)
EPS = 1e-9   # float rounding of sums of seconds since the clock's start (runs of a few seconds)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    pytest.importorskip("transformers")
    from paged.models.testing import make_tiny_checkpoint
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def _prompts():
    import torch
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (p,), generator=g).tolist() for p in PROMPTS]


@pytest.fixture(scope="module")
def engine_run(path):
    """The six requests through the engine; the wall seconds from before the engine was built
    (its clock's zero is inside that span) to after its last step."""
    from paged.engine import LLM, SamplingParams
    t_before = time.perf_counter()
    llm = LLM(path, device="cpu", **CACHE)
    for i, (ids, o) in enumerate(zip(_prompts(), OUTPUTS)):
        llm.engine.add_request(str(i), ids, SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True))
    steps = []
    while llm.engine.has_unfinished_requests():
        steps.append(llm.engine.step())
    wall = time.perf_counter() - t_before
    st = telemetry.steps_frame(steps)
    rq = telemetry.requests_frame(llm.engine.request_rows()).sort_values("request_id").reset_index(drop=True)
    return st, rq, wall


@pytest.fixture(scope="module")
def sim_run(path):
    from paged.sim.simulator import SimConfig, Simulator
    trace = pd.DataFrame({"arrival_time": [0.0] * len(PROMPTS), "prompt_tokens": PROMPTS, "output_tokens": OUTPUTS})
    res = Simulator(SimConfig(model=f"{path}/config.json", **CACHE)).run(trace)
    st = res.steps[list(telemetry.STEP_COLUMNS)]
    rq = res.requests[list(telemetry.REQUEST_COLUMNS)].sort_values("request_id").reset_index(drop=True)
    return st, rq


def _check_steps(st: pd.DataFrame) -> None:
    t, d = st["time_s"].to_numpy(float), st["step_time_s"].to_numpy(float)
    assert len(t) > 5 and np.isfinite(t).all() and np.isfinite(d).all()
    assert t[0] >= 0 and (d > 0).all()
    assert (np.diff(t) >= 0).all(), "time_s went back"
    gap = t[1:] - (t[:-1] + d[:-1])
    assert (gap >= -EPS).all(), f"a step ends {-gap.min():.3g} s after the next one starts"


def _step_index(times: np.ndarray, st: pd.DataFrame, *, produced: bool) -> np.ndarray:
    """For each time, the step whose [time_s, time_s + step_time_s] holds it (-1: none). Where
    one step ends as the next starts (the simulator), a time a step produced (a token, a finish)
    belongs to the earlier step, a start (first scheduled) to the later one."""
    start = st["time_s"].to_numpy(float)
    end = start + st["step_time_s"].to_numpy(float)
    out = np.full(len(times), -1)
    for i, x in enumerate(times):
        hit = np.flatnonzero((start - EPS <= x) & (x <= end + EPS))
        if len(hit):
            out[i] = hit[0] if produced else hit[-1]
    return out


def _check_requests(rq: pd.DataFrame, st: pd.DataFrame) -> None:
    assert len(rq) == len(PROMPTS) and rq[["first_scheduled_s", "first_token_s", "finish_s"]].notna().all().all()
    a, s, f, e = (rq[c].to_numpy(float) for c in ("arrival_time_s", "first_scheduled_s", "first_token_s", "finish_s"))
    assert (a <= s).all() and (s <= f).all() and (f <= e).all()
    np.testing.assert_allclose(rq["ttft_s"], f - a, rtol=0, atol=EPS)
    np.testing.assert_allclose(rq["e2e_s"], e - a, rtol=0, atol=EPS)
    np.testing.assert_allclose(rq["queueing_s"], s - a, rtol=0, atol=EPS)
    assert (rq["ttft_s"] <= rq["e2e_s"]).all() and (rq["ttft_s"] > 0).all()
    # the mean gap between token steps: (outputs - 1) gaps between the first and the last token
    gaps = rq["tbt_mean_s"].to_numpy(float) * (rq["num_output_tokens"].to_numpy() - 1)
    assert (gaps <= e - f + EPS).all() and (gaps > 0).all()
    # a request is first scheduled at a step's start, gets its first token and finishes inside a step
    assert set(s) <= set(st["time_s"])
    assert (_step_index(f, st, produced=True) >= 0).all() and (_step_index(e, st, produced=True) >= 0).all()


def test_engine_step_clock_in_seconds(engine_run):
    st, _, wall = engine_run
    _check_steps(st)
    d = st["step_time_s"].to_numpy(float)
    end = st["time_s"].iloc[-1] + d[-1]
    # seconds: every step fits in the wall time around the whole run (milliseconds would be 1000x over)
    assert end <= wall and d.sum() <= wall, (end, d.sum(), wall)


def test_simulator_step_clock_in_seconds(sim_run):
    st, rq = sim_run
    _check_steps(st)
    # simulated seconds: contiguous steps from 0 (all requests arrive at t=0) ...
    t, d = st["time_s"].to_numpy(float), st["step_time_s"].to_numpy(float)
    np.testing.assert_allclose(t[1:], t[:-1] + d[:-1], rtol=1e-12)
    # ... each of about the cost model's fixed step overhead (2e-3 s: a 64-wide model's FLOPs and
    # bytes add microseconds on a GPU preset); milliseconds would read ~2, microseconds ~2000
    assert ((2e-3 <= d) & (d < 2.5e-3)).all(), (d.min(), d.max())
    assert math.isclose(rq["finish_s"].max(), t[-1] + d[-1])


@pytest.mark.parametrize("which", ["engine", "simulator"])
def test_request_clock(which, engine_run, sim_run):
    st, rq = engine_run[:2] if which == "engine" else sim_run
    _check_requests(rq, st)


def test_both_executors_serve_each_request_in_the_same_steps(engine_run, sim_run):
    (est, erq, _), (sst, srq) = engine_run, sim_run
    assert len(est) == len(sst)
    assert list(erq.request_id) == list(srq.request_id)
    for col, produced in (("first_scheduled_s", False), ("first_token_s", True), ("finish_s", True)):
        e = _step_index(erq[col].to_numpy(float), est, produced=produced)
        s = _step_index(srq[col].to_numpy(float), sst, produced=produced)
        assert (e >= 0).all() and e.tolist() == s.tolist(), col


def test_engine_run_rows_keep_the_engine_clock(path):
    """``Run`` (paged.runs) stamps its own request rows on the engine's clock: the same
    order of events, and each token lands between its step's start and the next step's."""
    from paged import LLM, runs
    from paged.engine import SamplingParams
    llm = LLM(path, device="cpu", **CACHE)
    wl = [runs.EngineRequest(str(i), ids, SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True), 1 + i)
          for i, (ids, o) in enumerate(zip(_prompts(), OUTPUTS))]
    run = runs.Run(llm, wl).run_to_completion()
    st, rq = run.steps_frame(), run.requests_frame().sort_values("request_id").reset_index(drop=True)
    _check_steps(st)
    assert len(rq) == len(PROMPTS)
    a, s, f, e = (rq[c].to_numpy(float) for c in ("arrival_time_s", "first_scheduled_s", "first_token_s", "finish_s"))
    assert (a <= s).all() and (s <= f).all() and (f <= e).all() and (rq["ttft_s"] <= rq["e2e_s"]).all()
    np.testing.assert_allclose(rq["ttft_s"], f - a, rtol=0, atol=EPS)
    start = st["time_s"].to_numpy(float)
    nxt = np.append(start[1:], np.inf)
    for x in np.concatenate([f, e]):
        i = np.searchsorted(start, x, side="right") - 1
        assert i >= 0 and start[i] <= x <= nxt[i], x
    gaps = run.tbt_samples()
    assert len(gaps) and (gaps > 0).all() and gaps.max() <= e.max() - f.min() + EPS
