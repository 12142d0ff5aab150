"""User requests as groups of scheduler sequences: plain sampling, n > 1, beam search.

A user request is a *group*: one sequence for plain sampling, ``n`` for parallel sampling
(children forked from the parent after its prompt is computed, sharing its blocks), up to
``n`` live beams for beam search (copy-on-write when a forked beam writes into a shared block).

Invariants: every sequence of a group is a scheduler request whose ``data`` is its ``Seq``;
a group is finished when none of its sequences is left in the scheduler (``live`` empty).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from paged.core.request import Request, RequestStatus
from paged.core.scheduler import Scheduler, SchedulerOutput
from .outputs import CompletionOutput, RequestOutput
from .sampling import SamplingParams, greedy_tokens, logprob_dicts, make_generator, sample_row

SEQ_ID_SEP = "#"
"""Separates a request id from the suffix of its forked sequences (``"<id>#k"``, ``"<id>#b<j>"``);
user request ids may not contain it, so forked ids never collide with another request's."""

FINISH_REASON = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                 RequestStatus.FINISHED_ABORTED: "abort"}


@dataclass
class Seq:
    """One scheduler sequence of a group: its sample index, generator and beam score."""
    group: "Group"
    index: int
    generator: torch.Generator | None
    cum_logprob: float = 0.0


@dataclass
class Group:
    """One user request and the sequences serving it."""
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
    # engine-clock stamps (seconds since the engine was built) for its request record
    arrival_s: float = 0.0
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    num_token_steps: int = 0
    sample_logprobs: list[dict[int, float]] = field(default_factory=list)  # params.logprobs (n=1)
    prompt_logprobs: list[dict[int, float] | None] | None = None           # params.prompt_logprobs


class Groups:
    """The groups in flight over one scheduler: sampling, forking, finishing.

    ``detokenize(tokens, params)`` gives a completion's text. Sampling returns the tokens
    plus actions (forks) that must run after ``scheduler.update`` has appended the tokens.
    """

    def __init__(self, scheduler: Scheduler, seed: int,
                 detokenize: Callable[[Sequence[int], SamplingParams], str]) -> None:
        self.scheduler = scheduler
        self.by_id: dict[str, Group] = {}
        self._detokenize = detokenize
        self._fallback = torch.Generator().manual_seed(seed)
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self.by_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.by_id

    def get(self, request_id: str) -> Group | None:
        return self.by_id.get(request_id)

    @staticmethod
    def of(request: Request) -> Group:
        """The group a scheduler sequence serves."""
        return request.data.group

    def of_seq(self, seq_id: str) -> Group | None:
        """The group of scheduler sequence ``seq_id`` (None once it left the scheduler, e.g. a
        beam dropped while sampling)."""
        req = self.scheduler.requests.get(seq_id)
        return None if req is None else req.data.group

    def note_preempted(self, preempted: Sequence[tuple[str, str]]) -> None:
        """Count a plan's preemptions (``(sequence id, mode)`` pairs) on their groups."""
        for rid, _ in preempted:
            self.scheduler.requests[rid].data.group.num_preemptions += 1

    def stamp(self, plan: SchedulerOutput, sampled: dict[str, int], start_s: float, end_s: float) -> None:
        """Time stamps of the groups ``plan`` served (first scheduled, token steps), on the engine clock."""
        seen: set[int] = set()
        for r, samples in zip(plan.batch.requests, plan.batch.samples):
            g = r.data.group
            if g.first_scheduled_s is None:
                g.first_scheduled_s = start_s
            if samples and r.request_id in sampled and id(g) not in seen:
                seen.add(id(g))
                if g.first_token_s is None:
                    g.first_token_s = end_s
                g.last_token_s = end_s
                g.num_token_steps += 1

    def record_logprobs(self, sample_ids: list[str], logits: torch.Tensor, sampled: dict[str, int],
                        prompt_parts: list) -> None:
        """Store vLLM-style logprobs of sampled tokens and prompt tokens on their groups
        (prompt positions are overwritten, not appended, so recompute after preemption is safe)."""
        for row, rid in enumerate(sample_ids):
            g = self.of_seq(rid)  # a beam may have been dropped while sampling
            if g is not None and g.params.logprobs is not None and rid in sampled:
                g.sample_logprobs += logprob_dicts(logits[row:row + 1], [sampled[rid]], g.params.logprobs)
        for part in prompt_parts:
            for rid, (start, rows) in (part or {}).items():
                g = self.of_seq(rid)
                if g is None:
                    continue
                toks = g.prompt_token_ids[start + 1:start + 1 + rows.shape[0]]
                lps = logprob_dicts(rows[:len(toks)], toks, g.params.prompt_logprobs)
                g.prompt_logprobs[start + 1:start + 1 + len(toks)] = lps

    def add(self, group: Group, priority: int) -> None:
        """Queue ``group``'s first sequence; raises (changing nothing) if the scheduler refuses it."""
        p = group.params
        seq = Seq(group, 0, None if p.use_beam_search else make_generator(p.seed, 0))
        # prompt log-probs need every prompt position computed: a private salt skips prefix hits
        salt = f"prompt_logprobs:{group.request_id}:{id(group)}" if p.prompt_logprobs is not None else None
        req = Request(group.request_id, group.prompt_token_ids, p.max_tokens,
                      stop_token_ids=() if p.use_beam_search else group.stops,
                      arrival_time=group.arrival_time, priority=priority, data=seq, cache_salt=salt)
        if p.prompt_logprobs is not None:
            group.prompt_logprobs = [None] * len(group.prompt_token_ids)
        self.scheduler.add_request(req)  # raises before any state changes
        group.live.add(group.request_id)
        self.by_id[group.request_id] = group

    # ---- sampling ----------------------------------------------------------------------
    def sample(self, sample_ids: list[str], logits: torch.Tensor):
        """Tokens for every sampling chunk, plus actions to run after ``scheduler.update``."""
        sampled: dict[str, int] = {}
        post: list = []
        if not sample_ids:
            return sampled, post
        greedy = greedy_tokens(logits)  # one device->host copy for every greedy row
        beams: dict[str, list[tuple[Request, int]]] = {}
        for row, rid in enumerate(sample_ids):
            req = self.scheduler.requests[rid]
            seq: Seq = req.data
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
            self._beam_step(self.by_id[gid], members, logits, sampled, post)
        return sampled, post

    def _first_of_n(self, req: Request, row: torch.Tensor, sampled: dict[str, int], post: list) -> None:
        """Draw the n first tokens from one logits row; fork a child per extra live sample."""
        g, p = req.data.group, req.data.group.params
        g.forked = True
        gens = [make_generator(p.seed, k) for k in range(p.n)]
        toks = [sample_row(row, p, gens[k], self._fallback) for k in range(p.n)]
        # whether each ends its sequence (a stop token or the length), decided now, before
        # ``scheduler.update`` appends the parent's token to ``req``
        terminal = [t in req.stop_token_ids or req.num_output_tokens + 1 >= req.max_tokens for t in toks]
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
                    g.done.append((k, [toks[k]], "stop" if toks[k] in req.stop_token_ids else "length"))
                    continue
                self.scheduler.fork(req.request_id, cid, last_token=toks[k], data=Seq(g, k, gens[k]))
                g.live.add(cid)
        post.append(fork_children)

    def _beam_step(self, g: Group, members: list[tuple[Request, int]], logits: torch.Tensor,
                   sampled: dict[str, int], post: list) -> None:
        """Expand the ready beams of one group: keep the best ``len(members)`` continuations.

        All live beams of a group normally sample in the same step (exact beam search); a beam
        lagging after preemption is expanded on its own later.
        """
        p = g.params
        width = p.n - (len(g.live) - len(members))  # beams lagging behind keep their slots
        cands: list[tuple[float, int, int]] = []   # (score, member index, token)
        for mi, (req, row) in enumerate(members):
            lp = torch.log_softmax(logits[row].float(), -1)
            top = torch.topk(lp, min(2 * width + 1, lp.shape[0]))
            cands += [(req.data.cum_logprob + float(v), mi, int(t)) for v, t in zip(top.values, top.indices)]
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        chosen: list[tuple[float, int, int]] = []
        for rank, (score, mi, tok) in enumerate(cands):
            if len(chosen) == width:
                break
            if tok in g.stops:
                if rank < width:
                    g.beam_hyps.append((score, members[mi][0].output_token_ids + [tok], "stop"))
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
                                            data=Seq(g, 0, None, score))
                        g.live.add(cid)
                        sampled[cid] = tok
                    else:  # parent just ended by length: so does this sibling
                        g.beam_hyps.append((score, parent.output_token_ids[:-1] + [tok], "length"))
        post.append(fork_beams)

    # ---- completion --------------------------------------------------------------------
    def record_done(self, g: Group, req: Request, reason: str) -> None:
        """Note that sequence ``req`` of ``g`` left the scheduler for ``reason``."""
        g.live.discard(req.request_id)
        g.num_cached_tokens = max(g.num_cached_tokens, req.num_cached_tokens)
        if g.params.use_beam_search:
            # an aborted beam is a hypothesis too: abort returns the best n of finished and live
            g.beam_hyps.append((req.data.cum_logprob, req.output_token_ids, reason))
            return
        g.done.append((req.data.index, req.output_token_ids, reason))

    def completed(self, plan: SchedulerOutput) -> list[Group]:
        """Groups touched by ``plan`` with no sequence left in flight."""
        touched = {id(g): g for r in plan.batch.requests if (g := r.data.group).request_id in self.by_id}
        return [g for g in touched.values() if not g.live]

    def finish(self, g: Group) -> RequestOutput:
        """Forget ``g`` and build its output (beam search: the best ``n`` hypotheses)."""
        self.by_id.pop(g.request_id, None)
        p = g.params
        if p.use_beam_search:
            hyps = sorted(g.beam_hyps, key=lambda h: h[0] / (max(len(h[1]), 1) ** p.length_penalty),
                          reverse=True)[:p.n]  # by length-normalized score
            outs = [CompletionOutput(i, list(t), self._detokenize(t, p), s, r)
                    for i, (s, t, r) in enumerate(hyps)]
        else:
            by_index = {}
            for k, toks, reason in g.done:
                by_index.setdefault(k, CompletionOutput(k, list(toks), self._detokenize(toks, p), None, reason))
            outs = [by_index[k] for k in sorted(by_index)]
            if p.logprobs is not None and outs:
                outs[0].logprobs = g.sample_logprobs[:len(outs[0].token_ids)]
        return RequestOutput(g.request_id, g.prompt, g.prompt_token_ids, outs, finished=True,
                             num_cached_tokens=g.num_cached_tokens, num_preemptions=g.num_preemptions,
                             arrival_time=g.arrival_time, finish_time=time.perf_counter(),
                             prompt_logprobs=g.prompt_logprobs)
