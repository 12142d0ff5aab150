"""What the scheduler hands an executor each step (its plan), in one shape.

``SchedulerOutput``: the ``Batch`` to compute, the cache operations to apply first (compaction
copies, swap out, copy-on-write copies, swap in), preemptions, and the pool right after planning.

A ``Batch`` is columns, one entry per scheduled chunk in batch order (no object per chunk: a
step plans hundreds): chunk ``i`` computes ``num_tokens[i]`` tokens of ``requests[i]`` from
position ``starts[i]`` (the tokens before are cached), samples a token when ``samples[i]``, and
its K/V lives in ``tables[i]``, the request's block table as the manager planned it (vLLM's
``KVCacheBlocks`` idea: executors read the plan only). A table is handed by reference, not
copied: it is valid from ``schedule`` until the step's ``update`` and read-only for executors.
The scheduler builds the batch; executors consume it as built (the simulator reads the columns,
the runner builds its tensors from them). ``ScheduledChunk`` is a read-only view of one entry
for readers (tests, views, studies).

One meaning of "decode" (``is_decode``): a chunk that computes exactly one token, samples, and
lies past the prompt. A chunk that computes the last prompt token is prefill, even when it is
one token long.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Sequence

from .block import Block, BlockMapping
from .request import Request

__all__ = ["Batch", "PoolCounts", "ScheduledChunk", "SchedulerOutput", "is_decode"]


_prompt_len = operator.attrgetter("num_prompt_tokens")


def is_decode(request: Request, start: int, num_tokens: int, samples: bool) -> bool:
    """Whether a chunk is a decode (see the module docstring): the one definition."""
    return num_tokens == 1 and samples and start >= request.num_prompt_tokens


@dataclass(slots=True)
class ScheduledChunk:
    """A read-only view of one batch entry: `num_tokens` tokens of `request` from position
    `start`; `blocks`: the request's block table (empty when not planned by a paged manager).
    Its tokens live in slots `blocks[p // bs].block_id * bs + p % bs`. Compares by value (the
    work: request, start, tokens, sampling); unhashable."""

    request: Request
    start: int
    num_tokens: int
    samples: bool
    blocks: Sequence[Block] = field(default=(), compare=False, repr=False)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    @property
    def is_decode(self) -> bool:
        return is_decode(self.request, self.start, self.num_tokens, self.samples)


class Batch:
    """The chunks of one forward pass as columns (see the module docstring). Invariant: the five
    columns have one entry per chunk, in batch order."""

    __slots__ = ("requests", "starts", "num_tokens", "samples", "tables", "_chunk_entries")

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.starts: list[int] = []
        self.num_tokens: list[int] = []
        self.samples: list[bool] = []
        self.tables: list[Sequence[Block]] = []
        self._chunk_entries: list[int] = []  # entries added by `add` (the others are the lane's decodes)

    def add(self, request: Request, start: int, num_tokens: int, samples: bool, table: Sequence[Block]) -> None:
        self._chunk_entries.append(len(self.requests))
        self.requests.append(request)
        self.starts.append(start)
        self.num_tokens.append(num_tokens)
        self.samples.append(samples)
        self.tables.append(table)

    def add_decodes(self, requests: Sequence[Request], count: int) -> None:
        """Close a run of the decode lane: ``count`` one-token sampling chunks of ``requests`` whose
        starts and tables the KV manager appended to ``starts``/``tables`` already."""
        self.requests.extend(requests)
        self.num_tokens.extend([1] * count)
        self.samples.extend([True] * count)

    def runs(self) -> list[tuple[Sequence[Request], int]]:
        """The entries in batch order as ``(decodes, i)`` pairs: a run of the decode lane's entries
        (maybe empty; one sampling token each, of requests scheduled in an earlier step), then the entry
        ``i`` that ``add`` made (-1 after the last run). Hot loops read this instead of zipping columns."""
        reqs, out, lo = self.requests, [], 0
        for i in self._chunk_entries:
            out.append((reqs[lo:i], i))
            lo = i + 1
        out.append((reqs[lo:] if lo else reqs, -1))
        return out

    def __len__(self) -> int:
        return len(self.requests)

    def __bool__(self) -> bool:
        return bool(self.requests)

    def select(self, indices: Sequence[int]) -> "Batch":
        """The entries at ``indices``, in that order (e.g. one of the engine's two passes)."""
        out = Batch()  # every entry as a chunk (`add`): exact for any mix
        for i in indices:
            out.add(self.requests[i], self.starts[i], self.num_tokens[i], self.samples[i], self.tables[i])
        return out

    def is_decode(self, i: int) -> bool:
        return is_decode(self.requests[i], self.starts[i], self.num_tokens[i], self.samples[i])

    def chunks(self) -> list[ScheduledChunk]:
        """A view per entry (for readers; executors read the columns)."""
        return list(map(ScheduledChunk, self.requests, self.starts, self.num_tokens, self.samples, self.tables))

    @property
    def request_ids(self) -> list[str]:
        return [r.request_id for r in self.requests]

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_tokens)

    @property
    def num_decode_tokens(self) -> int:
        # every lane entry is one sampling token, a decode iff past its prompt: count "past the prompt"
        # over all entries at C speed (once per step), then correct the few entries `add` made
        count = sum(map(operator.ge, self.starts, map(_prompt_len, self.requests)))
        for i in self._chunk_entries:
            count += self.is_decode(i) - (self.starts[i] >= self.requests[i].num_prompt_tokens)
        return count

    @property
    def num_sampled(self) -> int:
        return self.samples.count(True)


@dataclass(kw_only=True)
class PoolCounts:
    """Queue lengths and the pool right after a plan was made (prefix-cache counters are
    cumulative, in tokens)."""
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


@dataclass
class SchedulerOutput(PoolCounts):
    """One step's plan: ``batch`` is what to compute (see the module docstring)."""

    step: int
    batch: Batch = field(default_factory=Batch)
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
        """A view of every batch entry, in order (built on first use; for readers)."""
        if self._chunks is None:
            self._chunks = self.batch.chunks()
        return self._chunks

    @property
    def num_seqs(self) -> int:
        return len(self.batch)

    @property
    def num_preempted(self) -> int:
        return len(self.preempted)

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
    def num_swapped_in_blocks(self) -> int:
        return len(self.swap_in)

    @property
    def num_tier_out_blocks(self) -> int:
        return len(self.tier_out)

    @property
    def num_tier_in_blocks(self) -> int:
        return len(self.tier_in)

    @property
    def num_moved_blocks(self) -> int:
        """Blocks crossing the host link this step (swaps and tier moves)."""
        return len(self.swap_out) + len(self.swap_in) + len(self.tier_out) + len(self.tier_in)

    @property
    def num_copied_blocks(self) -> int:
        """Blocks copied on the device this step (copy-on-write and compaction)."""
        return len(self.block_copies) + len(self.compaction_copies)

    @property
    def num_batched_tokens(self) -> int:
        return self.batch.num_batched_tokens

    @property
    def num_decode_tokens(self) -> int:
        return self.batch.num_decode_tokens

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_batched_tokens - self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.batch
