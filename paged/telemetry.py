"""Events and step plans -> pandas DataFrames and summary metrics.

Metric names follow vLLM where one exists: `kv_cache_usage_perc`, `prefix_cache_queries`,
`prefix_cache_hits` (both in tokens), `num_preemptions`. `token_usage` is ours: slots
holding tokens / slots in used blocks (block usage minus internal fragmentation).
"""
from __future__ import annotations

from typing import Iterable

import pandas as pd

from .core import events as ev
from paged.core.kv_manager import KVCacheManager
from paged.core.scheduler import Scheduler, SchedulerOutput

EVENT_COLUMNS = ["step", "kind", "request_id", "block_id", "value"]


def events_frame(recorder: ev.Recorder) -> pd.DataFrame:
    """One row per event, in order. `value` is nullable (Int64)."""
    df = pd.DataFrame.from_records(recorder.events, columns=EVENT_COLUMNS)
    df["step"] = df["step"].astype("int64")
    df["block_id"] = df["block_id"].astype("Int64")
    df["value"] = df["value"].astype("Int64")
    return df


def steps_frame(outputs: Iterable[SchedulerOutput]) -> pd.DataFrame:
    """One row per scheduled step: tokens (prefill/decode), queue lengths, memory."""
    rows = [{
        "step": o.step, "num_batched_tokens": o.num_batched_tokens,
        "num_prefill_tokens": o.num_prefill_tokens, "num_decode_tokens": o.num_decode_tokens,
        "num_seqs": len(o.scheduled), "num_running": o.num_running, "num_waiting": o.num_waiting,
        "num_swapped": o.num_swapped, "num_preempted": len(o.preempted),
        "num_block_copies": len(o.block_copies), "num_swap_out_blocks": len(o.swap_out),
        "num_swap_in_blocks": len(o.swap_in), "kv_cache_usage_perc": o.kv_cache_usage_perc,
        "token_usage": o.token_usage,
    } for o in outputs]
    return pd.DataFrame(rows)


def block_lifetimes(events: pd.DataFrame) -> pd.DataFrame:
    """Each allocation of a block with the step it was freed and its lifetime in steps.

    A lifetime runs from an allocation to the free that follows it (a prefix hit that revives
    a cached-free block does not start a new one); blocks still in use have `freed_step` NA."""
    e = events[events["kind"].isin([ev.ALLOCATE, ev.FREE])][["step", "kind", "block_id"]]
    rows = []
    for bid, g in e.groupby("block_id", sort=True):
        alloc = None
        for step, kind in zip(g["step"].to_numpy(), g["kind"].to_numpy()):
            if kind == ev.ALLOCATE:
                alloc = int(step)
            elif alloc is not None:
                rows.append((int(bid), alloc, int(step), int(step) - alloc))
                alloc = None
        if alloc is not None:
            rows.append((int(bid), alloc, pd.NA, pd.NA))
    return pd.DataFrame(rows, columns=["block_id", "alloc_step", "freed_step", "lifetime_steps"])


def reuse_distances(events: pd.DataFrame) -> pd.Series:
    """Steps between a block being freed and the same block being allocated again."""
    e = events[events["kind"].isin([ev.ALLOCATE, ev.FREE])][["step", "kind", "block_id"]]
    out = []
    for _, g in e.groupby("block_id", sort=False):
        last_free = None
        for step, kind in zip(g["step"].to_numpy(), g["kind"].to_numpy()):
            if kind == ev.FREE:
                last_free = int(step)
            elif last_free is not None:
                out.append(int(step) - last_free)
                last_free = None
    return pd.Series(out, dtype="int64", name="reuse_distance_steps")


def allocation_latency_ns(events: pd.DataFrame) -> pd.Series:
    """Nanoseconds spent in each `allocate_slots` call."""
    return events.loc[events["kind"] == ev.ALLOC_LATENCY, "value"].astype("int64").rename("alloc_latency_ns")


def metrics(kv: KVCacheManager, scheduler: Scheduler | None = None) -> dict[str, float]:
    """A snapshot of the cache's (and scheduler's) counters."""
    m = {
        "kv_cache_usage_perc": kv.kv_cache_usage_perc,
        "token_usage": kv.token_usage,
        "num_used_blocks": kv.num_used_blocks,
        "num_free_blocks": kv.num_free_blocks,
        "num_cached_free_blocks": kv.num_cached_free_blocks,
        "prefix_cache_queries": kv.prefix_cache_queries,
        "prefix_cache_hits": kv.prefix_cache_hits,
        "prefix_cache_hit_rate": kv.prefix_cache_hits / kv.prefix_cache_queries if kv.prefix_cache_queries else 0.0,
        "num_cow_copies": kv.num_cow_copies,
        "num_swapped_out_blocks": kv.num_swapped_out_blocks,
        "num_swapped_in_blocks": kv.num_swapped_in_blocks,
    }
    if scheduler is not None:
        m["num_preemptions"] = sum(scheduler.num_preemptions.values())
        m["num_preemptions_recompute"] = scheduler.num_preemptions["recompute"]
        m["num_preemptions_swap"] = scheduler.num_preemptions["swap"]
        m["num_running"] = len(scheduler.running)
        m["num_waiting"] = len(scheduler.waiting)
        m["num_swapped"] = len(scheduler.swapped)
    return m

