"""The engine loop: schedule -> apply cache ops -> forward -> sample -> update -> record.

``LLMEngine`` is the step-level API (``add_request``, ``step``, ``abort``,
``has_unfinished_requests``, ``kv_manager``); ``paged.engine.llm.LLM`` wraps it for offline
batches. User requests are groups of scheduler sequences (``paged.engine.groups``: n > 1,
beam search); outputs and step records live in ``paged.engine.outputs``.

Invariant: after ``abort`` or completion all of a group's blocks are released by the scheduler.
"""
from __future__ import annotations

import dataclasses
import operator
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from paged import telemetry
from paged.checks import is_int
from paged.core import events as ev
from paged.core.kv_manager import KVCacheManager
from paged.core.prefix_cache import DEFAULT_HASH_FN
from paged.core.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, SchedulerOutput
from paged.errors import (ConfigError, DuplicateRequestError, InvalidRequestError, StepFailedError,
                          UnknownRequestError)
from paged.models.loader import LoadedModel
from .groups import FINISH_REASON, SEQ_ID_SEP, Group, Groups
from .outputs import ChunkInfo, CompletionOutput, RequestOutput, StepOutput
from .kv_sharing import check_share_map
from .runner import ModelRunner
from .recovery import abort_failed_step
from .validate import check_engine_config, fit_budget
from .sampling import SamplingParams, logprob_dicts

__all__ = ["ChunkInfo", "CompletionOutput", "EngineConfig", "LLMEngine", "RequestOutput", "SEQ_ID_SEP",
           "StepOutput"]

@dataclass
class EngineConfig:
    """Cache, scheduler and execution settings (names follow vLLM where it has them).

    ``num_blocks`` wins over ``kv_cache_memory`` (bytes for all layers' K and V, int4_kivi's
    fixed staging pool included); with neither, 512 MiB on CPU or 40% of the free GPU memory.
    Settings are type-checked first (``paged.engine.validate``). ``num_cpu_blocks`` (host pool for swap
    preemption and the host tier, shared) defaults to ``num_blocks`` when ``preemption_mode == "swap"``
    or ``enable_host_tier``, else 0.
    ``split_prefill_decode`` runs decode chunks and prefill chunks as two forward passes so
    each gets its own timing (default: one mixed pass, as vLLM does).
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    num_cpu_blocks: int | None = None
    max_model_len: int | None = None
    policy: str = "fcfs"
    watermark: float = 0.01
    seed: int = 0
    attention_backend: str | None = None
    split_prefill_decode: bool = False
    record_events: bool = True
    # xxh3_128 (sha256 without xxhash); hits are verified on tokens and parent: collisions cost only hits
    hash_fn: str = DEFAULT_HASH_FN
    # swap preemption's transport (paged.engine.swap): 'overlap' = side streams + events on CUDA
    # (same schedule, synchronous copies on CPU); compression 'fp8'|'int4' on the host (lossy)
    swap_mode: str = "sync"
    swap_compression: str | None = None
    # block compaction (paged.core.compaction; lossless): every `compaction_interval` steps, when the
    # running requests' fragmentation exceeds `compaction_threshold`, move live blocks so each table is
    # contiguous (at most `compaction_max_copies` copies; `compaction_drop_cached` may drop cached-free blocks)
    enable_block_compaction: bool = False
    compaction_threshold: float = 0.25
    compaction_interval: int = 16
    compaction_max_copies: int | None = None
    compaction_drop_cached: bool = False
    kv_share_with: dict[int, int] | None = None  # {layer: earlier owner layer}: see paged.engine.kv_sharing
    # host tier (paged.core.host_tier): cached-free prefix blocks go to the CPU pool instead of being
    # dropped, and come back on a hit (lossless); `eviction`/`host_eviction`: each tier's policy
    # ('lru', 'lfu', 'weighted', 'score[:k=v,...]'); `host_tier_threshold` < 1 demotes proactively
    # once used + cached-free GPU blocks exceed that share (1.0: only on eviction)
    eviction: str = "lru"
    enable_host_tier: bool = False
    host_eviction: str = "lru"
    host_tier_threshold: float = 1.0
    # paged.connect.speak: publish the prefix cache as vLLM KV events on this ZMQ endpoint ('tcp://*:5557', or a
    # dict of vLLM's KVEventsConfig keys) and serve Prometheus metrics under vLLM's names on this port (0: any free)
    kv_events_endpoint: str | dict | None = None
    metrics_port: int | None = None

    @classmethod
    def from_kwargs(cls, kwargs: dict, also: Sequence[str] = ()) -> "EngineConfig":
        """``EngineConfig(**kwargs)``, but an unknown name is a ConfigError listing the valid
        ones (``also``: names the caller takes itself, listed too)."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise ConfigError(f"unknown setting(s) {', '.join(unknown)}; valid: {', '.join([*also, *names])}")
        config = cls(**kwargs)
        check_engine_config(config)  # types and ranges, before anything is loaded
        return config


def _kv_bytes_per_block(cfg, block_size: int, kv_cache_dtype: str, dtype: torch.dtype, num_layers: int = 0) -> int:
    from paged._kernels import kernels
    try:
        return (num_layers or cfg.num_layers) * block_size * kernels.bytes_per_token(
            kv_cache_dtype, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, block_size=block_size)
    except kernels.KernelError as e:
        raise ConfigError(f"kv_cache_dtype {kv_cache_dtype!r}: {e}") from e


class LLMEngine:
    """Step-level engine over one loaded model."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        self.config = c = config or EngineConfig()
        check_engine_config(c)
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        mcfg = loaded.config
        p = next(self.model.parameters())
        self.device, self.dtype = p.device, p.dtype
        share = check_share_map(c.kv_share_with, mcfg.num_layers)
        n_cache = mcfg.num_layers - len(share or ())  # only the owner layers hold (and cost) a cache
        block_bytes = _kv_bytes_per_block(mcfg, c.block_size, c.kv_cache_dtype, self.dtype, n_cache)
        num_blocks, num_staging = c.num_blocks, None
        if num_blocks is None:
            budget = c.kv_cache_memory
            if budget is None:
                if self.device.type == "cuda":
                    free, _ = torch.cuda.mem_get_info(self.device)
                    budget = int(0.4 * free)
                else:
                    budget = 512 << 20
            num_blocks, num_staging = fit_budget(budget, block_bytes, mcfg, c, self.dtype, n_cache)
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ConfigError(f"the KV cache holds {num_blocks} blocks of {block_bytes} bytes; give "
                              "num_blocks >= 1 or a larger kv_cache_memory")
        max_len = min(loaded.max_model_len, num_blocks * c.block_size)
        if c.max_model_len is not None:
            if c.max_model_len > loaded.max_model_len:
                raise ConfigError(f"max_model_len={c.max_model_len} exceeds the model's "
                                  f"{loaded.max_model_len}; lower it")
            max_len = c.max_model_len
        self.max_model_len = max_len
        self._pool_limits_len = c.max_model_len is None and max_len < loaded.max_model_len
        num_cpu = c.num_cpu_blocks
        if num_cpu is None:
            num_cpu = num_blocks if c.preemption_mode == "swap" or c.enable_host_tier else 0
        self.recorder = ev.Recorder() if c.record_events else ev.NullRecorder()
        from paged._kernels import kernels
        try:
            self.kv = KVCacheManager(num_blocks, c.block_size, enable_prefix_caching=c.enable_prefix_caching,
                                     hash_fn=c.hash_fn, num_cpu_blocks=num_cpu, max_model_len=max_len,
                                     recorder=self.recorder, eviction=c.eviction, host_tier=c.enable_host_tier,
                                     host_eviction=c.host_eviction, host_tier_threshold=c.host_tier_threshold)
            self.scheduler = Scheduler(self.kv, SchedulerConfig.of(c, max_len))
            self.runner = ModelRunner(self.model, self.kv, kv_cache_dtype=c.kv_cache_dtype,
                                      num_cpu_blocks=num_cpu, attention_backend=c.attention_backend,
                                      max_num_seqs=c.max_num_seqs, num_staging_blocks=num_staging,
                                      swap_mode=c.swap_mode, swap_compression=c.swap_compression, kv_share_with=share)
        except kernels.KernelError as e:
            raise ConfigError(f"cannot set up the KV cache and attention backend: {e}") from e
        except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError
            if not isinstance(e, MemoryError) and "memory" not in str(e).lower() and "alloc" not in str(e).lower():
                raise
            need = (num_blocks + num_cpu) * block_bytes
            raise ConfigError(f"num_blocks={num_blocks} (+ num_cpu_blocks={num_cpu}) of {block_bytes:,} bytes need "
                              f"{need / 2**30:,.1f} GiB for the KV cache, which could not be allocated on "
                              f"{self.device}; lower num_blocks or give kv_cache_memory in bytes") from None
        self._groups = Groups(self.scheduler, c.seed, self._text)
        self._request_rows: list[dict] = []
        self._t0 = time.perf_counter()  # the engine clock of step and request records
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
        if self._pool_limits_len and len(ids) + params.max_tokens > self.max_model_len:  # the pool is the limit
            raise InvalidRequestError(
                f"request {request_id!r}: prompt ({len(ids)}) + max_tokens ({params.max_tokens}) tokens exceed the "
                f"KV cache of {self.kv.num_blocks} blocks x {self.kv.block_size} = {self.max_model_len} tokens; "
                "raise num_blocks (or kv_cache_memory) or lower max_tokens")
        vocab = self.loaded.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise InvalidRequestError(f"request {request_id!r}: token ids must lie in [0, {vocab})")
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.update(self.loaded.config.eos_token_ids)
            if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
                stops.add(self.tokenizer.eos_token_id)
        now = time.perf_counter()
        group = Group(request_id, text, ids, params, now if arrival_time is None else arrival_time,
                      stops=frozenset(stops), arrival_s=now - self._t0)
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
        """Run one scheduler step and return what happened."""
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
                      if (g := c.request.data.group).prompt_logprobs is not None}
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
            self._record_logprobs(sample_ids, logits, sampled, prompt_parts)
        except BaseException as e:
            err = abort_failed_step(self, plan, e, cache_ms is not None)
            if isinstance(e, Exception):
                raise err from e
            try:  # KeyboardInterrupt & co. propagate as themselves, with the error as their context
                raise err
            except StepFailedError:
                raise e
        for rid, _ in plan.preempted:
            self.scheduler.requests[rid].data.group.num_preemptions += 1
        done = self.scheduler.update(plan, sampled)
        for fn in post:
            fn()
        self._stamp(plan, sampled, t0 - self._t0, time.perf_counter() - self._t0)
        self.runner.release_blocks(plan.finished_freed_blocks)
        for req in done:
            self._groups.record_done(req.data.group, req, FINISH_REASON[req.status])
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
            total_ms=(t3 - t0) * 1e3, time_s=t0 - self._t0, events=self.recorder.since(mark),
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

    def _record_logprobs(self, sample_ids: list[str], logits: torch.Tensor, sampled: dict[str, int],
                         prompt_parts: list) -> None:
        """Store vLLM-style logprobs of sampled tokens and prompt tokens on their groups
        (prompt positions are overwritten, not appended, so recompute after preemption is safe)."""
        for row, rid in enumerate(sample_ids):
            req = self.scheduler.requests.get(rid)  # a beam may have been dropped while sampling
            g = req.data.group if req is not None else None
            if g is not None and g.params.logprobs is not None and rid in sampled:
                g.sample_logprobs += logprob_dicts(logits[row:row + 1], [sampled[rid]], g.params.logprobs)
        for part in prompt_parts:
            for rid, (start, rows) in (part or {}).items():
                req = self.scheduler.requests.get(rid)
                if req is None:
                    continue
                g = req.data.group
                toks = g.prompt_token_ids[start + 1:start + 1 + rows.shape[0]]
                lps = logprob_dicts(rows[:len(toks)], toks, g.params.prompt_logprobs)
                g.prompt_logprobs[start + 1:start + 1 + len(toks)] = lps

    def _stamp(self, plan: SchedulerOutput, sampled: dict[str, int], start_s: float, end_s: float) -> None:
        """Time stamps of the groups this step served (first scheduled, token steps)."""
        seen: set[int] = set()
        for c in plan.scheduled:
            g = c.request.data.group
            if g.first_scheduled_s is None:
                g.first_scheduled_s = start_s
            if c.samples and c.request_id in sampled and id(g) not in seen:
                seen.add(id(g))
                if g.first_token_s is None:
                    g.first_token_s = end_s
                g.last_token_s = end_s
                g.num_token_steps += 1

    def _finish(self, g: Group) -> RequestOutput:
        out = self._groups.finish(g)
        self._request_rows.append(telemetry.request_row(
            g.request_id, g.arrival_s, len(g.prompt_token_ids),
            max((len(o.token_ids) for o in out.outputs), default=0), g.first_scheduled_s, g.first_token_s,
            g.last_token_s, time.perf_counter() - self._t0, g.num_token_steps, g.num_preemptions,
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
        bs, table = self.kv.block_size, self.kv.block_table
        written: set[int] = set()
        for c in prefills:
            written.update(table(c.request_id)[c.start // bs:(c.start + c.num_tokens - 1) // bs + 1])
        late = [c for c in decodes if not written.isdisjoint(table(c.request_id)[:c.start // bs + 1])]
        if not late:
            return decodes, prefills
        return [c for c in decodes if c not in late], late + prefills

    def _text(self, toks: Sequence[int], params: SamplingParams) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(toks, skip_special_tokens=params.skip_special_tokens)
