"""Fleet benchmarks: routing policies side by side, the hot-prefix overload, and the fleet's speed.

    python benchmarks/fleet.py                # all three tables
    python benchmarks/fleet.py --quick        # tiny sizes (the smoke test)
    python benchmarks/fleet.py --only scale   # routing | hot | scale | mooncake
    python benchmarks/fleet.py --only mooncake --mooncake 12031 --replicas 16   # the whole trace

1. routing: 8 replicas of Llama-2-13B (1x A100-80GB each, pools shrunk to 1,500 blocks so caches
   compete), a shared-prefix workload; hit rate and p99 TTFT per policy, ratios to round robin.
2. hot: 70% of requests share one prefix; KV-aware routing as pure affinity (overlap weight 1000)
   against Dynamo's default weight 1 (decode load counts), SGLang-style cache_aware, round robin.
3. scale: Llama-2-70B on 4x A100-80GB per replica; wall time and peak memory (each point in a fresh
   process) over replicas x requests. The work is the replicas' steps (more replicas at the same
   load: smaller batches, more steps); ``us_per_step_vs_first`` near 1 means linear in steps.
4. mooncake: the first N requests of Mooncake's conversation trace (FAST'25; data/traces/mooncake),
   replicas of Llama-3.1-70B on 4x A100-80GB: hit rate and p99 TTFT per policy.
Every number is measured here, in this run.
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

from paged.fleet.study import compare_policies, hot_prefix_study  # noqa: E402
from paged.fleet.sim import SimFleet  # noqa: E402
from paged.fleet.workloads import shared_prefix_trace  # noqa: E402
from paged.sim.config import SimConfig  # noqa: E402

COLS = ["policy", "hit_rate", "hit_rate_vs_rr", "ttft_p50_s", "ttft_p99_s", "ttft_p99_vs_rr", "max_replica_share",
        "prefill_tokens", "wall_s"]


def routing(quick: bool) -> pd.DataFrame:
    n = 120 if quick else 1200
    return compare_policies(num_replicas=8, num_blocks=1500, num_requests=n, rate=40.0, num_prefixes=32,
                            prompt_tokens=1200, prefix_tokens=1024, output_tokens=64)[COLS]


def hot(quick: bool) -> pd.DataFrame:
    df = hot_prefix_study(num_requests=120 if quick else 800, num_blocks=1500)
    df["policy"] = [f"kv_aware w={w:g}" if p == "kv_aware" else p
                    for p, w in zip(df["policy"], df.get("router_overlap_weight", [None] * len(df)))]
    rr = df[df["policy"] == "round_robin"].iloc[0]
    df["hit_rate_vs_rr"] = df["hit_rate"] / rr["hit_rate"]
    df["ttft_p99_vs_rr"] = df["ttft_p99_s"] / rr["ttft_p99_s"]
    return df[COLS]


def _point(args: tuple[int, int], out: "mp.Queue") -> None:
    replicas, n = args
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cfg = SimConfig(model="llama-2-70b", gpu="a100-80gb", tensor_parallel=4, block_size=16)
    trace = shared_prefix_trace(n, rate=2.0 * replicas, num_prefixes=4 * replicas, prompt_tokens=1500,
                                prefix_tokens=1024, output_tokens=200, seed=0)
    fleet = SimFleet(cfg, "kv_aware", num_replicas=replicas)
    t0 = time.perf_counter()
    res = fleet.run(trace)
    wall = time.perf_counter() - t0
    steps = int(res.steps["num_seqs"].sum())
    out.put({"replicas": replicas, "requests": n, "wall_s": wall, "req_per_wall_s": n / wall,
             "steps": len(res.steps), "us_per_step": wall / len(res.steps) * 1e6,
             "request_steps": steps, "us_per_request_step": wall / steps * 1e6,
             "peak_rss_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024,
             "hit_rate": res.summary["hit_rate"], "ttft_p99_s": res.summary["ttft_p99_s"]})


def scale(quick: bool) -> pd.DataFrame:
    n = 60 if quick else 1500
    points = [(4, n), (8, n), (16, n), (16, 2 * n)]
    ctx = mp.get_context("fork")
    rows = []
    for p in points:
        q = ctx.Queue()
        proc = ctx.Process(target=_point, args=(p, q))
        proc.start()
        rows.append(q.get(timeout=1800))
        proc.join(60)
    df = pd.DataFrame(rows)
    ref = df.iloc[0]
    df["us_per_step_vs_first"] = df["us_per_step"] / ref["us_per_step"]
    df["wall_vs_first"] = df["wall_s"] / ref["wall_s"]
    return df


def mooncake(num_requests: int, num_replicas: int) -> pd.DataFrame:
    """Routing on the first ``num_requests`` of Mooncake's conversation trace (its own 512-token
    content blocks), replicas of Llama-3.1-70B on 4x A100-80GB."""
    from paged.studies.mooncake import mooncake_trace
    trace = mooncake_trace("conversation", num_requests)
    cfg = SimConfig(model="llama-3.1-70b", gpu="a100-80gb", tensor_parallel=4, block_size=16)
    rows = []
    for policy in ("round_robin", "least_outstanding", "kv_aware", "cache_aware"):
        rows.append(SimFleet(cfg, policy, num_replicas=num_replicas).run(trace).summary)
    df = pd.DataFrame(rows)
    rr = df[df["policy"] == "round_robin"].iloc[0]
    df["hit_rate_vs_rr"] = df["hit_rate"] / rr["hit_rate"]
    df["ttft_p99_vs_rr"] = df["ttft_p99_s"] / rr["ttft_p99_s"]
    return df[COLS]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    ap.add_argument("--only", choices=("routing", "hot", "scale", "mooncake"), default=None)
    ap.add_argument("--mooncake", type=int, default=1000, metavar="N",
                    help="requests of Mooncake's conversation trace for the mooncake table (0: skip)")
    ap.add_argument("--replicas", type=int, default=8, help="replicas for the mooncake table")
    a = ap.parse_args(argv)
    pd.set_option("display.width", 200)
    pd.set_option("display.max_columns", 20)
    tables = {"routing": routing, "hot": hot, "scale": scale}
    if a.mooncake and not a.quick:
        tables["mooncake"] = lambda quick: mooncake(a.mooncake, a.replicas)
    for name, fn in tables.items():
        if a.only in (None, name):
            t0 = time.perf_counter()
            df = fn(a.quick)
            print(f"\n== {name} ({time.perf_counter() - t0:.1f} s)")
            print(df.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
