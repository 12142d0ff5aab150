"""Decode fast-forward: a replica's quiet decode steps taken in one go, with the records, stamps and
state that stepping them one by one gives, bit for bit.

A step is *quiet* when every request the scheduler holds is running and computes exactly its last
token, as a decode past its prompt, through the KV manager's decode lane (into a partly filled
block it alone holds, or into a new block the pool has free), and no request finishes (the
executor's token is no stop token, the output is short of ``max_tokens``). Nothing waits or is
swapped, so nothing is admitted; nothing is preempted, copied or freed. Then the step's plan is
the running list in order, one token each, and only the contexts (one longer each step), the
filled slots, the clock and, at a block boundary, the pool move. ``coast(replica, horizon)``
takes the quiet steps that start by ``horizon`` (the fleet's next arrival or failure: until then
no replica sees another), each with its ``StepRecord`` (from a plan of the same columns, so the
record is ``StepRecord.of``'s), its ``STEP`` event and the cost model's time
(``CostModel.decode_run_times``: ``step_time`` row by row).

A step where some request opens a block (its token at offset 0) or fills one up (offset
``block_size - 1``, with prefix caching: the block is hashed and indexed) is a *lane step*: the
requests are brought up to that step and the manager's own ``append_decode_slots`` runs it, so
the blocks taken (an eviction when only cached-free blocks are left), the hashes indexed and the
KV events emitted are the loop's, in its order. Between lane steps only counters move, applied
in one go at the next lane step and at the end. The run stops before a step that would need more
new blocks than the pool has free (that step preempts: the loop takes it).

Only the plain set-up coasts (FCFS, ``KVCacheManager`` and ``Scheduler`` themselves, no host
tier, no compaction, blocks of at least two slots); any other returns 0 steps, and the replica
steps one by one as before.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

from paged.core import events as ev
from paged.core.kv_manager import KVCacheManager
from paged.core.plan import SchedulerOutput
from paged.core.record import StepRecord
from paged.core.request import Request, RequestStatus
from paged.core.scheduler import Scheduler

from .step_log import CONSTANT

MIN_STEPS = 2   # fewer quiet steps than this: not worth the set-up, step normally


def quiet_steps(sched: Scheduler, tokens: Any) -> int:
    """How many of the next steps are quiet, the pool's room for new blocks aside (``coast``
    counts it); 0 when the set-up is not the plain one. ``tokens``: the executor's token by
    request id."""
    kv, cfg = sched.kv, sched.config
    running = sched.running
    if (not running or sched.swapped or len(sched.waiting) or type(kv) is not KVCacheManager
            or type(sched) is not Scheduler or cfg.policy != "fcfs" or cfg.enable_block_compaction
            or kv.has_host_tier or kv.pool.freed or len(running) > cfg.max_num_batched_tokens
            or kv.block_size < 2):
        return 0
    bs = kv.block_size
    k = None
    for req in running:
        p = req.num_computed_tokens
        if (req.status is not RequestStatus.RUNNING or len(req.token_ids) - p != 1 or p < req.num_prompt_tokens
                or tokens[req.request_id] in req.stop_token_ids):
            return 0
        table, offset = kv.blocks_of(req.request_id), p % bs
        if offset:   # into the last block, which it alone holds, filled up to the token
            if len(table) != p // bs + 1 or table[-1].ref_cnt != 1 or table[-1].num_filled != offset:
                return 0
        elif len(table) != p // bs:   # opens a new block
            return 0
        m = req.max_tokens - (len(req.token_ids) - req.num_prompt_tokens) - 1
        k = m if k is None or m < k else k
        if k <= 0:
            return 0
    return k


def lane_steps(kv: KVCacheManager, starts: Sequence[int], k: int) -> tuple[set[int], int]:
    """The lane steps among the first ``k`` quiet steps of requests at positions ``starts`` (see
    the module docstring), and how many of the ``k`` the pool has room for: the steps before the
    first whose new blocks exceed the free ones (or, when the manager times allocations, the
    first that opens a block: the lane leaves that to the general path)."""
    bs = kv.block_size
    opens = Counter(s for p in starts for s in range((-p) % bs, k, bs))
    lane = set(opens)
    if kv.enable_prefix_caching:
        lane.update(s for p in starts for s in range((bs - 1 - p) % bs, k, bs))
    room = 0 if kv.times_allocations else kv.num_free_blocks
    for s in sorted(opens):
        room -= opens[s]
        if room < 0:
            return lane, s
    return lane, k


def catch_up(kv: KVCacheManager, running: Sequence[Request], token: Any, updates: int, fills: int) -> None:
    """Apply ``fills`` steps' slot fills (each request's token into its last block) and ``updates``
    steps' update (the token appended, one more computed) to every running request."""
    for req in running:
        if fills:
            kv.blocks_of(req.request_id)[-1].num_filled += fills
        if updates:
            req.num_computed_tokens += updates
            req.token_ids.extend([token[req.request_id]] * updates)
    kv.pool.num_filled_slots += len(running) * fills


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
    lane, k = lane_steps(kv, starts, k)
    if k < MIN_STEPS:
        return 0
    times = executor.cost.decode_run_times(starts, k).tolist()
    plan = SchedulerOutput(step=0)          # the quiet step's plan: the same columns every step
    b = plan.batch
    b.requests, b.starts, b.num_tokens, b.samples = list(running), starts, [1] * len(running), [True] * len(running)
    pool, bs, n = kv.pool, kv.block_size, len(running)
    plan.num_running = n
    plan.prefix_cache_queries, plan.prefix_cache_hits = kv.prefix_cache_queries, kv.prefix_cache_hits
    first = StepRecord.of(plan, 0.0, 0.0, 0)   # StepRecord.of's constant columns for every step of the run
    constants = tuple(getattr(first, f) for f in CONSTANT)
    recorder, log, tokens = sched.recorder, replica.records, executor.tokens
    moving = log.moving
    add_t, add_kvp, add_tu = moving["time_s"].append, moving["kv_cache_usage_perc"].append, moving["token_usage"].append
    add_used, add_free = moving["num_used_blocks"].append, moving["num_free_blocks"].append
    add_cached = moving["num_cached_free_blocks"].append
    t, step0, taken = clock.t, sched.step_index, 0
    first_start = t
    upd = fil = 0   # steps whose update / slot fill the requests and the pool show so far
    pool_changed = True
    emit_step = ev.STEP in recorder.hears
    for s, dur in enumerate(times):
        if t > horizon:
            break
        recorder.step = step0 + s + 1
        if s in lane:   # the manager's decode lane takes the step, with the requests as they stand at it
            catch_up(kv, running, tokens, s - upd, s - fil)
            upd = s
            done = kv.append_decode_slots(running, 0, n, [], [])
            assert done == n, "a lane step is handled by the lane alone"
            fil, pool_changed = s + 1, True
        if pool_changed:
            kvp, used, free, cached = kv.kv_cache_usage_perc, kv.num_used_blocks, kv.num_free_blocks, \
                kv.num_cached_free_blocks
            used_slots, pool_changed = pool.num_used * bs, False
        if emit_step:
            recorder.emit(ev.STEP, None, None, n)
        add_t(t)
        add_kvp(kvp)
        add_tu((pool.num_filled_slots + n * (s + 1 - fil)) / used_slots)  # kv.token_usage after the fill
        add_used(used)
        add_free(free)
        add_cached(cached)
        if dur:
            t += dur
        taken = s + 1
    log.add_run(step0 + 1, constants, times[:taken])
    # the state after ``taken`` steps, as the loop leaves it
    catch_up(kv, running, tokens, taken - upd, taken - fil)
    sched.step_index = step0 + taken
    clock.t = t
    for req in running:
        d = req.data
        if d is not None:
            if d.first_scheduled is None:
                d.first_scheduled = first_start
            if d.first_token is None:
                d.first_token = first_start + times[0]
            d.last_token = t
            d.num_token_steps += taken
    return taken
