"""NUMA placement and prefill/decode disaggregation: the tables of docs/claims.md's two fleet rows.

    OMP_NUM_THREADS=1 python benchmarks/fleet_parts.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import pandas as pd  # noqa: E402

from paged.fleet.disagg_pools import disagg_study  # noqa: E402
from paged.fleet.numa import numa_study  # noqa: E402


def main() -> None:
    pd.set_option("display.width", 250)
    for kw in ({}, {"layout": (8, 0)}, {"prefix_blocks": 0}, {"num_prefixes": 1000}):
        cols = ["policy", "layout", "remote_accesses", "remote_share", "reduction_vs_interleave",
                "transfer_vs_interleave", "migrated_blocks", "max_gpu_share"]
        print(f"NUMA {kw or 'default (4+4 GPUs, 16 prefixes)'}")
        print(numa_study(**kw)[cols].round(3).to_string(index=False), "\n")
    cols = ["mode", "slo_attain", "ttft_attain", "tpot_attain", "goodput_rps", "goodput_vs_colocated",
            "ttft_p99_s", "tpot_p50_s"]
    for kw in ({}, {"prompt_tokens": 256}, {"bandwidth": 3.125e9, "layerwise": False}):
        print(f"prefill/decode apart {kw or 'default (2,048-token prompts, 50 GB/s, layer-wise)'}")
        print(disagg_study(rate=6.0, num_requests=150, **kw)[cols].round(3).to_string(index=False), "\n")


if __name__ == "__main__":
    main()
