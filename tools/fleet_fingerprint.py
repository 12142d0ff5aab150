"""Fingerprint the fleet simulator, bit for bit: SHA-1 of the request, step, routing and candidate
frames (and the summary without its wall time) of fixed fleet runs. Record before a speed change,
compare after (exit status 1 naming every run and frame that differs):

    PYTHONPATH=/tmp/base .venv/bin/python tools/fleet_fingerprint.py write /tmp/fleet_fp.json
    PYTHONPATH=$PWD .venv/bin/python tools/fleet_fingerprint.py compare /tmp/fleet_fp.json

Runs (``RUNS``): the first 300 requests of Mooncake's conversation trace on 8 replicas of the
benchmark's 70B deployment under three policies; the same on a pool small enough to preempt and
evict (its prompts capped to fit), with swap preemption and with a replica going down mid-run.
A frame is hashed as its CSV (floats written in full precision by ``repr``): any change in a
value, a column or the row order changes the hash.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from typing import Any

MODEL = dict(model="llama-3.1-70b", gpu="a100-80gb", tensor_parallel=8, block_size=16)
TIGHT = dict(model="llama-2-7b", gpu="a100-80gb", block_size=16, num_blocks=1100, max_num_seqs=64)
# name -> (SimConfig keywords, policy, replicas, requests, prompt cap, down_at)
RUNS: dict[str, tuple[dict[str, Any], str, int, int, int | None, dict[int, float] | None]] = {
    "70b/kv_aware": (MODEL, "kv_aware", 8, 300, None, None),
    "70b/round_robin": (MODEL, "round_robin", 8, 300, None, None),
    "70b/least_outstanding": (MODEL, "least_outstanding", 8, 300, None, None),
    "tight/kv_aware": (TIGHT, "kv_aware", 2, 300, 16000, None),
    "tight/swap/least_kv_usage": ({**TIGHT, "preemption_mode": "swap", "num_cpu_blocks": 2000}, "least_kv_usage",
                                  2, 300, 16000, None),
    "tight/down/cache_aware": (TIGHT, "cache_aware", 3, 300, 16000, {1: 3.0}),
}
FRAMES = ("requests", "steps", "routing", "candidates")


def _sha1(df: Any) -> str:
    return hashlib.sha1(df.to_csv(index=False).encode()).hexdigest()


def run_one(name: str) -> dict[str, str]:
    """SHA-1 per frame (and of the summary, ``wall_s`` dropped) of run ``name``."""
    from paged.fleet.sim import SimFleet
    from paged.sim.config import SimConfig
    from paged.sim.trace_files import mooncake_trace

    cfg, policy, replicas, n, cap, down = RUNS[name]
    trace = mooncake_trace("conversation", n)
    if cap is not None:
        trace = trace[trace["prompt_tokens"] <= cap].reset_index(drop=True)
        trace["arrival_time"] *= 0.1     # ten times the rate: the small pools fill, preempt and evict
    fleet = SimFleet(SimConfig(**cfg), policy, num_replicas=replicas)
    res = fleet.run(trace, down_at=down)
    frames = dict(requests=res.requests, steps=res.steps, routing=res.routing,
                  candidates=fleet.dispatcher.candidates_frame())
    out = {k: _sha1(frames[k]) for k in FRAMES}
    summary = {k: v for k, v in res.summary.items() if k != "wall_s"}
    out["summary"] = hashlib.sha1(repr(sorted(summary.items())).encode()).hexdigest()
    out["num_steps"] = str(len(res.steps))
    return out


def record() -> dict[str, dict[str, str]]:
    fp = {}
    for name in RUNS:
        t0 = time.perf_counter()
        fp[name] = run_one(name)
        print(f"{name:<28} {fp[name]['num_steps']:>7} steps {time.perf_counter() - t0:6.2f} s", file=sys.stderr)
    return fp


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=("write", "compare"))
    p.add_argument("path")
    a = p.parse_args(argv)
    import paged
    print(f"paged from {os.path.dirname(os.path.dirname(os.path.abspath(paged.__file__)))}", file=sys.stderr)
    t0 = time.perf_counter()
    fp = record()
    if a.action == "write":
        with open(a.path, "w") as f:
            json.dump(fp, f, indent=1)
        print(f"wrote {a.path} ({time.perf_counter() - t0:.1f} s)")
        return 0
    with open(a.path) as f:
        base = json.load(f)
    diffs = [f"{run}.{k}: {base[run][k]} != {fp.get(run, {}).get(k)}" for run in base for k in base[run]
             if fp.get(run, {}).get(k) != base[run][k]]
    for d in diffs:
        print(d)
    print(f"fleet: {'BIT-IDENTICAL' if not diffs else f'{len(diffs)} DIFFERENCES'} ({time.perf_counter() - t0:.1f} s)")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
