"""Ablation 1: block size x prefix-cache eviction policy on the simulator (public API only).

    python docs/ablations/block_size_eviction.py [--requests 400]

One simulated deployment per point (llama-3-8b on one A100-80GB, 16 tenants sharing system
prompts with Zipf popularity, a small pool so prefixes are evicted); prints the prefix hit rate,
throughput and p99 TBT per point, and each point's throughput as a ratio of block size 16 / LRU.
"""
from __future__ import annotations

import argparse

import paged


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=400)
    a = ap.parse_args(argv)
    grid = {"model": "llama-3-8b", "gpu": "a100-80gb", "num_blocks": 600, "num_requests": a.requests, "rate": 20.0,
            "num_prefixes": 16, "prefix_tokens": 512, "prefix_zipf": 1.0,
            "block_size": [8, 16, 32], "eviction": ["lru", "lfu"]}
    df = paged.sweep("simulate", grid, store=False, progress=False, on_error="raise")
    base = df[(df["block_size"] == 16) & (df["eviction"] == "lru")]["throughput_tok_s"].iloc[0]
    df["throughput_vs_16_lru"] = df["throughput_tok_s"] / base
    cols = ["block_size", "eviction", "prefix_cache_hit_rate", "throughput_tok_s", "tbt_p99_s", "throughput_vs_16_lru"]
    print(df[cols].to_string(index=False, float_format=lambda x: f"{x:.4g}"))


if __name__ == "__main__":
    main()
