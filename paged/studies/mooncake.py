"""Mooncake (FAST'25) reproduced: the trace table (Table 2) and the capacity curve (Fig. 9).

Paper figures (Qin et al., "Mooncake: Trading More Storage for Less Computation", FAST'25):
Table 2 — conversation 12,031 requests, mean input 12,035 / output 343 tokens, cache ratio 40%;
tool&agent 23,608, 8,596 / 182, 59%; synthetic 3,993, 15,325 / 149, 66%. Fig. 9 — hit rate
against cache capacity "considering only the sequence of requests"; a 3M-token local cache
reaches 41% (conversation), 75% (tool&agent), 46% (synthetic), 48% (all) of the theoretical
maximum, and "a cache capacity of 50M tokens nearly reaches the theoretical maximum".

Ours: the released traces (``data/traces/mooncake``; tool&agent is not in the snapshot we can read)
through the project's prefix cache (``paged.studies.cache_replay``: LRU, blocks of 512 tokens, the
trace's own block size, so the cache sees exactly the trace's reuse). ``trace_reuse`` is the
trace's own count, from the ids alone: leading ids that an earlier request had.
"""
from __future__ import annotations

from typing import Any, Sequence

import pandas as pd

from paged.sim.trace_files import mooncake_trace
from paged.sim.workload import normalize_trace
from paged.studies.cache_replay import capacity_sweep, replay_prefix_cache

__all__ = ["PAPER_TABLE2", "PAPER_FRACTION_AT_3M", "CAPACITIES", "mooncake_trace", "reuse_depth", "trace_reuse", "table2",
           "capacity_point", "capacity_curve"]

PAPER_TABLE2 = {  # requests, mean input, mean output, cache ratio (FAST'25 Table 2)
    "conversation": (12031, 12035, 343, 0.40),
    "toolagent": (23608, 8596, 182, 0.59),
    "synthetic": (3993, 15325, 149, 0.66),
}
PAPER_FRACTION_AT_3M = {"conversation": 0.41, "toolagent": 0.75, "synthetic": 0.46}  # Fig. 9 labels
CAPACITIES = (10**6, 2 * 10**6, 3 * 10**6, 5 * 10**6, 10**7, 2 * 10**7, 5 * 10**7, 10**8)


def reuse_depth(trace: pd.DataFrame) -> pd.DataFrame:
    """Per request (arrival order): its blocks, the leading ones some earlier request had
    (``reused_blocks``), the prompt tokens they cover and that share of the prompt."""
    trace = normalize_trace(trace)
    bs = int(trace.attrs["content_block_size"])
    seen: set[int] = set()
    rows = []
    for t, ids, n in zip(trace["arrival_time"], trace["block_hashes"], trace["prompt_tokens"]):
        ids = ids.tolist()
        k = 0
        while k < len(ids) and ids[k] in seen:
            k += 1
        seen.update(ids)
        rows.append((float(t), int(n), len(ids), k, min(k * bs, int(n))))
    df = pd.DataFrame(rows, columns=["arrival_time", "prompt_tokens", "blocks", "reused_blocks", "reused_tokens"])
    df["reused_share"] = df["reused_tokens"] / df["prompt_tokens"]
    return df


def trace_reuse(trace: pd.DataFrame) -> dict[str, float]:
    """The trace's own count: per request, its leading block ids that some earlier request had;
    as a share of blocks and of prompt tokens (a leading run of k ids covers min(k x size, prompt))."""
    d = reuse_depth(trace)
    return {"trace_block_reuse": d["reused_blocks"].sum() / d["blocks"].sum(),
            "trace_token_reuse": d["reused_tokens"].sum() / d["prompt_tokens"].sum()}


def table2(traces: Sequence[str] = ("conversation", "synthetic"), num_requests: int | None = None,
           block_size: int = 512) -> pd.DataFrame:
    """Table 2 beside ours: requests, mean input/output, the trace's own reuse and the hit rate of
    an unlimited prefix cache (blocks of ``block_size``; a hit leaves the last prompt token to compute)."""
    rows = []
    for name in traces:
        tr = mooncake_trace(name, num_requests)
        paper = PAPER_TABLE2.get(name, (None,) * 4)
        unlimited = replay_prefix_cache(tr, None, block_size=block_size)
        rows.append({"trace": name, "requests": len(tr), "paper_requests": paper[0],
                     "mean_input": float(tr["prompt_tokens"].mean()), "paper_mean_input": paper[1],
                     "mean_output": float(tr["output_tokens"].mean()), "paper_mean_output": paper[2],
                     **trace_reuse(tr), "unlimited_hit_rate": unlimited["hit_rate"],
                     "paper_cache_ratio": paper[3], "block_size": block_size})
    return pd.DataFrame(rows)


def capacity_point(trace: str = "conversation", capacity_tokens: float | None = 3e6, block_size: int = 512,
                   num_requests: int | None = None, eviction: str = "lru") -> dict[str, Any]:
    """One point of Fig. 9: the hit rate of a ``capacity_tokens`` prefix cache (None: unlimited)."""
    tr = mooncake_trace(trace, num_requests)
    cap = None if capacity_tokens is None else int(capacity_tokens)
    return {"trace": trace, **replay_prefix_cache(tr, cap, block_size=block_size, eviction=eviction)}


def capacity_curve(traces: Sequence[str] = ("conversation", "synthetic"), capacities: Sequence[float] = CAPACITIES,
                   block_size: int = 512, num_requests: int | None = None) -> pd.DataFrame:
    """Fig. 9: hit rate against capacity per trace, with the unlimited cache's as the maximum;
    ``fraction_of_max`` beside the paper's fraction at 3M tokens."""
    frames = []
    for name in traces:
        df = capacity_sweep(mooncake_trace(name, num_requests), capacities, block_size=block_size)
        df.insert(0, "trace", name)
        df.insert(len(df.columns) - 1, "max_hit_rate", df["hit_rate"].iloc[-1])  # the unlimited cache's, last
        frames.append(df.assign(paper_fraction_at_3m=PAPER_FRACTION_AT_3M.get(name)))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
