"""KVCacheManager: the one owner of block tables and ref counts.

The scheduler asks; the manager answers with a plan or `None` ("cannot, preempt
something") and never half-applies an operation:
- `find_cached_prefix(request)` -> verified cached blocks for the prompt's leading full
  blocks (never all of it: at least one token is computed);
- `allocate_slots(request, n, cached)` -> the (src, dst) block copies the runner must
  apply (copy-on-write of a shared partial block), or None if the pool is too small now;
  `append_decode_slots` does the same for a run of decodes (the scheduler's decode lane);
- `blocks_of(request_id)` -> the request's table, which the scheduler puts in its plan;
- `free`, `fork`, `swap_out`, `swap_in`, `compact`.

Slots: token at position p of a request lives in slot `table[p // bs] * bs + p % bs`.
Blocks of a finished request are freed tail-first, so under LRU a prefix outlives its
suffix. Swapping copies a request's blocks to a CPU pool of its own capacity.

The manager changes tables itself and everything else through its parts (``KVCacheParts``, see
``paged.core.kv_parts``: pool, prefix index, CPU pool, host tier); ``take_tier_ops`` hands the host
tier's planned copies to the plan's ``tier_out``/``tier_in``.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Any, Sequence

from . import events as ev
from .block import Block, BlockMapping
from .compaction import CompactionPlan, compact_pool, fragmentation
from paged.errors import BlockStateError, DuplicateRequestError, InvalidRequestError, UnknownRequestError
from .host_tier import HostBlock
from .kv_parts import KVCacheParts
from .request import Request
__all__ = ["BlockMapping", "KVCacheManager"]


class KVCacheManager(KVCacheParts):
    """The block tables (request id -> its ``Block``s in order) and every change to them; the
    parts and their counts are ``KVCacheParts``."""

    def __init__(self, num_blocks: int, block_size: int = 16, **settings: Any) -> None:
        """``settings``: see ``KVCacheParts`` (prefix caching, hash function, eviction policy,
        CPU pool, max_model_len, recorder, host tier)."""
        super().__init__(num_blocks, block_size, **settings)
        self._timed = not isinstance(self.recorder, ev.NullRecorder)  # allocation latency events
        self._tables: dict[str, list[Block]] = {}
        # counters (tokens for the prefix cache, as vLLM counts them)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.host_cache_hits = 0     # prefix_cache_hits (tokens) served from the host tier
        self.num_cow_copies = 0
        self.num_swapped_out_blocks = self.num_swapped_in_blocks = 0
        self.num_compactions = self.num_compaction_copies = 0
        self.last_compaction: CompactionPlan | None = None  # of the last compact()

    # ---- queries -----------------------------------------------------------------
    @property
    def times_allocations(self) -> bool:
        """Whether ``allocate_slots`` emits allocation-latency events (then the decode lane leaves
        a token that opens a new block to it)."""
        return self._timed

    def has(self, request_id: str) -> bool:
        return request_id in self._tables

    def request_ids(self) -> list[str]:
        """Requests holding GPU blocks, in the order they got them."""
        return list(self._tables)

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids, in table order (a copy)."""
        return [b.block_id for b in self._table(request_id)]

    def blocks_of(self, request_id: str) -> Sequence[Block]:
        """The request's table itself, not a copy (what the scheduler puts in its plan): read-only
        for everyone else, valid until the manager next changes it (the step's ``update``)."""
        return self._table(request_id)

    def num_blocks_to_allocate(self, request: Request, num_new_tokens: int,
                               cached_blocks: Sequence[Block] = ()) -> int:
        """Free blocks `allocate_slots(request, num_new_tokens, cached_blocks)` takes: new blocks
        (including a copy-on-write copy) plus cached-free blocks the prefix hit revives."""
        table, num_cached = self._tables.get(request.request_id, ()), len(cached_blocks)
        start = request.num_computed_tokens + num_cached * self.block_size
        need = max(0, -(-(start + num_new_tokens) // self.block_size) - len(table) - num_cached)
        if num_new_tokens and start % self.block_size and table and table[start // self.block_size].ref_cnt > 1:
            need += 1
        return need + sum(1 for b in cached_blocks if b.ref_cnt == 0)

    def can_allocate(self, request: Request, num_new_tokens: int, cached_blocks: Sequence[Block] = (),
                     *, keep_free: int = 0) -> bool:
        """Whether `allocate_slots` fits now and leaves at least `keep_free` blocks free (the
        scheduler's admission watermark)."""
        return self.pool.num_free - self.num_blocks_to_allocate(request, num_new_tokens, cached_blocks) >= keep_free

    def can_swap_in(self, request: Request, num_new_tokens: int, *, keep_free: int = 0) -> bool:
        """Whether `swap_in(request)` followed by `allocate_slots(request, num_new_tokens)` fits
        now and leaves at least `keep_free` blocks free."""
        blocks = self.num_swapped_blocks(request.request_id)
        end = request.num_computed_tokens + num_new_tokens
        return self.pool.num_free - max(blocks, -(-end // self.block_size)) >= keep_free

    # ---- prefix cache --------------------------------------------------------------
    def find_cached_prefix(self, request: Request) -> list[Block]:
        """Verified cached blocks for a request not yet holding blocks (no state change); with a
        host tier some are ``HostBlock`` entries, which ``allocate_slots`` brings back."""
        if not self.enable_prefix_caching or request.request_id in self._tables:
            return []
        return self.prefix.find(request)

    def uncache_written(self, request_id: str, start: int, num_tokens: int) -> int:
        """Drop the prefix-cache entries of the request's blocks holding tokens [start, start +
        num_tokens): a failed step never wrote their K/V. Returns how many were dropped."""
        bs = self.block_size
        table = self._tables.get(request_id, [])[start // bs:-(-(start + num_tokens) // bs)]
        return self.uncache_blocks(b.block_id for b in table)

    # ---- allocation ----------------------------------------------------------------
    def append_decode_slots(self, requests: Sequence[Request], i: int, stop: int, starts: list[int],
                            tables: list[Sequence[Block]], last_only: bool = True) -> int:
        """The scheduler's decode lane: for ``requests[i:stop]`` in order, while a request computes
        exactly its one last token, into a partly filled block it alone holds or into a new block
        the pool has free, do what ``allocate_slots(request, 1)`` does there (take the block,
        record the fill, index the block it completes; it returns ``[]`` for each of them), append
        the token's position to ``starts`` and the request's table to ``tables`` and go on.
        Returns the index of the first request not handled (``stop`` when all were): that one
        needs the general path (copy-on-write, more tokens, a full pool: preemption). The
        allocation-latency event of ``allocate_slots`` is not emitted here.

        The one place that appends a token into a block the request owns: ``allocate_slots``
        calls it for one token into a partly filled block (``last_only=False``: the token need
        not be the request's last; a new block is left to its general path)."""
        bs, pool, caching = self.block_size, self.pool, self.enable_prefix_caching
        index = self.prefix.index_full
        first = len(starts)
        written: list[Block] = []  # the block of each token, filled through the pool once at the end
        get, mark, keep, write = self._tables.get, starts.append, tables.append, written.append
        run = requests if i == 0 and stop == len(requests) else requests[i:stop]  # no copy in the usual case
        for req in run:  # the common case (room in the last block) first, in few bytecodes
            start = req.num_computed_tokens
            if len(req.token_ids) - start != 1 and (last_only or start >= len(req.token_ids)):
                break
            table = get(req.request_id)
            if not table:
                break
            offset = start % bs
            if offset:
                block = table[start // bs]
                if block.ref_cnt != 1 or block.num_filled != offset:
                    break  # shared (copy-on-write), or not filled up to the token: the general path
                write(block)
                if offset + 1 == bs and caching:
                    index(req, table, start + 1)
            else:  # the token opens a new block: take one if the pool has it
                if len(table) != start // bs or pool.num_used >= pool.num_blocks or self._timed:
                    break  # general path: the table has the block, a full pool, or latency events
                block = pool.allocate(1, req.request_id)[0]
                table.append(block)
                write(block)  # a new block holds nothing
                if bs == 1 and caching:  # one slot: the new block is also full (earlier ones are indexed)
                    index(req, table, start + 1)
            mark(start)
            keep(table)
        if written:
            pool.fill_next(written)
        return i + len(starts) - first

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached_blocks: Sequence[Block] = ()) -> BlockMapping | None:
        """Make room for tokens [computed + cached, + num_new_tokens) of `request` (one token into a
        partly filled block it owns alone goes through ``append_decode_slots``: no latency event).

        `cached_blocks` (from `find_cached_prefix`, only for a request holding no blocks)
        are taken as computed. Returns the (src, dst) copies to apply before the forward
        pass, or None when the pool cannot hold them now (nothing changed).
        """
        if num_new_tokens == 1 and not cached_blocks and request.num_computed_tokens % self.block_size \
                and KVCacheManager.append_decode_slots(self, (request,), 0, 1, [], [], False):  # partly filled block
            return []
        rid = request.request_id
        t0 = time.perf_counter_ns() if self._timed else 0
        if num_new_tokens < 0:
            raise InvalidRequestError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if self.swap_space.holds(rid):
            raise BlockStateError(f"request {rid!r} is swapped out; swap it in before allocating")
        table = self._tables.get(rid)
        if cached_blocks and table:
            raise BlockStateError(f"request {rid!r} already holds blocks; cached blocks only apply at admission")
        bs = self.block_size
        start = request.num_computed_tokens + len(cached_blocks) * bs
        end = start + num_new_tokens
        if end > request.num_tokens:
            raise InvalidRequestError(
                f"request {rid!r} has {request.num_tokens} tokens; cannot compute up to {end}")
        if self.num_blocks_to_allocate(request, num_new_tokens, cached_blocks) > self.pool.num_free:
            return None
        # ---- commit (nothing below can fail) ----
        pool = self.pool
        if table is None:
            table = self._tables[rid] = []
            self.prefix.set_offered(rid)
        num_host = 0
        if cached_blocks and self.host is not None:
            table.extend(self.host.bring_back(pool, cached_blocks, rid, bs))
            num_host = sum(isinstance(b, HostBlock) for b in cached_blocks)
        elif cached_blocks:
            emit = self.recorder.emit if ev.PREFIX_HIT in self.recorder.hears else None
            for b in cached_blocks:
                pool.touch(b, rid)
                if emit is not None:
                    emit(ev.PREFIX_HIT, rid, b.block_id, bs)
            table.extend(cached_blocks)
        if cached_blocks:
            self.prefix.set_offered(rid, table)
        if request.num_cached_tokens < 0:  # first admission: count the query once
            request.num_cached_tokens = len(cached_blocks) * bs
            if self.enable_prefix_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += len(cached_blocks) * bs
                self.host_cache_hits += num_host * bs
        copies: BlockMapping = []
        if num_new_tokens and start % bs:
            idx = start // bs
            src = table[idx]
            if src.ref_cnt > 1:  # shared partial block: copy before writing
                dst = pool.allocate(1, rid)[0]
                pool.fill(dst, src.num_filled)
                pool.free(src, rid)
                table[idx] = dst
                copies.append((src.block_id, dst.block_id))
                self.num_cow_copies += 1
                self.recorder.emit(ev.COW, rid, dst.block_id, src.block_id)
        missing = -(-end // bs) - len(table)
        if missing > 0:
            table.extend(pool.allocate(missing, rid))
        pool.fill_span(table, start // bs, end, bs)
        if self.enable_prefix_caching:
            self.prefix.index_full(request, table, end)
        if self._timed:
            self.recorder.emit(ev.ALLOC_LATENCY, rid, None, time.perf_counter_ns() - t0)
        return copies

    # ---- release -------------------------------------------------------------------
    def free(self, request_id: str) -> None:
        """Release every block (tail first) or swapped CPU block of a request."""
        if self.swap_space.holds(request_id):
            self.swap_space.release(request_id)
        elif request_id in self._tables:
            self.pool.free_blocks(reversed(self._tables.pop(request_id)), request_id)
        else:
            raise UnknownRequestError(f"request {request_id!r} holds no blocks (already freed or never allocated)")
        self.prefix.forget(request_id)

    def release_if_held(self, request_id: str) -> None:
        if request_id in self._tables or self.swap_space.holds(request_id):
            self.free(request_id)
        else:
            self.prefix.forget(request_id)

    # ---- fork / swap ---------------------------------------------------------------
    def fork(self, parent_id: str, child_id: str) -> None:
        """Give `child_id` a table sharing every block of `parent_id` (ref counts + 1)."""
        parent = self._table(parent_id)
        if child_id in self._tables or self.swap_space.holds(child_id):
            raise DuplicateRequestError(f"request {child_id!r} already holds blocks; fork into a new id")
        for b in parent:
            self.pool.share(b)
        self._tables[child_id] = list(parent)
        self.prefix.fork(parent_id, child_id)
        self.recorder.emit(ev.FORK, child_id, None, len(parent))

    def swap_out(self, request_id: str) -> BlockMapping | None:
        """Move a request's blocks to the CPU pool: (gpu, cpu) pairs, or None if it is full."""
        table = self._table(request_id)
        n = len(table)  # with a host tier, its entries give way to a preempted request
        if not (self.host.make_room(n) if self.host is not None else n <= self.swap_space.num_free):
            return None
        cpus = self.swap_space.store(request_id, [b.num_filled for b in table])
        mapping: BlockMapping = [(b.block_id, cpu) for b, cpu in zip(table, cpus)]
        del self._tables[request_id]
        self.pool.free_blocks(reversed(table), request_id)
        self.prefix.set_offered(request_id)
        self.num_swapped_out_blocks += len(mapping)
        self.recorder.emit(ev.SWAP_OUT, request_id, None, len(mapping))
        return mapping

    def swap_in(self, request_id: str) -> BlockMapping | None:
        """Bring a swapped request back: (cpu, gpu) pairs, or None if the GPU pool is too full."""
        if self.num_swapped_blocks(request_id) > self.pool.num_free:
            return None
        saved = self.swap_space.take(request_id)
        blocks = self.pool.allocate(len(saved), request_id)
        for b, (_, filled) in zip(blocks, saved):
            self.pool.fill(b, filled)
        # with a host tier, tier-outs of this plan must not land on blocks the swap-in reads: deferred
        (self.host.defer_release if self.host is not None else self.swap_space.give_back)(
            [cpu for cpu, _ in reversed(saved)])
        self._tables[request_id] = blocks
        self.num_swapped_in_blocks += len(blocks)
        self.recorder.emit(ev.SWAP_IN, request_id, None, len(blocks))
        return [(cpu, b.block_id) for (cpu, _), b in zip(saved, blocks)]

    def _table(self, request_id: str) -> list[Block]:
        try:
            return self._tables[request_id]
        except KeyError:
            raise UnknownRequestError(f"request {request_id!r} holds no blocks in the GPU pool") from None

    # ---- compaction (paged.core.compaction) -----------------------------------------------
    def _id_tables(self, order: Sequence[str] | None) -> list[tuple[str, list[int]]]:
        """(request id, block ids) for ``order`` (default: every table, in the order they were made)."""
        ids = self._tables if order is None else order
        return [(r, [b.block_id for b in self._tables[r]]) for r in ids if r in self._tables]

    def compact(self, order: Sequence[str] | None = None, *, drop_cached: bool = False,
                max_copies: int | None = None, max_rounds: int = 4) -> BlockMapping:
        """Move live blocks so each request's own blocks (in ``order``, oldest first) are
        physically contiguous; returns the (src, dst) copies to apply before anything else reads
        or writes the cache (no copy reads a block an earlier one wrote: in order or all at once).
        The pass's counts are in ``last_compaction``; see ``paged.core.compaction`` for the
        objective, the rounds and the bound."""
        plan = compact_pool(self.pool, self._id_tables(order), drop_cached=drop_cached, max_copies=max_copies,
                            max_rounds=max_rounds, recorder=self.recorder)
        self.last_compaction = plan
        self.num_compactions += 1
        self.num_compaction_copies += plan.num_copies
        return plan.copies

    def block_fragmentation(self, order: Sequence[str] | None = None) -> float:
        """What a compaction pass can fix: share of adjacent own-block pairs not physically
        consecutive (``paged.core.compaction.fragmentation``; O(table entries))."""
        return fragmentation(self._id_tables(order))

    def snapshot(self, requests=None, **kw):
        """Numpy state for views: a `paged.core.snapshot.KVSnapshot` (see there; O(blocks))."""
        from .snapshot import take_snapshot  # numpy: loaded only when a view asks
        return take_snapshot(self, requests, **kw)

    # ---- checks --------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Assert the manager's invariants (for tests; O(total blocks))."""
        self.check_parts()
        holders = Counter(b.block_id for table in self._tables.values() for b in table)
        for bid, n in holders.items():
            assert self.pool.blocks[bid].ref_cnt == n, (bid, self.pool.blocks[bid].ref_cnt, n)
        assert sum(holders.values()) >= self.pool.num_used == len(holders)
