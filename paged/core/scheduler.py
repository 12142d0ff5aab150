"""Continuous-batching scheduler over a KVCacheManager.

Each `schedule()` returns a plan (`SchedulerOutput`): which requests compute how many
tokens this step, the block copies (copy-on-write), swaps and preemptions to apply.
The executor applies, in this order: compaction_copies (block compaction, off by default),
tier_out (host tier, off by default), swap_out, block_copies, swap_in, tier_in, then the
forward pass; it returns one sampled token per chunk with `samples=True`, and `update()`
moves every request on. Order of a step:

1. running requests in order (FCFS: admission order; priority: best first), each
   asking for `min(remaining, budget)` tokens (decodes ask for 1). When the pool is
   full, the newest (FCFS) or lowest-priority running request not yet scheduled in
   this step is preempted, by swap (if chosen and the CPU pool has room) or recompute;
   a request may preempt itself. Victims never hold work planned in the same step.
2. swapped requests come back (oldest first) if no one was preempted this step;
3. waiting requests are admitted (prefix-cache hits first) while budget, sequence
   slots and free blocks above the watermark remain, if no one is swapped out.

A prefix hit may name a block that another request fills in the same step (as in
vLLM): the runner writes every chunk's K/V before any chunk attends, in each layer.

No request is lost: it is always in exactly one of waiting, running, swapped or
finished. None is starved: FCFS serves in arrival order, the priority policy ages
waiting requests (`priority_aging_steps`), and preempted requests go back to the head
of their queue, so they are served before anything that arrived later.
"""
from __future__ import annotations

import itertools
from collections import deque
from typing import Mapping

from . import events as ev
from paged.errors import DuplicateRequestError, InvalidRequestError, PagedError, UnknownRequestError
from .config import SchedulerConfig
from .kv_cache import KVCache
from .plan import Batch, ScheduledChunk, SchedulerOutput
from .queues import VictimPolicy, WaitingQueue, lowest_priority_first, newest_first
from .request import Request, RequestStatus

__all__ = ["ScheduledChunk", "Scheduler", "SchedulerConfig", "SchedulerOutput", "VictimPolicy",
           "lowest_priority_first", "newest_first"]

class Scheduler:
    def __init__(self, kv: KVCache, config: SchedulerConfig | None = None, *,
                 victim_policy: VictimPolicy | None = None) -> None:
        self.kv = kv
        # the token budget of vLLM's rule when none is given: for this cache's max_model_len
        self.config = (config or SchedulerConfig()).resolved(kv.max_model_len)
        self.recorder = kv.recorder
        self.waiting = WaitingQueue(self.config.policy)
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self.finished: list[Request] = []   # finished since the last `take_finished()`
        self.victim_policy = victim_policy or (
            lowest_priority_first if self.config.policy == "priority" else newest_first)
        self.step_index = 0
        self.num_preemptions = {"recompute": 0, "swap": 0}
        self._seq = itertools.count()
        self._watermark_blocks = int(self.config.watermark * kv.num_blocks)
        self._compaction_checked = 0  # step of the last fragmentation check (block compaction)

    # ---- requests in and out --------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request. Raises (and changes nothing) if it can never be served."""
        if request.request_id in self.requests:
            raise DuplicateRequestError(f"request id {request.request_id!r} is already in use; pick a new id")
        self.kv.check_request(request)
        if not self.config.enable_chunked_prefill and request.max_total_tokens > self.config.max_num_batched_tokens:
            raise InvalidRequestError(
                f"request {request.request_id!r} may hold {request.max_total_tokens} tokens, more than the token "
                f"budget {self.config.max_num_batched_tokens} without chunked prefill (a preempted request is "
                "recomputed in one step); enable chunked prefill or raise max_num_batched_tokens")
        request.arrival_seq = next(self._seq)
        aging = self.config.priority_aging_steps
        # rank = priority + arrival step / aging: the order of two ranks never changes as
        # time passes, yet a later arrival of better priority eventually ranks behind.
        request.priority_rank = request.priority + (self.step_index / aging if aging else 0.0)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def abort(self, request_id: str) -> Request:
        """Remove a request wherever it is and free everything it holds."""
        return self.finish(request_id, RequestStatus.FINISHED_ABORTED)

    def finish(self, request_id: str, status: RequestStatus) -> Request:
        if not status.is_finished:
            raise InvalidRequestError(f"finish needs a finished status, got {status}")
        request = self.requests.get(request_id)
        if request is None:
            raise UnknownRequestError(f"unknown request id {request_id!r} (finished, aborted or never added)")
        queues = {RequestStatus.RUNNING: self.running, RequestStatus.SWAPPED: self.swapped}
        queues.get(request.status, self.waiting).remove(request)  # the one queue holding it
        self._finish(request, status)
        return request

    def fork(self, parent_id: str, child_id: str, *, last_token: int | None = None, data=None) -> Request:
        """A running request's twin sharing all its blocks (parallel sampling, beam search).

        `last_token` replaces the child's last token, which is not computed yet (each
        sample of n > 1 draws its own first token from the same logits)."""
        parent = self.requests.get(parent_id)
        if parent is None or parent.status is not RequestStatus.RUNNING:
            raise UnknownRequestError(f"request {parent_id!r} is not running; only running requests can be forked")
        if child_id in self.requests:
            raise DuplicateRequestError(f"request id {child_id!r} is already in use; pick a new id")
        if parent.num_computed_tokens >= parent.num_tokens and last_token is not None:
            raise InvalidRequestError("the parent's last token is already computed; fork before computing it")
        child = Request(child_id, parent.prompt_token_ids, parent.max_tokens,
                        stop_token_ids=parent.stop_token_ids, arrival_time=parent.arrival_time,
                        priority=parent.priority, data=data)
        child.extra_keys = parent.extra_keys
        child.token_ids = list(parent.token_ids)
        if last_token is not None:
            child.token_ids[-1] = last_token
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        self.kv.fork(parent_id, child_id)
        child.arrival_seq = next(self._seq)
        child.priority_rank = parent.priority_rank
        child.status = RequestStatus.RUNNING
        self.requests[child_id] = child
        self.running.insert(self.running.index(parent) + 1, child)
        return child

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.swapped or len(self.waiting))

    def take_finished(self) -> list[Request]:
        out, self.finished = self.finished, []
        return out

    # ---- one step -------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.step_index += 1
        self.recorder.step = self.step_index
        cfg, kv = self.config, self.kv
        out = SchedulerOutput(step=self.step_index)
        budget = cfg.max_num_batched_tokens
        if cfg.policy == "priority":
            self.running.sort(key=lambda r: (r.priority_rank, r.arrival_seq))
        running = self.running
        if cfg.enable_block_compaction and self.step_index - self._compaction_checked >= cfg.compaction_interval:
            self._compact(out)
        batch, chunked, allocate, blocks_of = out.batch, cfg.enable_chunked_prefill, kv.allocate_slots, kv.blocks_of
        lane, starts, tables = kv.append_decode_slots, batch.starts, batch.tables
        i = 0
        while i < len(running) and budget > 0:  # the hot loop: one pass per running request
            # the decode lane first: a run of decodes into blocks they own (no copies, nobody preempted)
            j = lane(running, i, min(len(running), i + budget), starts, tables)
            if j > i:
                batch.add_decodes(running[i:j], j - i)
                budget -= j - i
                i = j
                continue
            req = running[i]
            total, done = len(req.token_ids), req.num_computed_tokens
            n = total - done
            if n > budget:
                if not chunked:
                    i += 1
                    continue
                n = budget
            copies = allocate(req, n)
            while copies is None:  # pool full: preempt someone not yet scheduled (maybe req)
                victim = running.pop(self.victim_policy(running, i))
                self._preempt(victim, out)
                if victim is req:
                    break
                copies = allocate(req, n)
            if copies is None:
                continue
            out.block_copies.extend(copies)
            batch.add(req, done, n, done + n == total, blocks_of(req.request_id))
            budget -= n
            i += 1
        if not out.preempted:
            budget = self._resume_swapped(out, budget)
            if not self.swapped:
                budget = self._admit_waiting(out, budget)
        if kv.has_host_tier:  # host tier: proactive demotion, then this plan's tier copies
            if out.batch:
                kv.demote_above_threshold()
            out.tier_out, out.tier_in, out.num_host_evicted_blocks = kv.take_tier_ops()
            out.num_host_cached_blocks, out.host_cache_hits = kv.num_host_cached_blocks, kv.host_cache_hits
        out.num_waiting, out.num_running, out.num_swapped = len(self.waiting), len(running), len(self.swapped)
        out.kv_cache_usage_perc, out.token_usage = kv.kv_cache_usage_perc, kv.token_usage
        out.num_used_blocks, out.num_free_blocks = kv.num_used_blocks, kv.num_free_blocks
        out.num_cached_free_blocks = kv.num_cached_free_blocks
        out.prefix_cache_queries, out.prefix_cache_hits = kv.prefix_cache_queries, kv.prefix_cache_hits
        out.freed_blocks = kv.take_freed_blocks()
        self.recorder.emit(ev.STEP, None, None, cfg.max_num_batched_tokens - budget)  # = out.num_batched_tokens
        return out

    def _compact(self, out: SchedulerOutput) -> None:
        """Block compaction before anything else of the step (so every later id of the plan is
        post-compaction): one pass when the running requests' fragmentation exceeds the threshold."""
        cfg, kv = self.config, self.kv
        self._compaction_checked = self.step_index
        order = [r.request_id for r in self.running]
        if kv.block_fragmentation(order) > cfg.compaction_threshold:
            out.compaction_copies = kv.compact(order, drop_cached=cfg.compaction_drop_cached,
                                               max_copies=cfg.compaction_max_copies)

    def _resume_swapped(self, out: SchedulerOutput, budget: int) -> int:
        kv, cfg = self.kv, self.config
        while self.swapped and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.swapped[0]
            n = req.num_tokens - req.num_computed_tokens
            if n > budget and not cfg.enable_chunked_prefill:
                break
            n = min(n, budget)
            if not kv.can_swap_in(req, n, keep_free=self._watermark()):
                break
            mapping = kv.swap_in(req.request_id)
            assert mapping is not None
            copies = kv.allocate_slots(req, n)
            assert copies == [], "blocks are exclusively owned after a swap in"
            self.swapped.popleft()
            out.swap_in.extend(mapping)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.batch.add(req, req.num_computed_tokens, n, req.num_computed_tokens + n == req.num_tokens,
                          kv.blocks_of(req.request_id))
            budget -= n
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        kv, cfg = self.kv, self.config
        while len(self.waiting) and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting.peek()
            cached = kv.find_cached_prefix(req)
            start = len(cached) * kv.block_size
            n = req.num_tokens - start
            if n > budget and not cfg.enable_chunked_prefill:
                break
            n = min(n, budget)
            if not kv.can_allocate(req, n, cached, keep_free=self._watermark()):
                break
            copies = kv.allocate_slots(req, n, cached)
            if copies is None:
                break
            self.waiting.pop()
            req.num_computed_tokens = start
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self.recorder.emit(ev.ADMIT, req.request_id, None, start)
            out.block_copies.extend(copies)
            out.batch.add(req, start, n, start + n == req.num_tokens, kv.blocks_of(req.request_id))
            budget -= n
        return budget

    def _watermark(self) -> int:
        """Blocks to keep free when admitting; waived when nothing runs, so a request
        needing more than `num_blocks - watermark` blocks still gets served."""
        return self._watermark_blocks if self.running else 0

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        mapping = self.kv.swap_out(req.request_id) if self.config.preemption_mode == "swap" else None
        mode = "recompute" if mapping is None else "swap"
        if mapping is not None:
            out.swap_out.extend(mapping)
            req.status = RequestStatus.SWAPPED
            self.swapped.append(req)
        else:
            self.kv.free(req.request_id)
            req.num_computed_tokens = 0
            req.status = RequestStatus.WAITING
            self.waiting.push(req, front=True)
        req.num_preemptions += 1
        self.num_preemptions[mode] += 1
        out.preempted.append((req.request_id, mode))
        self.recorder.emit(ev.PREEMPT, req.request_id, None,
                           ev.PREEMPT_SWAP if mode == "swap" else ev.PREEMPT_RECOMPUTE)

    def update(self, out: SchedulerOutput, sampled: Mapping[str, int]) -> list[Request]:
        """Advance every scheduled request; append sampled tokens; free finished ones. A chunk
        with ``samples=True`` of a still-running request without a token in ``sampled`` raises
        PagedError with every request as it was before the call."""
        running_status, length_status = RequestStatus.RUNNING, RequestStatus.FINISHED_LENGTH
        stopped_status = RequestStatus.FINISHED_STOPPED
        done: list[tuple[Request, RequestStatus]] = []
        batch = out.batch
        req = None
        try:
            for decodes, i in batch.runs():
                for req in decodes:  # the decode lane's entries: one token each, every one samples
                    if req.status is not running_status:  # aborted since scheduling
                        continue
                    token = sampled[req.request_id]  # KeyError: undone below
                    if token.__class__ is not int:
                        token = int(token)
                    req.num_computed_tokens += 1
                    tokens = req.token_ids  # Request.append_token, inlined (the same two finish rules)
                    tokens.append(token)
                    if token in req.stop_token_ids:
                        done.append((req, stopped_status))
                    elif len(tokens) - req.num_prompt_tokens >= req.max_tokens:
                        done.append((req, length_status))
                if i < 0:
                    break
                req = batch.requests[i]
                if req.status is not running_status:  # aborted or preempted since scheduling
                    continue
                if batch.samples[i]:
                    token = sampled[req.request_id]  # KeyError: undone below
                    if token.__class__ is not int:
                        token = int(token)
                    req.num_computed_tokens += batch.num_tokens[i]
                    tokens = req.token_ids
                    tokens.append(token)
                    if token in req.stop_token_ids:
                        done.append((req, stopped_status))
                    elif len(tokens) - req.num_prompt_tokens >= req.max_tokens:
                        done.append((req, length_status))
                else:
                    req.num_computed_tokens += batch.num_tokens[i]
        except KeyError:
            self._undo_update(batch, req)
            raise PagedError(f"executor returned no token for request {req.request_id!r}; "
                             "every chunk with samples=True needs one") from None
        if done:
            finished_ids = {id(r) for r, _ in done}
            self.running = [r for r in self.running if id(r) not in finished_ids]
            for req, status in done:
                self._finish(req, status)
        out.finished_freed_blocks = self.kv.take_freed_blocks()
        return [r for r, _ in done]

    @staticmethod
    def _undo_update(batch: Batch, failed: Request) -> None:
        """Take back what ``update`` did to the entries before the one of ``failed`` (nothing finished yet)."""
        for req, n, samples in zip(batch.requests, batch.num_tokens, batch.samples):
            if req is failed:
                return
            if req.status is RequestStatus.RUNNING:
                req.num_computed_tokens -= n
                if samples:
                    req.token_ids.pop()

    def _finish(self, req: Request, status: RequestStatus) -> None:
        self.kv.release_if_held(req.request_id)
        req.status = status
        del self.requests[req.request_id]
        self.finished.append(req)
        kind = ev.ABORT if status is RequestStatus.FINISHED_ABORTED else ev.FINISH
        self.recorder.emit(kind, req.request_id, None, req.num_output_tokens)
