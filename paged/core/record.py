"""The step record: one typed row per executed step, the same for every executor.

``StepRecord``'s fields ARE the step schema (``paged.telemetry.STEP_COLUMNS`` is their names, in
order); see ``paged.telemetry`` for what each means. The step loop builds one per executed step
from the plan (counts read right after planning), the step's start and duration on the loop's
clock, and how many requests finished.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from .plan import SchedulerOutput

__all__ = ["StepRecord", "STEP_FIELDS", "STEP_FLOAT_FIELDS"]


@dataclass(slots=True)
class StepRecord:
    """One executed step (seconds; the pool counts are the plan's)."""

    step: int
    time_s: float
    step_time_s: float
    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_batched_tokens: int
    num_running: int
    num_waiting: int
    num_swapped: int
    num_preempted: int
    num_block_copies: int
    num_compaction_copies: int
    num_swapped_out_blocks: int
    num_swapped_in_blocks: int
    kv_cache_usage_perc: float
    token_usage: float
    num_used_blocks: int
    num_free_blocks: int
    num_cached_free_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_finished: int
    num_tier_out_blocks: int
    num_tier_in_blocks: int
    num_host_evicted_blocks: int
    num_host_cached_blocks: int
    host_cache_hits: int

    @classmethod
    def of(cls, plan: SchedulerOutput, time_s: float, step_time_s: float, num_finished: int) -> "StepRecord":
        """The record of ``plan`` executed from ``time_s`` for ``step_time_s`` seconds."""
        num_tokens, num_decode = plan.num_batched_tokens, plan.num_decode_tokens
        return cls(plan.step, time_s, step_time_s, plan.num_seqs, num_tokens - num_decode, num_decode, num_tokens,
                   plan.num_running, plan.num_waiting, plan.num_swapped, len(plan.preempted),
                   len(plan.block_copies), len(plan.compaction_copies), len(plan.swap_out), len(plan.swap_in),
                   plan.kv_cache_usage_perc, plan.token_usage, plan.num_used_blocks, plan.num_free_blocks,
                   plan.num_cached_free_blocks, plan.prefix_cache_queries, plan.prefix_cache_hits, num_finished,
                   len(plan.tier_out), len(plan.tier_in), plan.num_host_evicted_blocks, plan.num_host_cached_blocks,
                   plan.host_cache_hits)

    def to_row(self) -> dict[str, Any]:
        """This record as a dict keyed by ``STEP_FIELDS``, in order."""
        return {name: getattr(self, name) for name in STEP_FIELDS}


STEP_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(StepRecord))
STEP_FLOAT_FIELDS: frozenset[str] = frozenset(f.name for f in fields(StepRecord) if f.type == "float")
"""The fields typed ``float`` (seconds and shares); every other field is an ``int``."""
