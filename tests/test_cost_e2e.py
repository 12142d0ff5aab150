"""End-to-end calibration plumbing: serving a trace on our engine in trace time, fitting, simulating,
the vLLM mapping, and the streaming client against a local fake server (no timing asserts)."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace as NS

import numpy as np
import pandas as pd
import pytest

from paged.core.config import CacheConfig, SchedulerConfig
from paged.sim.cost_model import CostModel, StepShape
from paged.studies import cost_e2e as ce
from paged.studies import cost_vllm as cv

CACHE = CacheConfig(block_size=16, num_blocks=64, enable_prefix_caching=False)
SCHED = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def served():
    import paged
    from paged.engine import LLMEngine

    from paged.core.config import flat_knobs
    llm = paged.LLM(**flat_knobs(CACHE, SCHED))
    trace = ce.make_trace(ce.Workload("tiny", 5, 50.0, (8, 40), (8, 14), 3))
    return trace, ce.run_engine(LLMEngine(llm.engine.loaded, llm.engine.config), trace, seed=3)


def test_run_engine_serves_every_request_in_trace_time(served):
    trace, (steps, secs, ttft, tbt) = served
    assert len(ttft) == len(trace) and (ttft["ttft_s"] > 0).all()
    assert len(tbt) == int((trace["output_tokens"] - 1).sum()) and (tbt > 0).all()
    assert len(secs) == len(steps) and (secs > 0).all()
    # every output token came from a step, and the token budget of 64 forces chunked prefills
    assert sum(len(s.new_tokens) for s in steps) == int(trace["output_tokens"].sum())
    assert max(sum(c.num_tokens for c in s.scheduled) for s in steps) <= 64
    # a request's TTFT is at least the CPU time of the steps between its arrival and its first token
    assert ttft["ttft_s"].min() >= secs.min()


def test_calibrate_and_simulate_the_same_trace(served):
    trace, (steps, secs, _, _) = served
    rep = ce.calibrate(steps, secs)
    assert rep.n_train + rep.n_holdout == sum(1 for s in steps if s.scheduled)
    ttft, tbt = ce.simulate(trace, rep.model, CACHE, SCHED)
    assert len(ttft) == len(trace) and len(tbt) == int((trace["output_tokens"] - 1).sum())
    stats = ce.latency_stats(ttft, tbt)
    assert set(stats) == {"ttft_p50_s", "ttft_p99_s", "tbt_p50_s", "tbt_p99_s"}
    assert stats["ttft_p50_s"] <= stats["ttft_p99_s"] and stats["tbt_p50_s"] <= stats["tbt_p99_s"]


def test_make_trace_is_seeded_and_within_its_ranges():
    w = ce.HELD_OUT
    a, b = ce.make_trace(w), ce.make_trace(w)
    pd.testing.assert_frame_equal(a, b)
    assert a["arrival_time"].iloc[0] == 0 and a["arrival_time"].is_monotonic_increasing
    assert a["prompt_tokens"].between(*w.prompt_tokens).all() and a["output_tokens"].between(*w.output_tokens).all()


def test_scaled_cost_is_alpha_plus_beta_times_each_step():
    cm = CostModel("smollm2-135m", "cpu", step_overhead_s=3e-3, per_seq_s=1e-4, per_token_s=2e-6)
    s2 = cv.scaled(cm, 0.01, 2.5)
    for shape in (StepShape.make([1] * 8, [300] * 8), StepShape.make([200, 1], [0, 50])):
        assert s2.step_time(shape) == pytest.approx(0.01 + 2.5 * cm.step_time(shape), rel=1e-12)


def test_metric_means_are_deltas_of_sums_over_counts():
    before = NS(samples={"vllm:time_to_first_token_seconds_sum": 1.0, "vllm:time_to_first_token_seconds_count": 2,
                         "vllm:inter_token_latency_seconds_sum": 0.5, "vllm:inter_token_latency_seconds_count": 10})
    after = NS(samples={"vllm:time_to_first_token_seconds_sum": 4.0, "vllm:time_to_first_token_seconds_count": 8,
                        "vllm:inter_token_latency_seconds_sum": 2.5, "vllm:inter_token_latency_seconds_count": 50})
    assert cv.metric_means(before, after) == {"ttft_mean_s": pytest.approx(0.5), "itl_mean_s": pytest.approx(0.05)}


def test_fit_to_metrics_recovers_a_known_mapping():
    cm = CostModel("smollm2-135m", "cpu", step_overhead_s=2e-3)
    trace = ce.make_trace(ce.Workload("t", 6, 20.0, (16, 64), (4, 8), 5))
    truth = cv.scaled(cm, 0.04, 2.0)
    ttft, tbt = ce.simulate(trace, truth, CACHE, SCHED)
    target = {"ttft_mean_s": float(ttft["ttft_s"].mean()), "itl_mean_s": float(tbt.mean())}
    _, a, b = cv.fit_to_metrics(cm, trace, target, CACHE, SCHED)
    assert a == pytest.approx(0.04, abs=0.006) and b == pytest.approx(2.0, rel=0.15)


class _FakeSSE(BaseHTTPRequestHandler):
    """Streams max_tokens chunks 20 ms apart, one token id each (vLLM's completions stream shape)."""

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(body["max_tokens"]):
            time.sleep(0.02)
            chunk = {"choices": [{"text": "x", "token_ids": [i]}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *a):
        pass


def test_serve_trace_streams_each_request_at_its_arrival():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _FakeSSE)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        trace = pd.DataFrame({"arrival_time": [0.0, 0.1, 0.15], "prompt_tokens": [5, 6, 7], "output_tokens": [3, 4, 2]})
        ttft, tbt = cv.serve_trace(url, "m", trace, vocab=100)
        assert len(ttft) == 3 and len(tbt) == 2 + 3 + 1
        assert (ttft["ttft_s"] >= 0.02).all() and (tbt >= 0.015).all()
        assert len(cv.stream_times(url, "m", [1, 2], 5)) == 5
    finally:
        srv.shutdown()
        srv.server_close()
