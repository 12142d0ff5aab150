"""Ablation 3: the block-size x eviction grid as a stored sweep, interrupted and resumed.

    python docs/ablations/sweep_resume.py [--backend local|ray] [--store DIR]

The first call stops after two points (an exception from ``on_result``, as Ctrl-C would); the
second call with the same grid and store runs only the points not stored, and its table equals
one uninterrupted run's. Prints the counts and the largest difference (0 when resuming is exact).
"""
from __future__ import annotations

import argparse
import tempfile

import paged

GRID = {"model": "llama-3-8b", "gpu": "a100-80gb", "num_blocks": 600, "num_requests": 200, "rate": 20.0,
        "num_prefixes": 16, "prefix_tokens": 512, "prefix_zipf": 1.0,
        "block_size": [8, 16, 32], "eviction": ["lru", "lfu"]}


class Stop(Exception):
    pass


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("local", "ray"), default="local")
    ap.add_argument("--store", default=None, help="point store folder (default: a temporary one)")
    a = ap.parse_args(argv)
    store = a.store or tempfile.mkdtemp(prefix="ablation-sweep-")
    seen = []

    def stop_after_two(rows):
        seen.append(rows)
        if len(seen) == 2:
            raise Stop

    try:
        paged.sweep("simulate", GRID, store=store, backend=a.backend, progress=False, on_result=stop_after_two)
    except Stop:
        pass
    resumed = paged.sweep("simulate", GRID, store=store, backend=a.backend, progress=False)
    fresh = paged.sweep("simulate", GRID, store=False, backend=a.backend, progress=False)
    info = resumed.attrs["sweep"]
    metrics = ["prefix_cache_hit_rate", "throughput_tok_s", "tbt_p99_s"]
    diff = (resumed[metrics] - fresh[metrics]).abs().to_numpy().max()
    print(f"points {info['points']}  stored before resuming {info['cached']}  computed on resume {info['computed']}")
    print(resumed[["block_size", "eviction", *metrics]].to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    print(f"largest difference, resumed vs uninterrupted: {diff:.3g}")


if __name__ == "__main__":
    main()
