"""Decode fast-forward: a replica's quiet decode steps taken in one go, with the records, stamps and
state that stepping them one by one gives, bit for bit.

A step is *quiet* when every request the scheduler holds is running and computes exactly its last
token, as a decode past its prompt, into a partly filled block it alone holds that the token does
not complete (no block taken, none filled up and indexed, so no KV event), and no request finishes
(the executor's token is no stop token, the output is short of ``max_tokens``). Nothing waits or is
swapped, so nothing is admitted; nothing is preempted, copied or freed. Then the step's plan is
the running list in order, one token each, and only the contexts (one longer each step), the
filled slots and the clock move. ``coast(replica, horizon)`` takes the quiet steps that start by
``horizon`` (the fleet's next arrival or failure: until then no replica sees another), each with
its ``StepRecord`` (from a plan of the same columns, so the record is ``StepRecord.of``'s), its
``STEP`` event and the cost model's time (``CostModel.decode_run_times``: ``step_time`` row by row).

Only the plain set-up coasts (FCFS, ``KVCacheManager`` and ``Scheduler`` themselves, no host
tier, no compaction); any other returns 0 steps, and the replica steps one by one as before.
"""
from __future__ import annotations

from typing import Any

from paged.core import events as ev
from paged.core.kv_manager import KVCacheManager
from paged.core.plan import SchedulerOutput
from paged.core.record import StepRecord
from paged.core.request import RequestStatus
from paged.core.scheduler import Scheduler

MIN_STEPS = 2   # fewer quiet steps than this: not worth the set-up, step normally


def quiet_steps(sched: Scheduler, tokens: Any) -> int:
    """How many of the next steps are quiet (see the module docstring); 0 when the set-up is not
    the plain one. ``tokens``: the executor's token by request id."""
    kv, cfg = sched.kv, sched.config
    running = sched.running
    if (not running or sched.swapped or len(sched.waiting) or type(kv) is not KVCacheManager
            or type(sched) is not Scheduler or cfg.policy != "fcfs" or cfg.enable_block_compaction
            or kv.has_host_tier or kv.pool.freed or len(running) > cfg.max_num_batched_tokens):
        return 0
    bs = kv.block_size
    last = bs - 1 if kv.enable_prefix_caching else bs   # offsets a quiet token may take: 1 .. last - 1
    k = None
    for req in running:
        p = req.num_computed_tokens
        offset = p % bs
        if (req.status is not RequestStatus.RUNNING or len(req.token_ids) - p != 1 or p < req.num_prompt_tokens
                or not offset or tokens[req.request_id] in req.stop_token_ids):
            return 0
        block = kv.blocks_of(req.request_id)[p // bs]
        if block.ref_cnt != 1 or block.num_filled != offset:
            return 0
        m = min(last - offset, req.max_tokens - (len(req.token_ids) - req.num_prompt_tokens) - 1)
        k = m if k is None or m < k else k
        if k <= 0:
            return 0
    return k


def coast(replica: Any, horizon: float) -> int:
    """Take ``replica``'s quiet steps that start by ``horizon`` (see the module docstring); their
    records go to ``replica.records``. Returns how many were taken."""
    sched, clock, executor = replica.scheduler, replica.clock, replica.loop.executor
    if clock.t > horizon:
        return 0
    k = quiet_steps(sched, executor.tokens)
    if k < MIN_STEPS:
        return 0
    kv, running = sched.kv, sched.running
    starts = [r.num_computed_tokens for r in running]
    times = executor.cost.decode_run_times(starts, k).tolist()
    plan = SchedulerOutput(step=0)          # the quiet step's plan: the same columns every step
    b = plan.batch
    b.requests, b.starts, b.num_tokens, b.samples = list(running), starts, [1] * len(running), [True] * len(running)
    pool = kv.pool
    n = len(running)
    plan.num_running, plan.kv_cache_usage_perc = n, kv.kv_cache_usage_perc
    plan.num_used_blocks, plan.num_free_blocks = kv.num_used_blocks, kv.num_free_blocks
    plan.num_cached_free_blocks = kv.num_cached_free_blocks
    plan.prefix_cache_queries, plan.prefix_cache_hits = kv.prefix_cache_queries, kv.prefix_cache_hits
    used_slots = pool.num_used * kv.block_size
    filled0, recorder, records = pool.num_filled_slots, sched.recorder, replica.records
    t, step0, taken = clock.t, sched.step_index, 0
    first_start = t
    for s, dur in enumerate(times):
        if t > horizon:
            break
        plan.step = recorder.step = step0 + s + 1
        plan.token_usage = (filled0 + n * (s + 1)) / used_slots   # kv.token_usage after the step's fill
        recorder.emit(ev.STEP, None, None, n)
        records.append(StepRecord.of(plan, t, dur, 0))
        if dur:
            t += dur
        taken = s + 1
    # the state after ``taken`` steps, as the loop leaves it
    sched.step_index = step0 + taken
    clock.t = t
    pool.num_filled_slots = filled0 + n * taken
    bs = kv.block_size
    for req, p in zip(running, starts):
        kv.blocks_of(req.request_id)[p // bs].num_filled += taken
        req.num_computed_tokens += taken
        req.token_ids.extend([executor.tokens[req.request_id]] * taken)
        d = req.data
        if d is not None:
            if d.first_scheduled is None:
                d.first_scheduled = first_start
            if d.first_token is None:
                d.first_token = records[-taken].time_s + records[-taken].step_time_s
            d.last_token = t
            d.num_token_steps += taken
    return taken
