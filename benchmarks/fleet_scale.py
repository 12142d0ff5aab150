"""The fleet simulator's speed at scale: Mooncake's conversation trace on replicas of a 70B-class model.

    python benchmarks/fleet_scale.py                          # 1/8, 1/4, 1/2 of the trace x 4 / 8 / 16 replicas
    python benchmarks/fleet_scale.py --requests 2000          # the same fractions of the first 2,000 requests
    python benchmarks/fleet_scale.py --replicas 16 --points full   # only the whole trace on 16 replicas

Each point runs in a fresh process: Llama-3.1-70B on 8x A100-80GB per replica (block 16), KV-aware
routing with precise views (each replica's KV events), the first N requests of
``data/traces/mooncake`` (FAST'25; 12,031 in all). Printed per point: wall time, peak RSS of the
process above its start, the replicas' steps (and the share of them the decode fast-forward took,
``paged.fleet.coast``), CPU time of the process (``time.process_time``: on a shared machine wall time
also counts other processes), and the linearity check: CPU time per replica-step and per request,
each against the first point (near 1: linear in replicas and requests). Every number is measured
here, in this run.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import pandas as pd  # noqa: E402

MODEL = dict(model="llama-3.1-70b", gpu="a100-80gb", tensor_parallel=8, block_size=16)


def _point(replicas: int, n: int, policy: str, out: "mp.Queue") -> None:
    from paged.fleet.sim import SimFleet
    from paged.sim.config import SimConfig
    from paged.studies.mooncake import mooncake_trace
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    trace = mooncake_trace("conversation", n)
    fleet = SimFleet(SimConfig(**MODEL), policy, num_replicas=replicas)
    t0, c0 = time.perf_counter(), time.process_time()
    res = fleet.run(trace)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    s = res.summary
    steps = len(res.steps)
    out.put({"requests": n, "replicas": replicas, "policy": policy, "wall_s": wall, "cpu_s": cpu,
             "peak_rss_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024,
             "steps": steps, "coasted": sum(r.num_coasted for r in fleet.replicas) / steps,
             "cpu_us_per_step": cpu / steps * 1e6, "cpu_ms_per_request": cpu / n * 1e3,
             "hit_rate": s["hit_rate"], "ttft_p99_s": s["ttft_p99_s"], "finished": s["requests_finished"]})


def run(points: list[tuple[int, int]], policy: str = "kv_aware") -> pd.DataFrame:
    """One row per (replicas, requests) point, each in a fresh process, with the linearity ratios."""
    ctx = mp.get_context("fork")
    rows = []
    for replicas, n in points:
        q = ctx.Queue()
        proc = ctx.Process(target=_point, args=(replicas, n, policy, q))
        proc.start()
        rows.append(q.get(timeout=4 * 3600))
        proc.join(60)
    df = pd.DataFrame(rows)
    ref = df.iloc[0]
    df["us_per_step_vs_first"] = df["cpu_us_per_step"] / ref["cpu_us_per_step"]
    df["ms_per_request_vs_first"] = df["cpu_ms_per_request"] / ref["cpu_ms_per_request"]
    df["cpu_vs_one_minute"] = df["cpu_s"] / 60.0
    return df


def main(argv: list[str] | None = None) -> int:
    from paged.studies.mooncake import mooncake_trace
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=0, help="the first N requests (0: the whole trace)")
    ap.add_argument("--replicas", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--points", choices=("fractions", "full"), default="fractions",
                    help="1/8, 1/4 and 1/2 of the N requests, or all of them")
    ap.add_argument("--policy", default="kv_aware")
    a = ap.parse_args(argv)
    total = len(mooncake_trace("conversation"))
    n = min(a.requests or total, total)
    sizes = {"fractions": [n // 8, n // 4, n // 2], "full": [n]}[a.points]
    t0 = time.perf_counter()
    df = run([(r, k) for r in a.replicas for k in sizes], a.policy)
    pd.set_option("display.width", 220)
    pd.set_option("display.max_columns", 20)
    print(f"\n== fleet scale: Mooncake conversation ({total} requests in all), {MODEL['model']} on "
          f"{MODEL['tensor_parallel']}x {MODEL['gpu']} per replica, {a.policy} ({time.perf_counter() - t0:.1f} s)")
    print(df.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
