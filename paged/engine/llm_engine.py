"""The engine loop: schedule -> apply cache ops -> forward -> sample -> update -> record.

``LLMEngine`` is the step-level API (``add_request``, ``step``, ``abort``,
``has_unfinished_requests``, ``kv_manager``); ``paged.engine.llm.LLM`` wraps it for offline
batches. A user request is a *group* of sequences (scheduler requests): one for plain
sampling, ``n`` for parallel sampling (children forked from the parent after its prompt is
computed, sharing its blocks), up to ``n`` live beams for beam search (copy-on-write when a
forked beam writes into a shared block).

Invariants: every sequence of a group is a scheduler request whose ``data`` is its
``_Seq``; a group is finished when none of its sequences is left in the scheduler; after
``abort`` or completion all of a group's blocks are released by the scheduler.
"""
from __future__ import annotations

import dataclasses
import itertools
import operator
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from paged.core import events as ev
from paged.errors import ConfigError, DuplicateRequestError, InvalidRequestError, UnknownRequestError
from paged.core.kv_manager import KVCacheManager
from paged.models.loader import LoadedModel
from paged.core.request import Request, RequestStatus
from .runner import ModelRunner
from .sampling import SamplingParams, greedy_tokens, make_generator, sample_row
from paged.core.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, SchedulerOutput

SEQ_ID_SEP = "#"
"""Separates a request id from the suffix of its forked sequences (``"<id>#k"``, ``"<id>#b<j>"``);
user request ids may not contain it, so forked ids never collide with another request's."""

_FINISH_REASON = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                  RequestStatus.FINISHED_ABORTED: "abort"}


@dataclass
class EngineConfig:
    """Cache, scheduler and execution settings (names follow vLLM where it has them).

    ``num_blocks`` wins over ``kv_cache_memory`` (bytes for all layers' K and V); with neither,
    512 MiB on CPU or 40% of the free GPU memory. ``num_cpu_blocks`` (host pool for swap
    preemption) defaults to ``num_blocks`` when ``preemption_mode == "swap"``, else 0.
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
    hash_fn: str = "sha256"


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str = ""
    cumulative_logprob: float | None = None
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    arrival_time: float = 0.0
    finish_time: float = 0.0


@dataclass
class ChunkInfo:
    """What one scheduled chunk did in a step."""
    request_id: str
    start: int
    num_tokens: int
    is_prefill: bool
    samples: bool


@dataclass
class StepOutput:
    """Everything that happened in one ``step()``; times in milliseconds.

    ``schedule_ms`` + ``cache_ops_ms`` + ``forward_ms`` + ``sample_ms`` ~= ``total_ms``, where
    ``sample_ms`` covers sampling and the bookkeeping after it (scheduler update, forks,
    finishing requests).

    ``prefill_ms``/``decode_ms`` are measured forward times of the step's prefill and decode
    work: for a pure step one of them is the whole forward pass and the other 0; a mixed step
    runs one pass and reports both as None, unless ``split_prefill_decode`` ran two passes
    (a decode chunk that reads a block written by a prefill chunk of the same step runs, and
    is timed, in the prefill pass).
    ``new_tokens`` maps scheduler sequence ids (``"<id>"``, ``"<id>#k"`` for sample k of n>1,
    ``"<id>#b<j>"`` for beams) to the token sampled for them this step.
    """
    step: int
    scheduled: list[ChunkInfo]
    num_prefill_tokens: int
    num_decode_tokens: int
    new_tokens: dict[str, int]
    finished: list[RequestOutput]
    preempted: list[tuple[str, str]]
    num_block_copies: int
    num_swapped_out_blocks: int
    num_swapped_in_blocks: int
    schedule_ms: float
    cache_ops_ms: float
    forward_ms: float
    prefill_ms: float | None
    decode_ms: float | None
    sample_ms: float
    total_ms: float
    kv_cache_usage: float
    token_usage: float
    num_waiting: int
    num_running: int
    num_swapped: int
    events: list[ev.Event] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    def to_row(self) -> dict:
        """Scalars of this step (one DataFrame row; lists become counts)."""
        row = {k: v for k, v in self.__dict__.items()
               if not isinstance(v, (list, dict))}
        row.update(num_seqs=len(self.scheduled), num_new_tokens=len(self.new_tokens),
                   num_finished=len(self.finished), num_preempted=len(self.preempted),
                   num_events=len(self.events))
        return row


def steps_to_frame(steps: Sequence[StepOutput]):
    """pandas DataFrame with one row per step (see ``StepOutput.to_row``)."""
    import pandas as pd
    return pd.DataFrame([s.to_row() for s in steps])


@dataclass
class _Seq:
    group: "_Group"
    index: int
    generator: torch.Generator | None
    cum_logprob: float = 0.0


@dataclass
class _Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    live: set[str] = field(default_factory=set)            # scheduler ids still in flight
    done: list[tuple[int, list[int], str]] = field(default_factory=list)  # (sample index, tokens, reason)
    forked: bool = False
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    beam_hyps: list[tuple[float, list[int], str]] = field(default_factory=list)
    stops: frozenset[int] = frozenset()


def _kv_bytes_per_block(cfg, block_size: int, kv_cache_dtype: str, dtype: torch.dtype) -> int:
    from paged._kernels import kernels
    try:
        return cfg.num_layers * block_size * kernels.bytes_per_token(
            kv_cache_dtype, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, block_size=block_size)
    except kernels.KernelError as e:
        raise ConfigError(f"kv_cache_dtype {kv_cache_dtype!r}: {e}") from e


class LLMEngine:
    """Step-level engine over one loaded model."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        self.config = c = config or EngineConfig()
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        mcfg = loaded.config
        p = next(self.model.parameters())
        self.device, self.dtype = p.device, p.dtype
        block_bytes = _kv_bytes_per_block(mcfg, c.block_size, c.kv_cache_dtype, self.dtype)
        num_blocks = c.num_blocks
        if num_blocks is None:
            budget = c.kv_cache_memory
            if budget is None:
                if self.device.type == "cuda":
                    free, _ = torch.cuda.mem_get_info(self.device)
                    budget = int(0.4 * free)
                else:
                    budget = 512 << 20
            num_blocks = int(budget // block_bytes)
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
        budget_tokens = c.max_num_batched_tokens
        if budget_tokens is None:
            budget_tokens = 2048 if c.enable_chunked_prefill else max(2048, max_len)
        num_cpu = c.num_cpu_blocks
        if num_cpu is None:
            num_cpu = num_blocks if c.preemption_mode == "swap" else 0
        self.recorder = ev.Recorder() if c.record_events else ev.NullRecorder()
        self.kv = KVCacheManager(num_blocks, c.block_size, enable_prefix_caching=c.enable_prefix_caching,
                                 hash_fn=c.hash_fn, num_cpu_blocks=num_cpu, max_model_len=max_len,
                                 recorder=self.recorder)
        self.scheduler = Scheduler(self.kv, SchedulerConfig(
            max_num_batched_tokens=budget_tokens, max_num_seqs=c.max_num_seqs,
            enable_chunked_prefill=c.enable_chunked_prefill, preemption_mode=c.preemption_mode,
            policy=c.policy, watermark=c.watermark))
        from paged._kernels import kernels
        try:
            self.runner = ModelRunner(self.model, self.kv, kv_cache_dtype=c.kv_cache_dtype,
                                      num_cpu_blocks=num_cpu, attention_backend=c.attention_backend,
                                      max_num_seqs=c.max_num_seqs)
        except kernels.KernelError as e:
            raise ConfigError(f"cannot set up the KV cache and attention backend: {e}") from e
        self._groups: dict[str, _Group] = {}
        self._fallback = torch.Generator().manual_seed(c.seed)
        self._ids = itertools.count(1)

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

    # ---- requests ----------------------------------------------------------------------
    def _to_ids(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer; pass prompts as lists of token ids")
            return prompt, self.tokenizer.encode(prompt)
        try:
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
        params = dataclasses.replace(params) if params is not None else SamplingParams()
        params.validate()
        params.stop_token_ids = tuple(params.stop_token_ids)
        if isinstance(request_id, str) and SEQ_ID_SEP in request_id:
            raise InvalidRequestError(
                f"request id {request_id!r} contains {SEQ_ID_SEP!r}, which the engine reserves for the "
                f"sequences it forks ('<id>{SEQ_ID_SEP}k'); pick an id without it")
        if not isinstance(priority, int):  # the priority queue compares it with others'
            raise InvalidRequestError(f"request {request_id!r}: priority must be an integer, got {priority!r}")
        if request_id in self._groups:
            raise DuplicateRequestError(f"request id {request_id!r} is already in use; pick a new id")
        text, ids = self._to_ids(prompt)
        if not ids:
            raise InvalidRequestError(f"request {request_id!r} has an empty prompt; give at least one token")
        vocab = self.loaded.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise InvalidRequestError(f"request {request_id!r}: token ids must lie in [0, {vocab})")
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.update(self.loaded.config.eos_token_ids)
            if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
                stops.add(self.tokenizer.eos_token_id)
        group = _Group(request_id, text, ids, params,
                       time.perf_counter() if arrival_time is None else arrival_time,
                       stops=frozenset(stops))
        seq = _Seq(group, 0, None if params.use_beam_search else make_generator(params.seed, 0))
        req = Request(request_id, ids, params.max_tokens,
                      stop_token_ids=() if params.use_beam_search else stops,
                      arrival_time=group.arrival_time, priority=priority, data=seq)
        self.scheduler.add_request(req)  # raises before any state changes
        group.live.add(request_id)
        self._groups[request_id] = group

    def abort(self, request_id: str) -> RequestOutput:
        """Stop a request (all its sequences) and free its blocks; returns what it produced."""
        group = self._groups.get(request_id)
        if group is None:
            raise UnknownRequestError(f"unknown request id {request_id!r} (finished, aborted or never added)")
        for sid in list(group.live):
            req = self.scheduler.abort(sid)
            self._record_done(group, req, "abort")
        self.scheduler.take_finished()
        self.runner.release_freed_blocks()
        return self._finish_group(group)

    # ---- one step ----------------------------------------------------------------------
    def step(self) -> StepOutput:
        """Run one scheduler step and return what happened."""
        t0 = time.perf_counter()
        mark = len(self.recorder)
        plan = self.scheduler.schedule()
        t1 = time.perf_counter()
        cache_ms = self.runner.apply_cache_ops(plan)
        prefill_ms = decode_ms = None
        decodes = [c for c in plan.scheduled if c.is_decode]
        prefills = [c for c in plan.scheduled if not c.is_decode]
        first, second = (self._split_passes(decodes, prefills)
                         if self.config.split_prefill_decode and decodes and prefills else ([], []))
        if first and second:
            rd, rp = self.runner.forward(first), self.runner.forward(second)
            decode_ms, prefill_ms = rd.forward_ms, rp.forward_ms
            sample_ids = rd.sample_ids + rp.sample_ids
            logits = torch.cat([rd.logits, rp.logits])
            forward_ms = decode_ms + prefill_ms
        else:
            r = self.runner.forward(plan.scheduled)
            sample_ids, logits, forward_ms = r.sample_ids, r.logits, r.forward_ms
            if not prefills:
                decode_ms, prefill_ms = forward_ms, 0.0
            elif not decodes:
                decode_ms, prefill_ms = 0.0, forward_ms
        t2 = time.perf_counter()
        sampled, post = self._sample(sample_ids, logits)
        for rid, _ in plan.preempted:
            self.scheduler.requests[rid].data.group.num_preemptions += 1
        done = self.scheduler.update(plan, sampled)
        for fn in post:
            fn()
        self.runner.release_freed_blocks()
        for req in done:
            self._record_done(req.data.group, req, _FINISH_REASON[req.status])
        self.scheduler.take_finished()
        finished = [self._finish_group(g) for g in self._completed_groups(plan)]
        t3 = time.perf_counter()
        return StepOutput(
            step=plan.step,
            scheduled=[ChunkInfo(c.request_id, c.start, c.num_tokens, not c.is_decode, c.samples)
                       for c in plan.scheduled],
            num_prefill_tokens=plan.num_prefill_tokens, num_decode_tokens=plan.num_decode_tokens,
            new_tokens=dict(sampled), finished=finished, preempted=list(plan.preempted),
            num_block_copies=len(plan.block_copies), num_swapped_out_blocks=len(plan.swap_out),
            num_swapped_in_blocks=len(plan.swap_in),
            schedule_ms=(t1 - t0) * 1e3, cache_ops_ms=cache_ms, forward_ms=forward_ms,
            prefill_ms=prefill_ms, decode_ms=decode_ms, sample_ms=(t3 - t2) * 1e3,
            total_ms=(t3 - t0) * 1e3, kv_cache_usage=plan.kv_cache_usage_perc,
            token_usage=plan.token_usage, num_waiting=plan.num_waiting, num_running=plan.num_running,
            num_swapped=plan.num_swapped, events=self.recorder.since(mark))

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

    # ---- sampling ----------------------------------------------------------------------
    def _sample(self, sample_ids: list[str], logits: torch.Tensor):
        """Tokens for every sampling chunk, plus actions to run after ``scheduler.update``."""
        sampled: dict[str, int] = {}
        post: list = []
        if not sample_ids:
            return sampled, post
        greedy = greedy_tokens(logits)  # one device->host copy for every greedy row
        beams: dict[str, list[tuple[Request, int]]] = {}
        for row, rid in enumerate(sample_ids):
            req = self.scheduler.requests[rid]
            seq: _Seq = req.data
            g, p = seq.group, seq.group.params
            if p.use_beam_search:
                beams.setdefault(g.request_id, []).append((req, row))
            elif p.n > 1 and not g.forked:
                self._first_of_n(req, logits[row], sampled, post)
            elif p.temperature == 0.0:
                sampled[rid] = greedy[row]
            else:
                sampled[rid] = sample_row(logits[row], p, seq.generator, self._fallback)
        for gid, members in beams.items():
            self._beam_step(self._groups[gid], members, logits, sampled, post)
        return sampled, post

    def _terminal(self, req: Request, token: int) -> bool:
        return token in req.stop_token_ids or req.num_output_tokens + 1 >= req.max_tokens

    def _first_of_n(self, req: Request, row: torch.Tensor, sampled: dict[str, int], post: list) -> None:
        """Draw the n first tokens from one logits row; fork a child per extra live sample."""
        g, p = req.data.group, req.data.group.params
        g.forked = True
        gens = [make_generator(p.seed, k) for k in range(p.n)]
        toks = [sample_row(row, p, gens[k], self._fallback) for k in range(p.n)]
        # decided now, before ``scheduler.update`` appends the parent's token to ``req``
        terminal = [self._terminal(req, t) for t in toks]
        # the parent keeps a non-terminal sample when there is one, so children can fork from it
        order = sorted(range(p.n), key=lambda k: terminal[k])
        parent_k = order[0]
        req.data.index, req.data.generator = parent_k, gens[parent_k]
        sampled[req.request_id] = toks[parent_k]

        def fork_children() -> None:
            for k in order[1:]:
                cid = f"{g.request_id}{SEQ_ID_SEP}{k}"
                sampled[cid] = toks[k]
                if terminal[k]:  # (a terminal parent means every sample is terminal)
                    reason = "stop" if toks[k] in req.stop_token_ids else "length"
                    g.done.append((k, [toks[k]], reason))
                    continue
                self.scheduler.fork(req.request_id, cid, last_token=toks[k], data=_Seq(g, k, gens[k]))
                g.live.add(cid)
        post.append(fork_children)

    def _beam_step(self, g: _Group, members: list[tuple[Request, int]], logits: torch.Tensor,
                   sampled: dict[str, int], post: list) -> None:
        """Expand the ready beams of one group: keep the best ``len(members)`` continuations.

        All live beams of a group normally sample in the same step (exact beam search); a beam
        lagging after preemption is expanded on its own later.
        """
        p = g.params
        width = p.n - (len(g.live) - len(members))  # beams lagging behind keep their slots
        stops = g.stops
        cands: list[tuple[float, int, int]] = []   # (score, member index, token)
        for mi, (req, row) in enumerate(members):
            lp = torch.log_softmax(logits[row].float(), -1)
            top = torch.topk(lp, min(2 * width + 1, lp.shape[0]))
            base = req.data.cum_logprob
            cands += [(base + float(v), mi, int(t)) for v, t in zip(top.values, top.indices)]
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        chosen: list[tuple[float, int, int]] = []
        for rank, (score, mi, tok) in enumerate(cands):
            if len(chosen) == width:
                break
            if tok in stops:
                if rank < width:
                    toks = members[mi][0].output_token_ids + [tok]
                    g.beam_hyps.append((score, toks, "stop"))
                continue
            chosen.append((score, mi, tok))
        if len(g.beam_hyps) >= p.n:  # early stopping: n finished hypotheses
            chosen = []
        uses: dict[int, list[tuple[float, int]]] = {}
        for score, mi, tok in chosen:
            uses.setdefault(mi, []).append((score, tok))
        for mi, (req, _) in enumerate(members):
            if mi not in uses:
                self.scheduler.abort(req.request_id)
                g.live.discard(req.request_id)
                continue
            score, tok = uses[mi][0]
            sampled[req.request_id] = tok
            req.data.cum_logprob = score

        def fork_beams() -> None:
            for mi, extra in uses.items():
                parent = members[mi][0]
                for score, tok in extra[1:]:
                    cid = f"{g.request_id}{SEQ_ID_SEP}b{next(self._ids)}"
                    if parent.status is RequestStatus.RUNNING:
                        self.scheduler.fork(parent.request_id, cid, last_token=tok,
                                            data=_Seq(g, 0, None, score))
                        g.live.add(cid)
                        sampled[cid] = tok
                    else:  # parent just ended by length: so does this sibling
                        g.beam_hyps.append((score, parent.output_token_ids[:-1] + [tok], "length"))
        post.append(fork_beams)

    # ---- completion --------------------------------------------------------------------
    def _record_done(self, g: _Group, req: Request, reason: str) -> None:
        g.live.discard(req.request_id)
        g.num_cached_tokens = max(g.num_cached_tokens, req.num_cached_tokens)
        if g.params.use_beam_search:
            # an aborted beam is a hypothesis too: abort returns the best n of finished and live
            g.beam_hyps.append((req.data.cum_logprob, req.output_token_ids, reason))
            return
        g.done.append((req.data.index, req.output_token_ids, reason))

    def _completed_groups(self, plan: SchedulerOutput) -> list[_Group]:
        out, seen = [], set()
        for c in plan.scheduled:
            g = c.request.data.group
            if id(g) in seen or g.request_id not in self._groups:
                continue
            seen.add(id(g))
            if not g.live:
                out.append(g)
        return out

    def _finish_group(self, g: _Group) -> RequestOutput:
        self._groups.pop(g.request_id, None)
        p = g.params
        if p.use_beam_search:
            def norm(h: tuple[float, list[int], str]) -> float:
                return h[0] / (max(len(h[1]), 1) ** p.length_penalty)
            hyps = sorted(g.beam_hyps, key=norm, reverse=True)[:p.n]
            outs = [CompletionOutput(i, list(t), self._text(t, p), s, r) for i, (s, t, r) in enumerate(hyps)]
        else:
            by_index = {}
            for k, toks, reason in g.done:
                by_index.setdefault(k, CompletionOutput(k, list(toks), self._text(toks, p), None, reason))
            outs = [by_index[k] for k in sorted(by_index)]
        return RequestOutput(g.request_id, g.prompt, g.prompt_token_ids, outs, finished=True,
                             num_cached_tokens=g.num_cached_tokens, num_preemptions=g.num_preemptions,
                             arrival_time=g.arrival_time, finish_time=time.perf_counter())

    def _text(self, toks: Sequence[int], params: SamplingParams) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(toks, skip_special_tokens=params.skip_special_tokens)
