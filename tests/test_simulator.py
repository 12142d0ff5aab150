"""The discrete-event simulator drives the real Scheduler and KV-cache manager."""
import numpy as np
import pandas as pd
import pytest

from paged.sim.simulator import SimConfig, Simulator, simulate
from paged.sim.workload import synthetic_trace

KEYS = {"requests_finished", "throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "tbt_p50_s", "tbt_p99_s",
        "kv_token_usage_mean", "kv_block_usage_mean", "num_preemptions", "prefix_cache_hit_rate",
        "num_blocks_in_use_at_end"}
SMALL = dict(model="llama-2-7b", gpu="a100-40gb", max_model_len=1024)


def _trace(n=80, seed=0, **kw):
    return synthetic_trace("sharegpt", n, trace_seed=seed, max_model_len=1024, **kw)


def test_run_finishes_everything_and_frees_every_block():
    res = simulate(_trace(), SimConfig(**SMALL, num_blocks=200))
    s = res.summary
    assert KEYS <= set(s)
    assert s["requests_finished"] == 80 and s["num_blocks_in_use_at_end"] == 0
    assert s["num_preemptions"] > 0  # 200 blocks of 16 are tight for 80 requests
    r = res.requests
    assert (r["ttft_s"] > 0).all() and (r["e2e_s"] >= r["ttft_s"]).all() and (r["queueing_s"] >= 0).all()
    assert 0 < s["kv_token_usage_mean"] <= 1 and 0 < s["kv_block_usage_mean"] <= 1
    st = res.steps
    assert (st["num_prefill_tokens"] + st["num_decode_tokens"]).sum() >= r["prompt_tokens"].sum() + r["output_tokens"].sum() - 80
    assert s["duration_s"] == pytest.approx(r["finish_s"].max())


def test_deterministic():
    a = simulate(_trace(40), SimConfig(**SMALL, num_blocks=150)).summary
    b = simulate(_trace(40), SimConfig(**SMALL, num_blocks=150)).summary
    for k in ("wall_s", "sim_requests_per_wall_s"):
        a.pop(k), b.pop(k)
    assert a == b


def test_prefix_sharing_hits_only_when_trace_shares():
    shared = _trace(60, num_prefixes=2, prefix_tokens=128)
    s = simulate(shared, SimConfig(**SMALL)).summary
    assert s["prefix_cache_hit_rate"] > 0.2
    assert simulate(_trace(60), SimConfig(**SMALL)).summary["prefix_cache_hit_rate"] == 0.0
    off = simulate(shared, SimConfig(**SMALL, enable_prefix_caching=False)).summary
    assert off["prefix_cache_hit_rate"] == 0.0 and off["requests_finished"] == 60


def test_swap_preemption():
    s = simulate(_trace(60), SimConfig(**SMALL, num_blocks=150, preemption_mode="swap")).summary
    assert s["requests_finished"] == 60 and s["num_preemptions_swap"] > 0 and s["num_swapped_blocks"] > 0
    assert s["num_blocks_in_use_at_end"] == 0


def test_contiguous_baselines_waste_memory_in_order():
    tr = _trace(120, seed=1)
    use = {}
    for alloc in ("contiguous-max", "contiguous-pow2", "contiguous-oracle", "paged"):
        s = simulate(tr, SimConfig(**SMALL, num_blocks=300, allocator=alloc)).summary
        assert s["requests_finished"] == 120 and s["num_blocks_in_use_at_end"] == 0
        use[alloc] = (s["kv_token_usage_mean"], s["throughput_req_s"])
    assert use["contiguous-max"][0] < use["contiguous-pow2"][0] < use["contiguous-oracle"][0] < use["paged"][0]
    assert use["contiguous-max"][1] < use["contiguous-oracle"][1] < use["paged"][1]
    assert use["paged"][0] > 0.9


def test_chunked_prefill_cuts_decode_stalls():
    # long prompts (Azure conversation) arriving into a decode batch: Sarathi-Serve's interference
    tr = synthetic_trace("azure-conv", 150, rate=4.0, trace_seed=2, max_model_len=4096)
    base = dict(model="mistral-7b", gpu="a100-80gb", max_model_len=4096)
    none = simulate(tr, SimConfig(**base, enable_chunked_prefill=False, max_num_batched_tokens=4096)).summary
    chunked = simulate(tr, SimConfig(**base, max_num_batched_tokens=256)).summary
    assert chunked["tbt_p99_s"] < none["tbt_p99_s"] / 3
    assert chunked["requests_finished"] == none["requests_finished"] == 150


def test_rejected_and_arrival_gaps():
    tr = pd.DataFrame({"arrival_time": [0.0, 5.0, 50.0], "prompt_tokens": [10, 2000, 20],
                       "output_tokens": [5, 5, 5]})
    res = simulate(tr, SimConfig(**SMALL))
    s = res.summary
    assert s["requests_finished"] == 2 and s["requests_rejected"] == 1 and "max_model_len" in s["first_rejection"]
    assert res.requests.loc[2, "first_scheduled_s"] == 50.0  # the clock jumps over idle time
    assert bool(res.requests.loc[1, "rejected"]) and np.isnan(res.requests.loc[1, "ttft_s"])


def test_simulator_runs_once_and_progress_callback():
    sim = Simulator(SimConfig(**SMALL))
    seen = []
    sim.run(_trace(10), progress=seen.append)
    assert seen[-1] == 10
    with pytest.raises(Exception, match="runs once"):
        sim.run(_trace(10))


def test_priority_column_reaches_the_scheduler():
    tr = pd.DataFrame({"arrival_time": [0.0] * 6, "prompt_tokens": [200] * 6, "output_tokens": [50] * 6,
                       "priority": [5, 5, 5, 0, 0, 0]})
    res = simulate(tr, SimConfig(**SMALL, policy="priority", max_num_seqs=3))
    r = res.requests
    assert r.loc[r["priority"] == 0, "finish_s"].max() < r.loc[r["priority"] == 5, "finish_s"].min()


def test_calibrated_cost_model_from_a_steps_file(tmp_path):
    from dataclasses import replace

    from paged.sim.cost_model import CostModel, StepShape

    truth = replace(CostModel("llama-2-7b", "a100-40gb"), mfu=0.3, mbu=0.5, step_overhead_s=5e-3)
    rng = np.random.default_rng(0)
    rows = []
    for step in range(60):
        nd = int(rng.integers(1, 40))
        q, c = [1] * nd + [int(rng.integers(16, 400))], list(rng.integers(10, 900, nd)) + [0]
        sec = truth.step_time(StepShape.make(q, c))
        rows += [(step, ci, qi, True, sec) for qi, ci in zip(q, c)]
    path = tmp_path / "steps.csv"
    pd.DataFrame(rows, columns=["step", "start", "num_tokens", "samples", "seconds"]).to_csv(path, index=False)
    s = simulate(_trace(30), SimConfig(**SMALL, calibration=str(path), paged_kernel_penalty=False)).summary
    assert s["calibration_holdout_mape"] < 0.02 and s["requests_finished"] == 30
