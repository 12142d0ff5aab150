"""Simulator benchmarks: speed (simulated requests per wall second) and the must-show studies.

    python benchmarks/simulator.py                 # speed: 10,000 ShareGPT-like requests, Llama-2-13B, A100-80GB
    python benchmarks/simulator.py --studies       # + memory story, interference, block-size ablation tables
    python benchmarks/simulator.py -n 2000 --profile   # cProfile of the simulation loop (top functions)

Every number is measured here, in this process; nothing is copied from elsewhere.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import pandas as pd  # noqa: E402

from paged.simulator import SimConfig, Simulator, block_size_ablation, interference_study, memory_story  # noqa: E402
from paged.workload import synthetic_trace  # noqa: E402


def speed(n: int, profile: bool, model: str, gpu: str, rate: float) -> dict:
    trace = synthetic_trace("sharegpt", n, seed=0, rate=rate)
    sim = Simulator(SimConfig(model=model, gpu=gpu))
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    res = sim.run(trace)
    if prof:
        prof.disable()
    wall = time.perf_counter() - t0
    s = res.summary
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    request_steps = int(res.steps["num_seqs"].sum())
    return {"requests": n, "model": model, "gpu": gpu, "rate": rate, "wall_s": wall, "sim_req_per_wall_s": n / wall,
            "steps": s["num_steps"], "request_steps": request_steps, "us_per_request_step": wall / request_steps * 1e6,
            "simulated_s": s["duration_s"], "sim_speedup_vs_real_time": s["duration_s"] / wall,
            "preemptions": s["num_preemptions"], "blocks_in_use_at_end": s["num_blocks_in_use_at_end"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-n", type=int, default=10_000)
    p.add_argument("--model", default="llama-2-13b")
    p.add_argument("--gpu", default="a100-80gb")
    p.add_argument("--rate", type=float, default=float("inf"))
    p.add_argument("--profile", action="store_true")
    p.add_argument("--studies", action="store_true")
    p.add_argument("-j", "--jobs", type=int, default=2)
    a = p.parse_args()
    pd.set_option("display.width", 250)
    pd.set_option("display.max_columns", 30)
    row = speed(a.n, a.profile, a.model, a.gpu, a.rate)
    print("## speed\n" + pd.DataFrame([row]).to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    if a.studies:
        for title, df in (("memory story", memory_story(2000, jobs=a.jobs)),
                          ("interference", interference_study(600, jobs=a.jobs)),
                          ("block-size ablation", block_size_ablation(num_requests=1000, jobs=a.jobs))):
            print(f"\n## {title}\n" + df.to_string(index=False, float_format=lambda x: f"{x:.3f}"))


if __name__ == "__main__":
    main()
