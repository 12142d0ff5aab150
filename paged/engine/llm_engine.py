"""The engine loop: schedule -> apply cache ops -> forward -> sample -> update -> record.

``LLMEngine`` is the step-level API (``add_request``, ``step``, ``abort``,
``has_unfinished_requests``, ``kv_manager``); ``paged.engine.llm.LLM`` wraps it for offline
batches. User requests are groups of scheduler sequences (``paged.engine.groups``: n > 1,
beam search); outputs and step records live in ``paged.engine.outputs``; the settings in
``paged.engine.config`` (``EngineConfig``) and the cache's size in ``paged.engine.cache_sizing``.

Invariant: after ``abort`` or completion all of a group's blocks are released by the scheduler.
"""
from __future__ import annotations

import dataclasses
import operator
import time
from typing import Sequence

import torch

from paged import telemetry
from paged.checks import is_int
from paged.core import events as ev
from paged.core.kv_manager import build_kv_manager
from paged.core.kv_manager import KVCacheManager
from paged.core.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from paged.errors import (ConfigError, DuplicateRequestError, InvalidRequestError, StepFailedError,
                          UnknownRequestError)
from paged.models.loader import LoadedModel
from .cache_sizing import allocation_error, size_cache
from .clock import EngineClock
from .warmup import warm_up
from .cache_sizing import kv_bytes_per_block as _kv_bytes_per_block  # noqa: F401 - its old import path
from .config import EngineConfig
from .groups import FINISH_REASON, SEQ_ID_SEP, Group, Groups
from .outputs import ChunkInfo, CompletionOutput, RequestOutput, StepOutput
from .runner import ModelRunner
from .recovery import abort_failed_step
from .sampling import SamplingParams

__all__ = ["ChunkInfo", "CompletionOutput", "EngineConfig", "LLMEngine", "RequestOutput", "SEQ_ID_SEP",
           "StepOutput"]


class LLMEngine:
    """Step-level engine over one loaded model."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        self.config = c = config or EngineConfig()  # checked when it was built
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        p = next(self.model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.sizing = sz = size_cache(c, loaded, self.device, self.dtype)
        self.max_model_len = sz.max_model_len
        self.recorder = ev.Recorder() if c.record_events else ev.NullRecorder()
        from paged._kernels import kernels
        try:
            self.kv = build_kv_manager(c.cache, sz.num_blocks, num_cpu_blocks=sz.num_cpu_blocks,
                                       max_model_len=sz.max_model_len, recorder=self.recorder)
            self.scheduler = Scheduler(self.kv, c.scheduler.resolved(sz.max_model_len))
            self.runner = ModelRunner(self.model, self.kv, kv_cache_dtype=sz.kv_cache_dtype,
                                      num_cpu_blocks=sz.num_cpu_blocks, attention_backend=c.attention_backend,
                                      max_num_seqs=c.max_num_seqs, num_staging_blocks=sz.num_staging_blocks,
                                      swap_mode=c.swap_mode, swap_compression=c.swap_compression,
                                      kv_share_with=sz.kv_share_with)
        except kernels.KernelError as e:
            raise ConfigError(f"cannot set up the KV cache and attention backend: {e}") from e
        except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError
            err = allocation_error(sz, self.device, e)
            if err is None:
                raise
            raise err from None
        self._groups = Groups(self.scheduler, c.sampling_seed, self._text)
        self._request_rows: list[dict] = []
        self.clock = EngineClock()  # the clock of step and request records: engine time only (clock.py)
        self.warmup_s = warm_up(self) if c.warm_up else 0.0  # first-call costs, paid before any timed work
        self.vllm = None  # paged.connect.speak.EngineSpeaker when kv_events_endpoint / metrics_port are set
        if c.kv_events_endpoint is not None or c.metrics_port is not None:
            from paged.connect.speak import connect_engine
            self.vllm = connect_engine(self)

    # ---- introspection ---------------------------------------------------------------
    @property
    def kv_manager(self) -> KVCacheManager:
        return self.kv

    @property
    def model_config(self):
        return self.loaded.config

    @property
    def groups(self) -> Groups:
        """The user requests in flight, as groups of scheduler sequences (read-only use)."""
        return self._groups

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` is queued or running (not finished, aborted or unknown)."""
        return request_id in self._groups

    def num_unfinished_requests(self) -> int:
        return len(self._groups)

    def request_rows(self) -> list[dict]:
        """One record per finished (or aborted) request, in finishing order: exactly
        ``paged.telemetry.REQUEST_COLUMNS``, times in seconds on the engine clock."""
        return list(self._request_rows)

    # ---- requests ----------------------------------------------------------------------
    def _to_ids(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer; pass prompts as lists of token ids")
            return prompt, self.tokenizer.encode(prompt)
        try:
            if isinstance(prompt, (bytes, bytearray, dict)) or any(isinstance(t, bool) for t in prompt):
                raise TypeError(prompt)  # bytes are not token ids; a dict iterates its keys
            ids = [operator.index(t) for t in prompt]  # ints only: no silent 1.7 -> 1 or "5" -> 5
        except TypeError:
            raise InvalidRequestError(
                f"a prompt is a string or a sequence of integer token ids, got {type(prompt).__name__} "
                f"{str(prompt)[:60]}") from None
        return None, ids

    def add_request(self, request_id: str, prompt: str | Sequence[int],
                    params: SamplingParams | None = None, *, priority: int = 0,
                    arrival_time: float | None = None) -> None:
        """Queue a request. Raises InvalidRequestError/DuplicateRequestError and changes
        nothing when the request cannot be served."""
        # a private copy: a caller reusing (and changing) its SamplingParams must not change
        # a request already in flight
        if params is not None and not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"request {request_id!r}: params must be a SamplingParams, got "
                                      f"{type(params).__name__} {str(params)[:60]}")
        params = dataclasses.replace(params) if params is not None else SamplingParams()
        params.validate()
        params.stop_token_ids = tuple(params.stop_token_ids)
        if isinstance(request_id, str) and SEQ_ID_SEP in request_id:
            raise InvalidRequestError(
                f"request id {request_id!r} contains {SEQ_ID_SEP!r}, which the engine reserves for the "
                f"sequences it forks ('<id>{SEQ_ID_SEP}k'); pick an id without it")
        if not is_int(priority):  # the priority queue compares it with others'
            raise InvalidRequestError(f"request {request_id!r}: priority must be an integer, got {priority!r}")
        priority = int(priority)
        if request_id in self._groups:
            raise DuplicateRequestError(f"request id {request_id!r} is already in use; pick a new id")
        text, ids = self._to_ids(prompt)
        if not ids:
            raise InvalidRequestError(f"request {request_id!r} has an empty prompt; give at least one token")
        if self.sizing.pool_limits_len and len(ids) + params.max_tokens > self.max_model_len:  # the pool is the limit
            raise InvalidRequestError(
                f"request {request_id!r}: prompt ({len(ids)}) + max_tokens ({params.max_tokens}) tokens exceed the "
                f"KV cache of {self.kv.num_blocks} blocks x {self.kv.block_size} = {self.max_model_len} tokens; "
                "raise num_blocks (or kv_cache_memory_bytes) or lower max_tokens")
        vocab = self.loaded.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise InvalidRequestError(f"request {request_id!r}: token ids must lie in [0, {vocab})")
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.update(self.loaded.config.eos_token_ids)
            if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
                stops.add(self.tokenizer.eos_token_id)
        group = Group(request_id, text, ids, params, time.perf_counter() if arrival_time is None else arrival_time,
                      stops=frozenset(stops), arrival_s=self.clock.now())
        self._groups.add(group, priority)  # raises before any state changes

    def abort(self, request_id: str) -> RequestOutput:
        """Stop a request (all its sequences) and free its blocks; returns what it produced."""
        group = self._groups.get(request_id)
        if group is None:
            raise UnknownRequestError(f"unknown request id {request_id!r} (finished, aborted or never added)")
        for sid in list(group.live):
            req = self.scheduler.abort(sid)
            self._groups.record_done(group, req, "abort")
        self.scheduler.take_finished()  # its freed blocks reach the runner in the next plan
        return self._finish(group)

    # ---- one step ----------------------------------------------------------------------
    def step(self) -> StepOutput:
        """Run one scheduler step and return what happened (its times on the engine clock)."""
        start = self.clock.start()
        try:
            return self._step(start)
        finally:
            self.clock.stop()

    def _step(self, start: float) -> StepOutput:
        t0 = time.perf_counter()
        mark = len(self.recorder)
        plan = self.scheduler.schedule()
        t1 = time.perf_counter()
        cache_ms = None
        try:  # all-or-nothing for the caller: a failure aborts exactly this step's requests
            cache_ms = self.runner.apply_cache_ops(plan)
            swap, nxt = getattr(self.runner, "swap", None), self.scheduler.swapped
            if swap is not None and nxt and not plan.preempted and self.kv.is_swapped(nxt[0].request_id):
                # overlap mode: the next swap-in's host->device copy rides beside this forward
                swap.prefetch(self.kv.swapped_host_blocks(nxt[0].request_id))
            prefill_ms = decode_ms = None
            decodes = [c for c in plan.scheduled if c.is_decode]
            prefills = [c for c in plan.scheduled if not c.is_decode]
            first, second = (self._split_passes(decodes, prefills)
                             if self.config.split_prefill_decode and decodes and prefills else ([], []))
            limits = {c.request_id: len(g.prompt_token_ids) - 1 for c in plan.scheduled
                      if (g := Groups.of(c.request)).prompt_logprobs is not None}
            prompt_parts = []
            if first and second:
                rd, rp = self._forward(first, limits), self._forward(second, limits)
                prompt_parts = [rd.prompt_logits, rp.prompt_logits]
                decode_ms, prefill_ms = rd.forward_ms, rp.forward_ms
                sample_ids = rd.sample_ids + rp.sample_ids
                logits = torch.cat([rd.logits, rp.logits])
                forward_ms = decode_ms + prefill_ms
            else:
                r = self._forward(plan.scheduled, limits)
                sample_ids, logits, forward_ms = r.sample_ids, r.logits, r.forward_ms
                prompt_parts = [r.prompt_logits]
                if not prefills:
                    decode_ms, prefill_ms = forward_ms, 0.0
                elif not decodes:
                    decode_ms, prefill_ms = 0.0, forward_ms
            t2 = time.perf_counter()
            sampled, post = self._groups.sample(sample_ids, logits)
            self._groups.record_logprobs(sample_ids, logits, sampled, prompt_parts)
        except BaseException as e:
            err = abort_failed_step(self, plan, e, cache_ms is not None)
            if isinstance(e, Exception):
                raise err from e
            try:  # KeyboardInterrupt & co. propagate as themselves, with the error as their context
                raise err
            except StepFailedError:
                raise e
        self._groups.note_preempted(plan.preempted)
        done = self.scheduler.update(plan, sampled)
        for fn in post:
            fn()
        self._groups.stamp(plan, sampled, start, self.clock.now())
        self.runner.release_blocks(plan.finished_freed_blocks)
        for req in done:
            self._groups.record_done(Groups.of(req), req, FINISH_REASON[req.status])
        self.scheduler.take_finished()
        finished, failed = [], []
        for g in self._groups.completed(plan):
            try:  # one request's output failing must not lose the others'
                finished.append(self._finish(g))
            except Exception as e:  # noqa: BLE001 - reported below with the step's output
                failed.append((g.request_id, e))
        t3 = time.perf_counter()
        out = StepOutput(
            step=plan.step,
            scheduled=[ChunkInfo(c.request_id, c.start, c.num_tokens, not c.is_decode, c.samples)
                       for c in plan.scheduled],
            num_prefill_tokens=plan.num_prefill_tokens, num_decode_tokens=plan.num_decode_tokens,
            new_tokens=dict(sampled), finished=finished, preempted=list(plan.preempted),
            num_block_copies=len(plan.block_copies), num_compaction_copies=len(plan.compaction_copies),
            num_swapped_out_blocks=len(plan.swap_out),
            num_swapped_in_blocks=len(plan.swap_in), num_tier_out_blocks=len(plan.tier_out),
            num_tier_in_blocks=len(plan.tier_in), num_host_evicted_blocks=plan.num_host_evicted_blocks,
            schedule_ms=(t1 - t0) * 1e3, cache_ops_ms=cache_ms, forward_ms=forward_ms,
            prefill_ms=prefill_ms, decode_ms=decode_ms, sample_ms=(t3 - t2) * 1e3,
            total_ms=(t3 - t0) * 1e3, time_s=start, events=self.recorder.since(mark),
            **plan.pool_counts())
        if failed:
            ids = [rid for rid, _ in failed]
            raise StepFailedError(
                f"step {plan.step}: building the output of request(s) {ids} failed "
                f"({type(failed[0][1]).__name__}: {failed[0][1]}); they are finished and their blocks freed; "
                "the step's other outputs are in .step_output", ids, step_output=out) from failed[0][1]
        return out

    def _forward(self, chunks, limits: dict[str, int]):
        # prompt_limits only when asked: callers may wrap runner.forward(chunks)
        return self.runner.forward(chunks, prompt_limits=limits) if limits else self.runner.forward(chunks)

    def _finish(self, g: Group) -> RequestOutput:
        out = self._groups.finish(g)
        self._request_rows.append(telemetry.request_row(
            g.request_id, g.arrival_s, len(g.prompt_token_ids),
            max((len(o.token_ids) for o in out.outputs), default=0), g.first_scheduled_s, g.first_token_s,
            g.last_token_s, self.clock.now(), g.num_token_steps, g.num_preemptions,
            g.num_cached_tokens))
        return out

    def _split_passes(self, decodes: list[ScheduledChunk], prefills: list[ScheduledChunk]
                      ) -> tuple[list[ScheduledChunk], list[ScheduledChunk]]:
        """The two forward passes of ``split_prefill_decode``: decodes first, then prefills.

        Decodes go first because a prefill may hit a block that a decode completes in this
        step. A decode-sized chunk may itself read a block a prefill chunk writes in this
        step (a request readmitted after recompute preemption whose prefix hit covers all but
        its last token, e.g. one of n identical greedy samples): such a chunk joins the
        prefill pass, so every block is written before it is read.
        """
        bs = self.kv.block_size
        written: set[int] = set()
        for c in prefills:  # block ids from the plan: each chunk carries its request's table
            written.update(b.block_id for b in c.blocks[c.start // bs:(c.start + c.num_tokens - 1) // bs + 1])
        late = [c for c in decodes if not written.isdisjoint(b.block_id for b in c.blocks[:c.start // bs + 1])]
        if not late:
            return decodes, prefills
        return [c for c in decodes if c not in late], late + prefills

    def _text(self, toks: Sequence[int], params: SamplingParams) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(toks, skip_special_tokens=params.skip_special_tokens)
