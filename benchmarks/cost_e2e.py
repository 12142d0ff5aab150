"""End to end on our engine: calibrate the cost model on one workload, predict another's TTFT/TBT.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cost_e2e.py [--rounds 3] [--clock cpu|wall] [--csv out.csv]

Each round serves the calibration workload and then the held-out one on a fresh engine over the
same loaded SmolLM2-135M (``paged.studies.cost_e2e``: trace-time serving, random-token prompts,
no prefix caching, 256 blocks of 16, max_num_seqs 16, max_num_batched_tokens 512), fits
``CostModel("smollm2-135m", "cpu")`` to the calibration run's steps and simulates both traces with
it. Printed: per round and metric the measured and predicted value and the error
(predicted / measured - 1), then the median error over rounds. Steps are timed in CPU seconds of
the engine's thread by default (``--clock wall``: wall time, which other processes on a shared
machine lengthen). About 5 min per round on this loaded 2-core VM (CPU time about 1 min).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if sys.path and sys.path[0] == str(ROOT / "benchmarks"):  # run as a script: benchmarks/kernels.py
    sys.path[0] = str(ROOT)  # would shadow the kernels package

import pandas as pd  # noqa: E402

import paged  # noqa: E402
from paged.core.config import CacheConfig, SchedulerConfig  # noqa: E402
from paged.studies.cost_e2e import e2e_table  # noqa: E402


def main(argv: list[str] | None = None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--csv")
    a = ap.parse_args(argv)
    llm = paged.LLM(cache=CacheConfig(block_size=16, num_blocks=256, enable_prefix_caching=False),
                    scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512))
    tables = []
    for r in range(a.rounds):
        t, rep = e2e_table(llm=llm, clock=a.clock)
        t.insert(0, "round", r)
        t["fit_holdout_mape"] = rep.holdout_mape
        tables.append(t)
        print(t.to_string(index=False, float_format=lambda v: f"{v:.4f}"), flush=True)
    all_ = pd.concat(tables, ignore_index=True)
    med = all_.groupby(["workload", "metric"], sort=False).agg(
        measured=("measured", "median"), predicted=("predicted", "median"), error_median=("error", "median"),
        error_min=("error", "min"), error_max=("error", "max")).reset_index()
    print(f"\nmedian over {a.rounds} rounds (clock: {a.clock})")
    print(med.to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    if a.csv:
        all_.to_csv(a.csv, index=False)
    return med


if __name__ == "__main__":
    main()
