"""The reuse a trace's block ids say, computed from the ids alone (no package code), for the tests
that hold the simulator and the cache-only replay to it."""
from __future__ import annotations

import pandas as pd


def expected_hits(trace: pd.DataFrame, kv_block: int, max_len: int) -> tuple[int, int]:
    """Hit and query tokens of an unlimited prefix cache, from the ids alone: a KV block is named
    by the (id, first offset, last offset) pieces of content it covers, chained to the blocks
    before it; a request hits its leading KV blocks that an earlier admitted request held in
    full, at most (prompt - 1) // kv_block of them; rows longer than max_len are never admitted."""
    cbs = int(trace.attrs["content_block_size"])
    stored: set[int] = set()
    hits = queries = 0
    for ids, n, out in zip(trace["block_hashes"], trace["prompt_tokens"], trace["output_tokens"]):
        n, ids = int(n), [int(x) for x in ids]
        if n + int(out) > max_len:
            continue
        keys, key = [], 0
        for j in range(n // kv_block):
            s, e = j * kv_block, (j + 1) * kv_block
            pieces = tuple((ids[t], max(s, t * cbs) - t * cbs, min(e, (t + 1) * cbs) - t * cbs)
                           for t in range(s // cbs, (e - 1) // cbs + 1))
            key = hash((key, pieces))
            keys.append(key)
        k = 0
        while k < min(len(keys), (n - 1) // kv_block) and keys[k] in stored:
            k += 1
        hits += k * kv_block
        queries += n
        stored.update(keys)
    return hits, queries
