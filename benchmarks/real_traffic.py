"""The simulator on real traffic: the full Mooncake conversation trace (12,031 requests).

    python benchmarks/real_traffic.py              # 1/4, 1/2 and all of the trace: CPU time, peak memory
    python benchmarks/real_traffic.py --unlimited  # + an unlimited cache at 512-token blocks: hits vs the ids
    python benchmarks/real_traffic.py --quick      # 1/32, 1/16, 1/8 (a smoke run)

Deployment: Llama-3.1-70B on 8 x A100-80GB (tensor parallel 8), 16-token blocks, the trace's own
timestamps (the must-show command of issue 27). Each size runs in a fresh process so its peak
resident memory (``ru_maxrss``) is its own; time is that process's CPU time (other processes on a
shared machine do not count) beside its wall time. "Linear" is read off the last columns: CPU
seconds per request and per 1k trace tokens, each relative to the full trace (1.00 = linear).
Every number is measured here, in this run.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

TRACE = os.path.join(ROOT, "data", "traces", "mooncake", "conversation_trace.jsonl.gz")
DEPLOY = dict(model="llama-3.1-70b", gpu="a100-80gb", tensor_parallel=8)


def one(n: int, unlimited: bool) -> dict:
    """Simulate the first ``n`` requests (in this process) and measure it."""
    import numpy as np

    from paged.sim.simulator import SimConfig, Simulator
    from paged.sim.workload import load_trace

    tr = load_trace(TRACE).iloc[:n]
    extra = {}
    if unlimited:  # a pool that never evicts: every block any request ever takes
        need = int(np.ceil((tr["prompt_tokens"] + tr["output_tokens"]) / 512).sum())
        extra = dict(block_size=512, num_blocks=need)
    sim = Simulator(SimConfig(**DEPLOY, **extra))
    c0, w0 = time.process_time(), time.perf_counter()
    s = sim.run(tr).summary
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    return {"requests": n, "tokens": int((tr["prompt_tokens"] + tr["output_tokens"]).sum()), "cpu_s": cpu,
            "wall_s": wall, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "steps": s["num_steps"], "finished": s["requests_finished"], "hit_rate": s["prefix_cache_hit_rate"],
            "hit_tokens": s["prefix_cache_hit_tokens"], "query_tokens": s["prefix_cache_query_tokens"],
            "ttft_p50_s": s["ttft_p50_s"], "blocks_in_use_at_end": s["num_blocks_in_use_at_end"]}


def measure(n: int, unlimited: bool = False) -> dict:
    """``one(n)`` in a fresh interpreter (its own peak memory)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--one", str(n)] + (["--unlimited-one"] if unlimited else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    full = rows[-1]
    per_req, per_tok = full["cpu_s"] / full["requests"], full["cpu_s"] / full["tokens"] * 1e3
    lines = ["requests  trace tokens  steps    CPU s   wall s  peak MiB  hit rate  hit tokens    "
             "CPU/request  CPU/1k tokens (x full)"]
    for r in rows:
        a, b = r["cpu_s"] / r["requests"], r["cpu_s"] / r["tokens"] * 1e3
        lines.append(f"{r['requests']:>8,}  {r['tokens']:>12,}  {r['steps']:>6,}  {r['cpu_s']:>7.1f}  {r['wall_s']:>7.1f}  "
                     f"{r['peak_rss_mib']:>8,.0f}  {r['hit_rate']:>8.4f}  {r['hit_tokens']:>10,}  "
                     f"{a * 1e3:>7.2f} ms ({a / per_req:.2f})  {b * 1e3:>6.2f} ms ({b / per_tok:.2f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1/32, 1/16 and 1/8 of the trace")
    ap.add_argument("--unlimited", action="store_true", help="also the full trace with a cache that never evicts")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--unlimited-one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one, args.unlimited_one)))
        return 0
    from paged.sim.workload import load_trace

    total = len(load_trace(TRACE))
    parts = (32, 16, 8) if args.quick else (4, 2, 1)
    rows = [measure(-(-total // k)) for k in parts]
    print(f"Mooncake conversation trace, {DEPLOY['model']} on {DEPLOY['tensor_parallel']} x {DEPLOY['gpu']}, "
          f"16-token blocks, the trace's timestamps")
    print(table(rows))
    if args.unlimited:
        from paged.studies.mooncake import trace_reuse

        u = measure(rows[-1]["requests"], unlimited=True)
        tr = load_trace(TRACE).iloc[: u["requests"]]
        own = trace_reuse(tr)
        print(f"\nunlimited cache, 512-token blocks, {u['requests']:,} requests: hit rate {u['hit_rate']:.6f} "
              f"({u['hit_tokens']:,} of {u['query_tokens']:,} tokens), CPU {u['cpu_s']:.1f} s, peak "
              f"{u['peak_rss_mib']:,.0f} MiB; the trace's own leading repeated blocks: {own['trace_block_reuse']:.6f} "
              f"of blocks, {own['trace_token_reuse']:.6f} of tokens (a hit leaves a prompt's last token to compute)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
