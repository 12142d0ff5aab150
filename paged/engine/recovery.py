"""What the engine does when a step fails half-way (OOM, a kernel error, Ctrl-C in the model).

The scheduler has already committed the plan (blocks allocated, tokens counted as scheduled,
requests swapped), but the forward pass never wrote the K/V of the scheduled tokens. The
engine therefore aborts exactly the groups of that step (and, when the cache operations did
not finish, the requests swapped out by it, whose host copy may be incomplete), after dropping
the prefix-cache entries of the blocks the step was computing (and, when the cache operations
did not finish, of the blocks its swap-in allocated), so no later request gets a hit on K/V
that was never written. Everything else is untouched and keeps running.
"""
from __future__ import annotations

import contextlib
from typing import Any

from paged.core.scheduler import SchedulerOutput
from paged.errors import StepFailedError, UnknownRequestError


def abort_failed_step(engine: Any, plan: SchedulerOutput, exc: BaseException,
                      cache_ops_done: bool) -> StepFailedError:
    """Abort the requests of ``plan`` on ``engine`` (an ``LLMEngine``; see the module docstring)
    and return the error to raise."""
    kv = engine.kv
    for c in plan.scheduled:
        kv.uncache_written(c.request_id, c.start, c.num_tokens)
    seqs = [c.request_id for c in plan.scheduled]
    if not cache_ops_done:
        seqs += [rid for rid, _ in plan.preempted if kv.is_swapped(rid)]
        # the swapped-in blocks may never have been copied back, yet allocating the request's
        # chunk indexed its full ones: drop them, or a later prefix hit reads garbage K/V
        kv.uncache_blocks(gpu for _, gpu in plan.swap_in)
        # block compaction: moved blocks may never have received their K/V: drop their prefix
        # entries and abort the requests holding them
        moved = {dst for _, dst in plan.compaction_copies}
        kv.uncache_blocks(moved)
        seqs += [r.request_id for r in engine.scheduler.running
                 if kv.has(r.request_id) and not moved.isdisjoint(kv.block_table(r.request_id))]
        # host tier: brought-back blocks may be empty, demoted copies may be incomplete
        kv.uncache_blocks(gpu for _, gpu in plan.tier_in)
        kv.drop_host_blocks(cpu for _, cpu in plan.tier_out)
    groups = list(dict.fromkeys(g.request_id for sid in seqs if (g := engine.groups.of_seq(sid)) is not None))
    for gid in groups:
        with contextlib.suppress(UnknownRequestError):
            engine.abort(gid)
    # staging of blocks freed before the failure (int4_kivi), if the cache ops did not get to it; best effort:
    # the next plan carries the blocks freed by the aborts
    with contextlib.suppress(Exception):
        engine.runner.release_blocks(plan.freed_blocks)
    hint = ""
    if type(exc).__name__ == "StagingExhaustedError":  # int4_kivi sized from bytes: a fixed pool
        hint = ("; int4_kivi keeps one staging slot per unfilled block, max_num_seqs + 16 when the cache is "
                "sized from kv_cache_memory_bytes: raise max_num_seqs, lower n, or give num_blocks (then it grows)")
    return StepFailedError(
        f"step {plan.step} failed ({type(exc).__name__}: {exc}); its requests {groups} were aborted and "
        f"their blocks freed, the others are untouched and the engine can keep stepping{hint}", groups)
