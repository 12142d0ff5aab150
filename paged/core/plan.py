"""What the scheduler hands an executor each step (its plan).

``SchedulerOutput``: the chunks to compute, the cache operations to apply first (compaction
copies, swap out, copy-on-write copies, swap in), preemptions, and the pool right after planning.
``SchedulerConfig`` (the scheduler's settings) lives in ``paged.core.config``; this old import
path keeps working.

Block ids travel in the plan (vLLM's ``KVCacheBlocks`` idea): each chunk carries its request's
block table as the manager planned it (``ScheduledChunk.blocks``, ``DecodeRun.tables``), so an
executor reads the plan only. A table is handed by reference, not copied (a step plans hundreds of
them): it is valid from ``schedule`` until the step's ``update`` and read-only for executors.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Sequence

from .block import Block, BlockMapping
from .config import DEFAULT_TOKEN_BUDGET, SchedulerConfig
from .request import Request

__all__ = ["DEFAULT_TOKEN_BUDGET", "DecodeRun", "PoolCounts", "SchedulerConfig", "ScheduledChunk", "StepCounts",
           "SchedulerOutput"]


class ScheduledChunk:
    """`num_tokens` tokens of `request` starting at position `start` (tokens before are cached);
    `blocks`: the request's block table (see the module docstring; empty when not planned by a
    paged manager). Its tokens live in slots `blocks[p // bs].block_id * bs + p % bs`.

    A plain ``__slots__`` class, not a dataclass: one is built per scheduled request per step, and
    the generated dataclass ``__init__`` cost ~325 ns against ~205 ns for this one (CPython 3.11).
    Compares by value (the work: request, start, tokens, sampling), like the dataclass it replaces.
    """

    __slots__ = ("request", "start", "num_tokens", "samples", "blocks")

    def __init__(self, request: Request, start: int, num_tokens: int, samples: bool,
                 blocks: Sequence[Block] = ()) -> None:
        self.request = request
        self.start = start
        self.num_tokens = num_tokens
        self.samples = samples  # the chunk reaches the end of the known tokens: sample one
        self.blocks = blocks

    @property
    def block_ids(self) -> list[int]:
        """The request's block table as ids, in order."""
        return [b.block_id for b in self.blocks]

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not ScheduledChunk:
            return NotImplemented
        return (self.request, self.start, self.num_tokens, self.samples) == \
            (other.request, other.start, other.num_tokens, other.samples)

    __hash__ = None  # mutable and compared by value

    def __repr__(self) -> str:
        return (f"ScheduledChunk(request={self.request!r}, start={self.start}, num_tokens={self.num_tokens}, "
                f"samples={self.samples})")

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1 and self.samples and self.start >= self.request.num_prompt_tokens


class DecodeRun:
    """Consecutive running requests that each compute their one last token, as the scheduler's
    decode lane planned them: the chunks ``ScheduledChunk(r, start, 1, True, table)`` for ``r,
    start, table`` in ``zip(requests, starts, tables)``, held as lists instead of one object per
    request (a step plans hundreds of them; executors that read plans in bulk, such as the
    simulator, iterate the lists). ``starts`` are the positions at planning time (``update``
    moves the requests on afterwards); ``tables`` the requests' block tables (module docstring).
    """

    __slots__ = ("requests", "starts", "tables")

    def __init__(self, requests: list[Request], starts: list[int],
                 tables: list[Sequence[Block]] | None = None) -> None:
        self.requests = requests
        self.starts = starts
        self.tables = tables if tables is not None else [()] * len(requests)

    def __len__(self) -> int:
        return len(self.requests)

    def chunks(self) -> list[ScheduledChunk]:
        return [ScheduledChunk(r, s, 1, True, t) for r, s, t in zip(self.requests, self.starts, self.tables)]

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not DecodeRun:
            return NotImplemented
        return self.requests == other.requests and self.starts == other.starts

    __hash__ = None

    def __repr__(self) -> str:
        return f"DecodeRun({len(self.requests)} requests: {[r.request_id for r in self.requests[:4]]}...)"


class StepCounts:
    """Counts a step record derives from its lists (``scheduled`` chunks, ``preempted`` ids);
    shared by the plan and the engine's ``StepOutput``."""

    __slots__ = ()
    scheduled: list
    preempted: list

    @property
    def num_seqs(self) -> int:
        return len(self.scheduled)

    @property
    def num_preempted(self) -> int:
        return len(self.preempted)


@dataclass(kw_only=True)
class PoolCounts:
    """Queue lengths and the pool right after a plan was made (prefix-cache counters are
    cumulative, in tokens); shared by the plan and the engine's ``StepOutput``."""
    num_waiting: int = 0
    num_running: int = 0
    num_swapped: int = 0
    kv_cache_usage_perc: float = 0.0
    token_usage: float = 0.0
    num_used_blocks: int = 0
    num_free_blocks: int = 0
    num_cached_free_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_host_cached_blocks: int = 0   # host tier (paged.core.host_tier): blocks it holds
    host_cache_hits: int = 0          # cumulative tokens of prefix_cache_hits served from the host tier

    def pool_counts(self) -> dict[str, int | float]:
        return {f.name: getattr(self, f.name) for f in fields(PoolCounts)}


@dataclass
class SchedulerOutput(StepCounts, PoolCounts):
    """One step's plan. ``work`` is what to compute, in batch order: ``ScheduledChunk``s and
    ``DecodeRun``s (the decode lane's runs); ``scheduled`` is the same as one list of chunks,
    built on first use (then kept: a plan is not changed once ``schedule`` returned it)."""

    step: int
    work: list[ScheduledChunk | DecodeRun] = field(default_factory=list)
    block_copies: BlockMapping = field(default_factory=list)
    # block compaction, applied FIRST (before swap_out): every other id of the plan is post-compaction
    compaction_copies: BlockMapping = field(default_factory=list)
    swap_out: BlockMapping = field(default_factory=list)   # (gpu block, cpu block)
    swap_in: BlockMapping = field(default_factory=list)    # (cpu block, gpu block)
    # host tier: tier_out (gpu, cpu) is applied before swap_out (nothing may overwrite a demoted
    # GPU block first), tier_in (cpu, gpu) after swap_in, before the forward pass
    tier_out: BlockMapping = field(default_factory=list)
    tier_in: BlockMapping = field(default_factory=list)
    num_host_evicted_blocks: int = 0  # host-tier entries dropped for room while planning
    preempted: list[tuple[str, str]] = field(default_factory=list)  # (request id, "recompute"|"swap")
    # GPU blocks freed (and still free) since the previous plan: aborts between steps, then this
    # plan's preemptions and swaps; a runner drops per-block state for them before the forward pass
    freed_blocks: list[int] = field(default_factory=list)
    # filled by `update`: blocks the step's finished (or mid-step aborted) sequences freed
    finished_freed_blocks: list[int] = field(default_factory=list)

    _chunks: list[ScheduledChunk] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def scheduled(self) -> list[ScheduledChunk]:
        """Every chunk of ``work`` in order (decode runs unrolled)."""
        if self._chunks is None:
            out: list[ScheduledChunk] = []
            for w in self.work:
                if w.__class__ is DecodeRun:
                    out.extend(w.chunks())
                else:
                    out.append(w)
            self._chunks = out
        return self._chunks

    @property
    def num_seqs(self) -> int:
        return sum(len(w.requests) if w.__class__ is DecodeRun else 1 for w in self.work)

    @property
    def num_block_copies(self) -> int:
        return len(self.block_copies)

    @property
    def num_compaction_copies(self) -> int:
        return len(self.compaction_copies)

    @property
    def num_swapped_out_blocks(self) -> int:
        return len(self.swap_out)

    @property
    def num_tier_out_blocks(self) -> int:
        return len(self.tier_out)

    @property
    def num_tier_in_blocks(self) -> int:
        return len(self.tier_in)

    @property
    def num_swapped_in_blocks(self) -> int:
        return len(self.swap_in)

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(w.requests) if w.__class__ is DecodeRun else w.num_tokens for w in self.work)

    @property
    def num_decode_tokens(self) -> int:
        n = 0
        for w in self.work:
            if w.__class__ is DecodeRun:  # a lane chunk is a decode unless it ends a prompt
                n += sum(s >= r.num_prompt_tokens for r, s in zip(w.requests, w.starts))
            elif w.is_decode:
                n += 1
        return n

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_batched_tokens - self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.work
