"""The engine: a front over one ``StepLoop`` with the torch executor (``paged.engine.executor``).

Each ``step()`` is one pass of the loop: schedule -> apply cache ops -> forward -> sample ->
update -> record. ``LLMEngine`` is the step-level API (``add_request``, ``step``, ``abort``,
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

from paged import telemetry
from paged.checks import need_int
from paged.core import events as ev
from paged.core.clock import EngineClock
from paged.core.kv_factory import build_kv_manager
from paged.core.kv_manager import KVCacheManager
from paged.core.loop import Step, StepLoop
from paged.core.scheduler import Scheduler
from paged.errors import ConfigError, DuplicateRequestError, InvalidRequestError, StepFailedError, UnknownRequestError
from paged.models.loader import LoadedModel
from .cache_sizing import allocation_error, size_cache
from .warmup import warm_up
from .config import EngineConfig
from .executor import ModelExecutor
from .groups import FINISH_REASON, SEQ_ID_SEP, Group, Groups
from .outputs import CompletionOutput, RequestOutput, StepOutput
from .runner import ModelRunner
from .sampling import SamplingParams

__all__ = ["CompletionOutput", "EngineConfig", "LLMEngine", "RequestOutput", "SEQ_ID_SEP", "StepOutput"]


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
            self.runner = ModelRunner(self.model, self.kv.num_blocks, self.kv.block_size,
                                      ref_count=self.kv.pool.ref_count, kv_cache_dtype=sz.kv_cache_dtype,
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
        self.clock = EngineClock()  # the clock of step and request records: engine time only (paged.core.clock)
        self.loop = StepLoop(self.scheduler, ModelExecutor(self), self.clock, observer=self)
        self.warmup_s = warm_up(self) if c.warm_up else 0.0  # first-call costs, paid before any timed work

    # ---- introspection ---------------------------------------------------------------
    @property
    def kv_manager(self) -> KVCacheManager:
        return self.kv

    @property
    def groups(self) -> Groups:
        """The user requests in flight, as groups of scheduler sequences (read-only use)."""
        return self._groups

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` is queued or running (not finished, aborted or unknown)."""
        return request_id in self._groups

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
        params.validate()  # also makes stop_token_ids a tuple of ints
        if isinstance(request_id, str) and SEQ_ID_SEP in request_id:
            raise InvalidRequestError(
                f"request id {request_id!r} contains {SEQ_ID_SEP!r}, which the engine reserves for the "
                f"sequences it forks ('<id>{SEQ_ID_SEP}k'); pick an id without it")
        priority = need_int("priority", priority,  # an integer: the priority queue compares it with others'
                            lambda msg: InvalidRequestError(f"request {request_id!r}: {msg}"))
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
            self._groups.record_done(group, self.scheduler.abort(sid), "abort")
        self.scheduler.take_finished()  # its freed blocks reach the runner in the next plan
        return self._finish(group)

    # ---- one step ----------------------------------------------------------------------
    def step(self) -> StepOutput:
        """Run one step of the loop and return what happened (its times on the engine clock)."""
        self._step_outputs, self._step_failures = [], []
        step = self.loop.step()
        r, ph = step.record, step.executed.phases
        finished, failed = self._step_outputs, self._step_failures
        out = StepOutput(**{**r.to_row(), "num_finished": len(finished)}, plan=step.plan,
                         new_tokens=dict(step.executed.sampled), finished=finished, schedule_s=step.schedule_s,
                         cache_ops_s=ph["cache_ops_s"], forward_s=ph["forward_s"], prefill_s=ph["prefill_s"],
                         decode_s=ph["decode_s"],
                         sample_s=r.step_time_s - step.schedule_s - ph["cache_ops_s"] - ph["forward_s"],
                         events=step.events)
        if failed:
            ids = [rid for rid, _ in failed]
            raise StepFailedError(
                f"step {r.step}: building the output of request(s) {ids} failed "
                f"({type(failed[0][1]).__name__}: {failed[0][1]}); they are finished and their blocks freed; "
                "the step's other outputs are in .step_output", ids, step_output=out) from failed[0][1]
        return out

    def after_update(self, step: Step) -> None:
        """The loop's observer: stamp the groups, release finished blocks, finish completed groups."""
        plan = step.plan
        self._groups.stamp(plan, step.executed.sampled, step.start_s, self.clock.now())
        self.runner.release_blocks(plan.finished_freed_blocks)
        for req in step.finished:
            self._groups.record_done(Groups.of(req), req, FINISH_REASON[req.status])
        self.scheduler.take_finished()
        for g in self._groups.completed(plan):
            try:  # one request's output failing must not lose the others'
                self._step_outputs.append(self._finish(g))
            except Exception as e:  # noqa: BLE001 - reported with the step's output
                self._step_failures.append((g.request_id, e))

    def _finish(self, g: Group) -> RequestOutput:
        out = self._groups.finish(g)
        self._request_rows.append(telemetry.request_row(
            g.request_id, g.arrival_s, len(g.prompt_token_ids),
            max((len(o.token_ids) for o in out.outputs), default=0), g.first_scheduled_s, g.first_token_s,
            g.last_token_s, self.clock.now(), g.num_token_steps, g.num_preemptions,
            g.num_cached_tokens))
        return out

    def _text(self, toks: Sequence[int], params: SamplingParams) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(
            toks, skip_special_tokens=params.skip_special_tokens)
