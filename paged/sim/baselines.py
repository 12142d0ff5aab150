"""Contiguous KV allocation, the baselines that paging replaced (vLLM paper, section 2.3 and 6).

``ContiguousKVCacheManager`` implements the KV-cache protocol (``paged.core.kv_cache.KVCache``) for
the same ``Scheduler`` as the paged manager: at a
request's first allocation it reserves one *contiguous* run of token slots (first fit over a
linear address space of ``capacity_tokens`` slots) and never grows it. The reservation is

- ``max``: ``max_model_len`` slots (FasterTransformer / Orca-Max),
- ``pow2``: prompt + the output length rounded up to a power of two, i.e. over-reserving the
  output by at most 2x (Orca-Pow2: "if the true output length is 25, it reserves 32"),
- ``oracle``: prompt + the true output length (Orca-Oracle, knows ``max_tokens`` = output).

Because slots are contiguous, a request can wait although enough slots are free in total
(external fragmentation), as in the paper's Fig. 2. Accounting is per token, so the manager's
``block_size`` is 1 and ``num_blocks`` is the capacity in tokens; ``token_usage`` is slots holding
tokens / reserved slots. No prefix sharing, fork, swap, decode lane or host tier, each said
through the protocol: reservations cannot be shared or moved (``swap_out`` answers None, so the
scheduler recomputes; with full reservations preemption never happens, since a reserved request
always has room); ``append_decode_slots`` handles no request (each takes ``allocate_slots``).

Invariants: holes and reservations tile ``[0, capacity)`` exactly; holes are sorted, disjoint
and never adjacent (merged on free).
"""

from __future__ import annotations

import bisect
from typing import Sequence

import numpy as np

from paged.core import events as ev
from paged.core.block import Block, BlockMapping
from paged.core.kv_parts import check_request_fits
from paged.core.request import Request
from paged.core.snapshot import ContiguousSnapshot
from paged.errors import BlockStateError, ConfigError, InvalidRequestError, UnknownRequestError

RESERVATIONS = ("max", "pow2", "oracle")


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


class ContiguousKVCacheManager:
    """Contiguous per-request reservations over ``capacity_tokens`` slots (see module doc)."""

    block_size = 1              # one "block" = one token slot
    enable_prefix_caching = False
    prefix_cache_queries = 0    # no prefix sharing: never queried, never hit
    prefix_cache_hits = 0
    host_cache_hits = 0
    has_host_tier = False       # nothing is cached, so nothing is demoted
    num_host_cached_blocks = 0
    num_cached_free_blocks = 0
    num_cpu_blocks = 0
    num_swapped_out_blocks = 0  # never swaps
    num_swapped_in_blocks = 0

    def __init__(self, capacity_tokens: int, reservation: str = "max", *, max_model_len: int,
                 recorder: ev.Recorder | None = None) -> None:
        if reservation not in RESERVATIONS:
            raise ConfigError(f"reservation must be one of {RESERVATIONS}, got {reservation!r}")
        if not isinstance(capacity_tokens, int) or capacity_tokens < 1:
            raise ConfigError(f"capacity_tokens must be a positive integer, got {capacity_tokens!r}")
        if not isinstance(max_model_len, int) or max_model_len < 1:
            raise ConfigError(f"max_model_len must be a positive integer, got {max_model_len!r}")
        self.num_blocks = capacity_tokens
        self.max_model_len = max_model_len
        self.recorder = recorder if recorder is not None else ev.NullRecorder()
        self.reservation = reservation
        self._holes_start: list[int] = [0]
        self._holes_len: list[int] = [capacity_tokens]
        self._res: dict[str, tuple[int, int]] = {}   # rid -> (start, length)
        self._filled: dict[str, int] = {}             # rid -> slots holding tokens
        self._num_reserved = 0
        self._num_filled = 0

    # ---- reservation size -----------------------------------------------------------
    def reservation_for(self, request: Request) -> int:
        p, o = request.num_prompt_tokens, request.max_tokens
        if self.reservation == "max":
            return self.max_model_len
        if self.reservation == "pow2":
            return min(self.max_model_len, p + next_pow2(o))
        return p + o

    # ---- queries used by the scheduler ---------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self._num_reserved

    @property
    def num_used_blocks(self) -> int:
        return self._num_reserved

    @property
    def kv_cache_usage_perc(self) -> float:
        return self._num_reserved / self.num_blocks

    @property
    def token_usage(self) -> float:
        return self._num_filled / self._num_reserved if self._num_reserved else 0.0

    @property
    def largest_hole(self) -> int:
        return max(self._holes_len, default=0)

    def check_request(self, request: Request) -> None:
        check_request_fits(request, self.max_model_len, 1, self.num_blocks)
        r = self.reservation_for(request)
        if r > self.num_blocks:
            raise InvalidRequestError(f"request {request.request_id!r} reserves {r} slots but the cache holds "
                                      f"{self.num_blocks}; give the cache more memory or lower max_model_len")

    def has(self, request_id: str) -> bool:
        return request_id in self._res

    def block_table(self, request_id: str) -> list[int]:
        start, length = self._reservation(request_id)
        return list(range(start, start + length))

    def blocks_of(self, request_id: str) -> Sequence[Block]:
        """No paged table to put in a plan: a reservation is one run of slots (``block_table``)."""
        self._reservation(request_id)
        return ()

    def num_blocks_of(self, request_id: str) -> int:
        return self._reservation(request_id)[1]

    def request_ids(self) -> list[str]:
        return list(self._res)

    def is_swapped(self, request_id: str) -> bool:
        return False

    def num_swapped_blocks(self, request_id: str) -> int:
        raise UnknownRequestError(f"request {request_id!r} is not swapped out (contiguous caches never swap)")

    def blocks_needed(self, request: Request, num_new_tokens: int, num_cached_blocks: int = 0) -> int:
        return 0 if request.request_id in self._res else self.reservation_for(request)

    def can_allocate(self, request: Request, num_new_tokens: int, cached_blocks: Sequence[Block] = (),
                     *, keep_free: int = 0) -> bool:
        # counts free slots only: a reservation may still not fit in one hole (allocate_slots says)
        return self.num_free_blocks - self.blocks_needed(request, num_new_tokens) >= keep_free

    def can_swap_in(self, request: Request, num_new_tokens: int, *, keep_free: int = 0) -> bool:
        return False  # never swapped out

    def take_freed_blocks(self) -> list[int]:
        return []  # no per-block state to release

    def append_decode_slots(self, requests: Sequence[Request], i: int, stop: int, starts: list[int],
                            tables: list[Sequence[Block]], last_only: bool = True) -> int:
        return i  # no decode lane: every request takes allocate_slots

    def demote_above_threshold(self) -> int:
        return 0

    def take_tier_ops(self) -> tuple[BlockMapping, BlockMapping, int]:
        return [], [], 0

    # block compaction: every reservation is one contiguous range already, nothing to move
    def block_fragmentation(self, order=None) -> float:
        return 0.0

    def compact(self, order=None, *, drop_cached: bool = False, max_copies: int | None = None,
                max_rounds: int = 4) -> BlockMapping:
        return []

    def find_cached_prefix(self, request: Request) -> list[Block]:
        return []

    # ---- allocation ------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached_blocks: Sequence[Block] = ()) -> BlockMapping | None:
        rid = request.request_id
        if cached_blocks:
            raise BlockStateError("contiguous reservations cannot share cached blocks")
        end = request.num_computed_tokens + num_new_tokens
        if end > request.num_tokens:
            raise InvalidRequestError(f"request {rid!r} has {request.num_tokens} tokens; cannot compute up to {end}")
        res = self._res.get(rid)
        if res is None:
            need = self.reservation_for(request)
            i = next((k for k, n in enumerate(self._holes_len) if n >= need), -1)  # first fit
            if i < 0:
                return None
            start = self._holes_start[i]
            if self._holes_len[i] == need:
                del self._holes_start[i], self._holes_len[i]
            else:
                self._holes_start[i] += need
                self._holes_len[i] -= need
            self._res[rid] = res = (start, need)
            self._filled[rid] = 0
            self._num_reserved += need
            self.recorder.emit(ev.ALLOCATE, rid, start, need)
            request.num_cached_tokens = max(request.num_cached_tokens, 0)
        if end > res[1]:
            return None  # outgrew its reservation (cannot happen for max/pow2/oracle)
        filled = self._filled[rid]
        if end > filled:
            self._num_filled += end - filled
            self._filled[rid] = end
        return []

    def free(self, request_id: str) -> None:
        start, length = self._reservation(request_id)
        del self._res[request_id]
        self._num_filled -= self._filled.pop(request_id)
        self._num_reserved -= length
        hs, hl = self._holes_start, self._holes_len
        i = bisect.bisect_left(hs, start)
        # merge with the previous and/or next hole
        if i > 0 and hs[i - 1] + hl[i - 1] == start:
            i -= 1
            hl[i] += length
        else:
            hs.insert(i, start)
            hl.insert(i, length)
        if i + 1 < len(hs) and hs[i] + hl[i] == hs[i + 1]:
            hl[i] += hl[i + 1]
            del hs[i + 1], hl[i + 1]
        self.recorder.emit(ev.FREE, request_id, start, length)

    def release_if_held(self, request_id: str) -> None:
        if request_id in self._res:
            self.free(request_id)

    def fork(self, parent_id: str, child_id: str) -> None:
        raise ConfigError("contiguous reservations cannot be shared; fork needs the paged allocator")

    def swap_out(self, request_id: str) -> BlockMapping | None:
        return None

    def swap_in(self, request_id: str) -> BlockMapping | None:
        raise UnknownRequestError(f"request {request_id!r} is not swapped out (contiguous caches never swap)")

    def reset_prefix_cache(self) -> int:
        return 0

    def snapshot(self, requests=None, *, step: int | None = None, **kw) -> ContiguousSnapshot:
        """Reserved vs filled slots per request (``requests`` and other view options are ignored)."""
        ids = list(self._res)
        start = np.fromiter((self._res[r][0] for r in ids), np.int64, len(ids))
        res = np.fromiter((self._res[r][1] for r in ids), np.int64, len(ids))
        fil = np.fromiter((self._filled[r] for r in ids), np.int64, len(ids))
        return ContiguousSnapshot(self.recorder.step if step is None else step, self.num_blocks, ids, start, res, fil)

    def _reservation(self, request_id: str) -> tuple[int, int]:
        try:
            return self._res[request_id]
        except KeyError:
            raise UnknownRequestError(f"request {request_id!r} holds no reservation") from None

    def check_invariants(self) -> None:
        spans = sorted([(s, n) for s, n in zip(self._holes_start, self._holes_len)] + list(self._res.values()))
        pos = 0
        for s, n in spans:
            assert s == pos and n > 0, (s, pos, n)
            pos += n
        assert pos == self.num_blocks
        assert all(a + n < b for a, n, b in zip(self._holes_start, self._holes_len, self._holes_start[1:]))
        assert self._num_reserved == sum(n for _, n in self._res.values())
        assert self._num_filled == sum(self._filled.values())


__all__ = ["ContiguousKVCacheManager", "RESERVATIONS", "next_pow2"]
