"""Cache-only replay: a trace's prompts through the project's own prefix cache, without a model.

What Mooncake's Fig. 9 measures ("only the sequence of requests", no prefill time, no hotspot
replication): requests in arrival order, each looks up its verified cached prefix, takes blocks for
the rest of its prompt and frees them at once, so its full prompt blocks stay behind as cached-free
blocks that later requests hit or that LRU eviction reclaims. It runs on the same
``KVCacheManager`` / ``BlockPool`` / prefix index as the engine and the simulator (nothing is
re-implemented), with a pool of ``capacity_tokens // block_size`` blocks: capacities far beyond
one GPU's HBM (a node's DRAM, a fleet's pooled DRAM) are just larger pools, created lazily.

Prompt tokens come from the trace as the simulator makes them (``paged.sim.arrivals``): content
blocks for traces with ``block_hashes``, shared prefixes otherwise. A request longer than the
pool is skipped (counted in ``requests_skipped``), as a deployment would reject it.

Invariant: with a pool that never evicts, hit tokens equal what the trace's ids say (the leading
KV blocks held by an earlier request, at most ``(prompt - 1) // block_size`` of them), exactly as
in the simulator with an unlimited cache.
"""
from __future__ import annotations

from typing import Any, Sequence

import pandas as pd

from paged.core.kv_manager import KVCacheManager
from paged.core.request import Request
from paged.errors import ConfigError
from paged.sim.arrivals import Arrivals, SyntheticPrompts
from paged.sim.workload import normalize_trace

__all__ = ["replay_prefix_cache", "capacity_sweep", "unlimited_capacity"]


def unlimited_capacity(trace: pd.DataFrame, block_size: int) -> int:
    """Tokens of a pool that never evicts on ``trace``: every prompt's blocks, summed."""
    p = trace["prompt_tokens"].to_numpy()
    return int(sum(-(-int(n) // block_size) for n in p)) * block_size


def replay_prefix_cache(trace: pd.DataFrame, capacity_tokens: int | None = None, *, block_size: int = 512,
                        eviction: str = "lru", vocab_size: int = 128256, seed: int = 0) -> dict[str, Any]:
    """Replay ``trace``'s prompts in arrival order through a prefix cache of ``capacity_tokens``
    (None: unlimited) in blocks of ``block_size`` tokens; returns hit/query tokens and the rate."""
    tr = normalize_trace(trace)
    cap = unlimited_capacity(tr, block_size) if capacity_tokens is None else int(capacity_tokens)
    num_blocks = cap // block_size
    if num_blocks < 1:
        raise ConfigError(f"capacity_tokens={capacity_tokens} holds no block of {block_size} tokens; raise it")
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True, eviction=eviction)
    arrivals, toks = Arrivals(tr), SyntheticPrompts(vocab_size, seed)
    skipped = 0
    for i in range(arrivals.n):
        n = int(arrivals.prompt[i])
        if -(-n // block_size) > num_blocks:
            skipped += 1
            continue
        req = Request(str(i), arrivals.prompt_ids(i, toks), 1)
        cached = kv.find_cached_prefix(req)
        kv.allocate_slots(req, n - len(cached) * block_size, cached)
        kv.free(req.request_id)
    q, h = kv.prefix_cache_queries, kv.prefix_cache_hits
    return {"capacity_tokens": cap, "block_size": block_size, "eviction": eviction,
            "requests": arrivals.n, "requests_skipped": skipped, "query_tokens": int(q), "hit_tokens": int(h),
            "hit_rate": h / q if q else 0.0, "cached_blocks_at_end": int(kv.num_cached_free_blocks),
            "unlimited": capacity_tokens is None}


def capacity_sweep(trace: pd.DataFrame, capacities: Sequence[int], *, block_size: int = 512,
                   eviction: str = "lru", seed: int = 0) -> pd.DataFrame:
    """Hit rate against cache capacity: one replay per capacity, plus the unlimited cache (the
    theoretical maximum); ``fraction_of_max`` is each hit rate over the maximum's."""
    rows = [replay_prefix_cache(trace, int(c), block_size=block_size, eviction=eviction, seed=seed)
            for c in capacities]
    top = replay_prefix_cache(trace, None, block_size=block_size, eviction=eviction, seed=seed)
    df = pd.DataFrame(rows + [top])
    df["fraction_of_max"] = df["hit_rate"] / top["hit_rate"] if top["hit_rate"] else 0.0
    return df
