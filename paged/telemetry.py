"""THE record schema: step, request and event columns, the same for both executors.

Both executors (the torch engine and the simulator) produce step rows with exactly
``STEP_COLUMNS`` and per-request rows with ``REQUEST_COLUMNS``; seconds everywhere.

- ``time_s``: start of the step on the executor's clock (engine: seconds since it was built;
  simulator: simulated seconds); ``step_time_s``: its measured (engine) or modelled (simulator)
  duration.
- ``kv_cache_usage_perc`` (vLLM's name): used blocks / all blocks, in [0, 1]; ``token_usage``
  (ours): slots holding tokens / slots of used blocks (block usage minus internal
  fragmentation); both and the pool counts are read right after the step's plan is made.
- ``prefix_cache_queries``/``prefix_cache_hits``: cumulative, in tokens (as vLLM counts them).
- ``num_compaction_copies``: blocks block compaction copied before the step (``paged.core.compaction``;
  0 unless ``enable_block_compaction``); ``num_block_copies`` counts copy-on-write copies only.
- host tier (``paged.core.host_tier``; all 0 without one): ``num_tier_out_blocks``/``num_tier_in_blocks``
  blocks copied GPU -> host / host -> GPU by the step, ``num_host_evicted_blocks`` host entries
  dropped for room, ``num_host_cached_blocks`` entries held after the plan, ``host_cache_hits``
  the cumulative tokens of ``prefix_cache_hits`` served from the host tier (GPU-tier hits are the
  difference). Bytes moved = blocks x the block's bytes (``paged.studies.host_tier.tier_metrics``).
- requests: ``*_s`` columns are times on the same clock as ``time_s`` (NaN when it never
  happened); ``ttft_s = first_token_s - arrival_time_s``, ``e2e_s = finish_s - arrival_time_s``,
  ``queueing_s = first_scheduled_s - arrival_time_s``, ``tbt_mean_s`` the mean gap between the
  steps that produced the request's tokens.

pandas is imported only by the ``*_frame`` functions, so this module is cheap to import.
"""
from __future__ import annotations

from operator import attrgetter
from typing import TYPE_CHECKING, Any, Iterable

from .core import events as ev
from .core.record import STEP_FIELDS, STEP_FLOAT_FIELDS, StepRecord

if TYPE_CHECKING:
    import pandas as pd

    from paged.core.kv_manager import KVCacheManager
    from paged.core.scheduler import Scheduler

STEP_COLUMNS = STEP_FIELDS  # the fields of paged.core.record.StepRecord, in order
"""One row per executed step (see the module docstring for meanings)."""

REQUEST_COLUMNS = ("request_id", "arrival_time_s", "num_prompt_tokens", "num_output_tokens",
                   "first_scheduled_s", "first_token_s", "finish_s", "ttft_s", "tbt_mean_s", "e2e_s",
                   "queueing_s", "num_preemptions", "num_cached_tokens")
"""One row per request (see the module docstring for meanings)."""

EVENT_COLUMNS = ["step", "kind", "request_id", "block_id", "value"]


def steps_frame(steps: Iterable[Any]) -> "pd.DataFrame":
    """One row per step, columns ``STEP_COLUMNS`` in order: from step rows (dicts), ``StepRecord``s
    (an engine ``StepOutput`` is one) or the loop's ``Step``s."""
    import numpy as np
    import pandas as pd
    steps = list(steps)
    if steps and all(s.__class__ is StepRecord for s in steps):  # the simulator's: one typed column at a time
        n = len(steps)
        return pd.DataFrame({name: np.fromiter(map(attrgetter(name), steps),
                                               np.float64 if name in STEP_FLOAT_FIELDS else np.int64, n)
                             for name in STEP_COLUMNS})
    rows = [s if isinstance(s, dict) else s.to_row() if hasattr(s, "to_row") else s.row for s in steps]
    return pd.DataFrame(rows, columns=list(STEP_COLUMNS))


def requests_frame(rows: Iterable[dict[str, Any]]) -> "pd.DataFrame":
    """One row per request, columns ``REQUEST_COLUMNS`` in order (missing times are NaN)."""
    import pandas as pd
    return pd.DataFrame(list(rows), columns=list(REQUEST_COLUMNS))


def request_row(request_id: str, arrival_time_s: float, num_prompt_tokens: int, num_output_tokens: int,
                first_scheduled_s: float | None, first_token_s: float | None, last_token_s: float | None,
                finish_s: float | None, num_token_steps: int, num_preemptions: int,
                num_cached_tokens: int) -> dict[str, Any]:
    """A ``REQUEST_COLUMNS`` row from a request's time stamps (None: never happened)."""
    nan = float("nan")

    def since(t: float | None) -> float:
        return nan if t is None else t - arrival_time_s

    tbt = ((last_token_s - first_token_s) / (num_token_steps - 1)
           if num_token_steps > 1 and first_token_s is not None and last_token_s is not None else nan)
    return {"request_id": request_id, "arrival_time_s": arrival_time_s, "num_prompt_tokens": num_prompt_tokens,
            "num_output_tokens": num_output_tokens,
            "first_scheduled_s": nan if first_scheduled_s is None else first_scheduled_s,
            "first_token_s": nan if first_token_s is None else first_token_s,
            "finish_s": nan if finish_s is None else finish_s, "ttft_s": since(first_token_s), "tbt_mean_s": tbt,
            "e2e_s": since(finish_s), "queueing_s": since(first_scheduled_s), "num_preemptions": num_preemptions,
            "num_cached_tokens": num_cached_tokens}


def events_frame(recorder: "ev.Recorder | Iterable[ev.Event]") -> "pd.DataFrame":
    """One row per event, in order (from a Recorder or its events). `value` is nullable (Int64)."""
    import pandas as pd
    events = recorder.events if isinstance(recorder, ev.Recorder) else list(recorder)
    return pd.DataFrame.from_records(events, columns=EVENT_COLUMNS).astype(
        {"step": "int64", "block_id": "Int64", "value": "Int64"})


def block_lifetimes(events: "pd.DataFrame") -> "pd.DataFrame":
    """Each allocation of a block with the step it was freed and its lifetime in steps.

    A lifetime runs from an allocation to the free that follows it (a prefix hit that revives
    a cached-free block does not start a new one); blocks still in use have `freed_step` NA."""
    import pandas as pd
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


def reuse_distances(events: "pd.DataFrame") -> "pd.Series":
    """Steps between a block being freed and the same block being allocated again."""
    import pandas as pd
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


def allocation_latency_ns(events: "pd.DataFrame") -> "pd.Series":
    """Nanoseconds spent in each `allocate_slots` call."""
    return events.loc[events["kind"] == ev.ALLOC_LATENCY, "value"].astype("int64").rename("alloc_latency_ns")


def metrics(kv: "KVCacheManager", scheduler: "Scheduler | None" = None) -> dict[str, float]:
    """A snapshot of the cache's (and scheduler's) counters."""
    m = dict(kv_cache_usage_perc=kv.kv_cache_usage_perc, token_usage=kv.token_usage,
             num_used_blocks=kv.num_used_blocks, num_free_blocks=kv.num_free_blocks,
             num_cached_free_blocks=kv.num_cached_free_blocks, prefix_cache_queries=kv.prefix_cache_queries,
             prefix_cache_hits=kv.prefix_cache_hits,
             prefix_cache_hit_rate=kv.prefix_cache_hits / kv.prefix_cache_queries if kv.prefix_cache_queries else 0.0,
             num_cow_copies=kv.num_cow_copies, num_swapped_out_blocks=kv.num_swapped_out_blocks,
             num_swapped_in_blocks=kv.num_swapped_in_blocks)
    host = getattr(kv, "host", None)
    if host is not None:
        m.update(host_cache_hits=kv.host_cache_hits, num_host_cached_blocks=len(host),
                 num_tier_out_blocks=host.num_tier_out_blocks, num_tier_in_blocks=host.num_tier_in_blocks,
                 num_host_evicted_blocks=host.num_host_evicted_blocks)
    if scheduler is not None:
        preempted = scheduler.num_preemptions
        m.update(num_preemptions=sum(preempted.values()), num_preemptions_recompute=preempted["recompute"],
                 num_preemptions_swap=preempted["swap"], num_running=len(scheduler.running),
                 num_waiting=len(scheduler.waiting), num_swapped=len(scheduler.swapped))
    return m
