"""KVCacheManager: the one owner of block tables and ref counts.

The scheduler asks; the manager answers with a plan or `None` ("cannot, preempt
something") and never half-applies an operation:
- `find_cached_prefix(request)` -> verified cached blocks for the prompt's leading full
  blocks (never all of it: at least one token is computed);
- `allocate_slots(request, n, cached)` -> the (src, dst) block copies the runner must
  apply (copy-on-write of a shared partial block), or None if the pool is too small now;
- `free`, `fork`, `swap_out`, `swap_in`.

Slots: token at position p of a request lives in slot `table[p // bs] * bs + p % bs`.
Blocks of a finished request are freed tail-first, so under LRU a prefix outlives its
suffix. Swapping copies a request's blocks to a CPU pool of its own capacity.

With ``host_tier=True`` the same CPU pool also keeps cached-free prefix blocks an allocation
would evict (``paged.core.host_tier``): ``find_cached_prefix`` then returns blocks of either
tier, ``allocate_slots`` brings host ones back, and ``take_tier_ops`` hands the planned copies
to the scheduler's plan (``tier_out``/``tier_in``). Off by default (today's behaviour).
"""
from __future__ import annotations

import time
from typing import Hashable, Iterable, Sequence

from . import events as ev
from .block import Block
from .block_pool import BlockPool
from paged.errors import BlockStateError, ConfigError, DuplicateRequestError, InvalidRequestError, UnknownRequestError
from .eviction import EvictionPolicy
from .host_tier import HostBlock, HostTier, find_tiered_prefix
from .prefix_cache import DEFAULT_HASH_FN, BlockHasher, HashFn, find_cached_prefix
from .request import Request

BlockMapping = list[tuple[int, int]]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int = 16, *, enable_prefix_caching: bool = True,
                 hash_fn: str | HashFn = DEFAULT_HASH_FN, eviction: str | EvictionPolicy = "lru",
                 num_cpu_blocks: int = 0, max_model_len: int | None = None,
                 recorder: ev.Recorder | None = None, host_tier: bool = False,
                 host_eviction: str | EvictionPolicy = "lru", host_tier_threshold: float = 1.0) -> None:
        if not isinstance(block_size, int) or block_size < 1 or block_size & (block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two (1, 2, 4, ..., 16, ...), got {block_size!r}")
        if not isinstance(num_cpu_blocks, int) or num_cpu_blocks < 0:
            raise ConfigError(f"num_cpu_blocks must be an integer >= 0, got {num_cpu_blocks!r}")
        if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len < 1):
            raise ConfigError(f"max_model_len must be a positive integer or None, got {max_model_len!r}")
        self.recorder = recorder if recorder is not None else ev.NullRecorder()
        self._timed = not isinstance(self.recorder, ev.NullRecorder)  # allocation latency events
        self.pool = BlockPool(num_blocks, eviction=eviction, recorder=self.recorder)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.max_model_len = max_model_len if max_model_len is not None else num_blocks * block_size
        self.hasher = BlockHasher(block_size, hash_fn)
        self.num_cpu_blocks = num_cpu_blocks
        self._cpu_free: list[int] = list(range(num_cpu_blocks - 1, -1, -1))
        self._tables: dict[str, list[Block]] = {}
        self._swapped: dict[str, list[tuple[int, int]]] = {}   # rid -> [(cpu block, num_filled)]
        self._hashes: dict[str, list[Hashable]] = {}
        self._num_indexed: dict[str, int] = {}                  # leading blocks already registered
        # counters (tokens for the prefix cache, as vLLM counts them)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_cow_copies = 0
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        self.host_cache_hits = 0     # prefix_cache_hits (tokens) served from the host tier
        self.host: HostTier | None = None
        self.host_tier_threshold = host_tier_threshold
        if host_tier or host_tier_threshold != 1.0:
            self._setup_host_tier(host_tier, host_eviction, host_tier_threshold)
        self.num_compactions = 0
        self.num_compaction_copies = 0
        self.last_compaction = None  # paged.core.compaction.CompactionPlan of the last compact()

    def _setup_host_tier(self, on: bool, eviction: str | EvictionPolicy, threshold: float) -> None:
        if not (isinstance(threshold, (int, float)) and 0.0 < threshold <= 1.0):
            raise ConfigError(f"host_tier_threshold must be in (0, 1] (share of GPU blocks), got {threshold!r}; "
                              "1.0 demotes only on eviction")
        if not on:
            raise ConfigError("host_tier_threshold needs host_tier=True")
        if self.num_cpu_blocks < 1:
            raise ConfigError("host_tier=True needs a CPU pool: give num_cpu_blocks >= 1")
        if not self.enable_prefix_caching:
            raise ConfigError("host_tier=True keeps prefix-cache blocks: set enable_prefix_caching=True")
        self.host = HostTier(self._cpu_free, eviction=eviction, recorder=self.recorder)
        self.pool.on_evict = self.host.demote

    # ---- checks on input ---------------------------------------------------------
    def check_request(self, request: Request) -> None:
        """Raise InvalidRequestError if `request` can never be served by this cache."""
        total = request.max_total_tokens
        if request.num_prompt_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt of {request.num_prompt_tokens} tokens exceeds max_model_len={self.max_model_len}; "
                "raise max_model_len or truncate the prompt")
        if total > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({request.num_prompt_tokens}) + max_tokens ({request.max_tokens}) = {total} exceeds "
                f"max_model_len={self.max_model_len}; lower max_tokens or raise max_model_len")
        need = -(-total // self.block_size)
        if need > self.num_blocks:
            raise InvalidRequestError(
                f"request needs up to {need} blocks of {self.block_size} tokens but the pool has only "
                f"{self.num_blocks}; give the cache more blocks or lower max_tokens")

    # ---- queries -----------------------------------------------------------------
    def has(self, request_id: str) -> bool:
        return request_id in self._tables

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self._swapped

    def block_table(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._table(request_id)]

    def swapped_host_blocks(self, request_id: str) -> list[int]:
        """The CPU-pool block ids a swapped-out request holds, in table order (read-only: the
        engine's swap prefetch copies them early)."""
        if request_id not in self._swapped:
            raise UnknownRequestError(f"request {request_id!r} is not swapped out")
        return [cpu for cpu, _ in self._swapped[request_id]]

    def num_swapped_blocks(self, request_id: str) -> int:
        """Blocks a swapped-out request holds in the CPU pool."""
        if request_id not in self._swapped:
            raise UnknownRequestError(f"request {request_id!r} is not swapped out")
        return len(self._swapped[request_id])

    def take_freed_blocks(self) -> list[int]:
        """Blocks freed since the last call that are still free now, sorted (the scheduler puts
        them in its plan, for a runner whose cache format keeps per-block state outside the
        blocks, e.g. KIVI staging; a block freed and reused in between starts a new life
        through its new owner's write, copy or swap)."""
        pool = self.pool
        if not pool.freed:
            return []
        ids = sorted(b for b in pool.freed if pool.ref_count(b) == 0)
        pool.freed.clear()
        return ids

    # ---- host tier (paged.core.host_tier) ---------------------------------------------
    @property
    def num_host_cached_blocks(self) -> int:
        """Prefix blocks held in the host tier (0 without one)."""
        return len(self.host) if self.host is not None else 0

    def demote_above_threshold(self) -> int:
        """With ``host_tier_threshold`` t < 1: move cached-free blocks (GPU policy order) to the
        host tier until used + cached-free GPU blocks are at most t x num_blocks, so later
        allocations find plain free blocks; 1.0 (default): demote only on eviction. Returns
        blocks moved (their copies are in the next ``take_tier_ops``)."""
        host = self.host
        if host is None or self.host_tier_threshold >= 1.0:
            return 0
        excess = self.pool.num_used + len(self.pool.cached_free) - int(self.host_tier_threshold * self.num_blocks)
        n = min(excess, len(self.pool.cached_free), host.room)
        return self.pool.demote_cached_free(n) if n > 0 else 0

    def take_tier_ops(self) -> tuple[BlockMapping, BlockMapping, int]:
        """The host-tier copies planned since the last call: (gpu, cpu) tier-out pairs to apply
        before anything writes those GPU blocks, (cpu, gpu) tier-in pairs to apply before the
        forward pass, and the number of host evictions; ([], [], 0) without a host tier."""
        return self.host.take_ops() if self.host is not None else ([], [], 0)

    def drop_host_blocks(self, cpu_blocks: Iterable[int]) -> int:
        """Drop host-tier entries whose copy never completed (a failed step). Returns how many."""
        return self.host.drop_blocks(list(cpu_blocks)) if self.host is not None else 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self._cpu_free)

    @property
    def kv_cache_usage_perc(self) -> float:
        """Share of blocks in use (vLLM's `kv_cache_usage_perc`, in [0, 1])."""
        return self.pool.num_used / self.num_blocks

    @property
    def token_usage(self) -> float:
        """Slots holding tokens / slots in used blocks; the gap is internal fragmentation."""
        used = self.pool.num_used
        return self.pool.num_filled_slots / (used * self.block_size) if used else 0.0

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self.pool.cached_free)

    def blocks_needed(self, request: Request, num_new_tokens: int, num_cached_blocks: int = 0) -> int:
        """New blocks `allocate_slots` would take (including a copy-on-write copy)."""
        table = self._tables.get(request.request_id, ())
        start = request.num_computed_tokens + num_cached_blocks * self.block_size
        have = len(table) + num_cached_blocks
        need = max(0, -(-(start + num_new_tokens) // self.block_size) - have)
        if num_new_tokens and start % self.block_size and table and table[start // self.block_size].ref_cnt > 1:
            need += 1
        return need

    def num_blocks_to_allocate(self, request: Request, num_new_tokens: int,
                               cached_blocks: Sequence[Block] = ()) -> int:
        """Free blocks `allocate_slots(request, num_new_tokens, cached_blocks)` takes: new blocks
        (including a copy-on-write copy) plus cached-free blocks the prefix hit revives."""
        revive = sum(1 for b in cached_blocks if b.ref_cnt == 0)
        return self.blocks_needed(request, num_new_tokens, len(cached_blocks)) + revive

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
        need = blocks + max(0, -(-end // self.block_size) - blocks)
        return self.pool.num_free - need >= keep_free

    # ---- prefix cache --------------------------------------------------------------
    def find_cached_prefix(self, request: Request) -> list[Block]:
        """Verified cached blocks for a request not yet holding blocks (no state change)."""
        if not self.enable_prefix_caching or request.request_id in self._tables:
            return []
        hashes = self._hashes.setdefault(request.request_id, [])
        self.hasher.extend(hashes, request.token_ids, request.extra_keys, request.num_tokens)
        max_blocks = (request.num_tokens - 1) // self.block_size  # compute at least one token
        if self.host is not None:  # blocks of either tier (HostBlock: in the host tier)
            return find_tiered_prefix(self.pool, self.host, hashes, request.token_ids, self.block_size, max_blocks)
        return find_cached_prefix(self.pool, hashes, request.token_ids, self.block_size, max_blocks)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; only when no block is in use."""
        dropped = self.pool.reset()
        if self.host is not None:
            dropped += self.host.reset()
        return dropped

    # ---- allocation ----------------------------------------------------------------
    def append_decode_slots(self, requests: Sequence[Request], i: int, stop: int, starts: list[int]) -> int:
        """The scheduler's decode lane: for ``requests[i:stop]`` in order, while a request computes
        exactly its one last token, into a partly filled block it alone holds or into a new block
        the pool has free, do what ``allocate_slots(request, 1)`` does there (take the block,
        record the fill, index the block it completes; it returns ``[]`` for each of them), append
        the token's position to ``starts`` and go on. Returns the index of the first request not
        handled (``stop`` when all were): that one needs the general path (copy-on-write, more
        tokens, a full pool: preemption). The allocation-latency event of ``allocate_slots`` is
        not emitted here."""
        bs, tables, pool, caching = self.block_size, self._tables, self.pool, self.enable_prefix_caching
        added = 0  # pool.num_filled_slots, added once at the end
        get, mark = tables.get, starts.append
        run = requests if i == 0 and stop == len(requests) else requests[i:stop]  # no copy in the usual case
        for req in run:  # the common case (room in the last block) first, in few bytecodes
            start = req.num_computed_tokens
            if len(req.token_ids) - start != 1:
                break
            table = get(req.request_id)
            if not table:
                break
            offset = start % bs
            if offset:
                block = table[start // bs]
                if block.ref_cnt != 1:
                    break
                filled = block.num_filled
                if offset >= filled:  # pool.fill(block, offset + 1), inlined
                    added += offset + 1 - filled
                    block.num_filled = offset + 1
                if offset + 1 == bs and caching:
                    self._index_full_blocks(req, table, start + 1)
            else:  # the token opens a new block: take one if the pool has it
                if len(table) != start // bs or pool.num_used >= pool.num_blocks or self._timed:
                    break  # general path: the table has the block, a full pool, or latency events
                block = pool.allocate(1, req.request_id)[0]
                table.append(block)
                block.num_filled = 1
                added += 1
                if bs == 1 and caching:  # one slot: the new block is also full (earlier ones are indexed)
                    self._index_full_blocks(req, table, start + 1)
            mark(start)
            i += 1
        pool.num_filled_slots += added
        return i

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached_blocks: Sequence[Block] = ()) -> BlockMapping | None:
        """Make room for tokens [computed + cached, + num_new_tokens) of `request`.

        Only the allocation-latency event is skipped on the decode fast path (one token
        into a partly filled block the request owns alone: no new block, no copy).

        `cached_blocks` (from `find_cached_prefix`, only for a request holding no blocks)
        are taken as computed. Returns the (src, dst) copies to apply before the forward
        pass, or None when the pool cannot hold them now (nothing changed).
        """
        rid = request.request_id
        if num_new_tokens == 1 and not cached_blocks:  # decode fast path: room in an owned block
            table = self._tables.get(rid)
            start = request.num_computed_tokens
            offset = start % self.block_size
            if table and offset and start < len(request.token_ids):
                block = table[start // self.block_size]
                if block.ref_cnt == 1:
                    self.pool.fill(block, offset + 1)
                    if offset + 1 == self.block_size and self.enable_prefix_caching:
                        self._index_full_blocks(request, table, start + 1)
                    return []
        t0 = time.perf_counter_ns() if self._timed else 0
        if num_new_tokens < 0:
            raise InvalidRequestError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if rid in self._swapped:
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
            self._num_indexed[rid] = 0
        num_host = 0
        if cached_blocks and self.host is not None:
            num_host = self._take_tiered(rid, table, cached_blocks)
        elif cached_blocks:
            for b in cached_blocks:
                pool.touch(b, rid)
                self.recorder.emit(ev.PREFIX_HIT, rid, b.block_id, bs)
            table.extend(cached_blocks)
        if cached_blocks:
            self._num_indexed[rid] = len(cached_blocks)
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
            self._index_full_blocks(request, table, end)
        if self._timed:
            self.recorder.emit(ev.ALLOC_LATENCY, rid, None, time.perf_counter_ns() - t0)
        return copies

    def _take_tiered(self, rid: str, table: list[Block], cached: Sequence[Block | HostBlock]) -> int:
        """Take a prefix hit over both tiers into ``table`` (the caller checked the room): revive
        the GPU blocks, then give each host entry a new GPU block and plan its copy back (an
        allocation here may demote other cached-free blocks, never these). Returns host hits."""
        pool, host, bs = self.pool, self.host, self.block_size
        entries = [e for e in cached if isinstance(e, HostBlock)]
        for e in cached:
            if isinstance(e, HostBlock):
                host.take(e)  # out of reach of the demotions below
            else:
                pool.touch(e, rid)
        fresh = iter(pool.allocate(len(entries), rid) if entries else ())
        for e in cached:
            if isinstance(e, HostBlock):
                b = next(fresh)
                ok = pool.register(b, e.block_hash, e.token_ids, table[-1] if table else None, rid, cid=e.cid)
                assert ok and b.parent_cid == e.parent_cid, "a host-tier hit must follow its verified parent"
                pool.fill(b, bs)
                b.hits = e.hits + 1
                host.promoted(e, b.block_id, rid)
                e = b
            table.append(e)
            self.recorder.emit(ev.PREFIX_HIT, rid, e.block_id, bs)
        return len(entries)

    def _index_full_blocks(self, request: Request, table: list[Block], end: int) -> None:
        rid = request.request_id
        first, last = self._num_indexed[rid], end // self.block_size
        if first >= last:
            return
        hashes = self._hashes.setdefault(rid, [])
        self.hasher.extend(hashes, request.token_ids, request.extra_keys, end)
        bs = self.block_size
        host = self.host
        for i in range(first, last):
            if self.pool.register(table[i], hashes[i], tuple(request.token_ids[i * bs:(i + 1) * bs]),
                                  table[i - 1] if i else None, rid) and host is not None:
                self._dedupe_host(table[i])
        self._num_indexed[rid] = last

    def _dedupe_host(self, block: Block) -> None:
        """A GPU block was indexed under a hash the host tier holds: keep one tier. The same
        tokens after the same parent content are the same K/V, so the block takes the entry's
        content id and the entry's cached children stay reachable."""
        entry = self.host.discard(block.block_hash)
        if entry is not None and entry.token_ids == block.token_ids and entry.parent_cid == block.parent_cid:
            block.cid = entry.cid

    def uncache_written(self, request_id: str, start: int, num_tokens: int) -> int:
        """Drop the prefix-cache entries of the request's blocks holding tokens [start, start +
        num_tokens): a failed step never wrote their K/V. Returns how many were dropped."""
        bs = self.block_size
        table = self._tables.get(request_id, [])[start // bs:-(-(start + num_tokens) // bs)]
        return self.uncache_blocks(b.block_id for b in table)

    def uncache_blocks(self, block_ids: Iterable[int]) -> int:
        """Drop the prefix-cache entries of GPU blocks ``block_ids`` whose K/V was never written
        (a failed step: its chunks, or the swap-in it never applied). Returns how many were dropped."""
        dropped = 0
        for bid in block_ids:
            block = self.pool.blocks[bid]
            if block is not None and block.block_hash is not None and self.pool.index.get(block.block_hash) is block:
                self.pool._drop_hash(block)
                dropped += 1
        return dropped

    # ---- release -------------------------------------------------------------------
    def free(self, request_id: str) -> None:
        """Release every block (tail first) or swapped CPU block of a request."""
        if request_id in self._swapped:
            for cpu, _ in reversed(self._swapped.pop(request_id)):
                self._cpu_free.append(cpu)
        elif request_id in self._tables:
            table = self._tables.pop(request_id)
            self.pool.free_blocks(reversed(table), request_id)
        else:
            raise UnknownRequestError(f"request {request_id!r} holds no blocks (already freed or never allocated)")
        self._hashes.pop(request_id, None)
        self._num_indexed.pop(request_id, None)

    def release_if_held(self, request_id: str) -> None:
        if request_id in self._tables or request_id in self._swapped:
            self.free(request_id)
        else:
            self._hashes.pop(request_id, None)

    # ---- fork / swap ---------------------------------------------------------------
    def fork(self, parent_id: str, child_id: str) -> None:
        """Give `child_id` a table sharing every block of `parent_id` (ref counts + 1)."""
        parent = self._table(parent_id)
        if child_id in self._tables or child_id in self._swapped:
            raise DuplicateRequestError(f"request {child_id!r} already holds blocks; fork into a new id")
        for b in parent:
            self.pool.share(b)
        self._tables[child_id] = list(parent)
        self._num_indexed[child_id] = self._num_indexed.get(parent_id, 0)
        if parent_id in self._hashes:
            self._hashes[child_id] = list(self._hashes[parent_id])
        self.recorder.emit(ev.FORK, child_id, None, len(parent))

    def swap_out(self, request_id: str) -> BlockMapping | None:
        """Move a request's blocks to the CPU pool: (gpu, cpu) pairs, or None if it is full."""
        table = self._table(request_id)
        if self.host is not None:
            if not self.host.make_room(len(table)):  # tier entries give way to a preempted request
                return None
        elif len(table) > len(self._cpu_free):
            return None
        mapping: BlockMapping = []
        saved: list[tuple[int, int]] = []
        for b in table:
            cpu = self._cpu_free.pop()
            mapping.append((b.block_id, cpu))
            saved.append((cpu, b.num_filled))
        del self._tables[request_id]
        for b in reversed(table):
            self.pool.free(b, request_id)
        self._swapped[request_id] = saved
        self._num_indexed[request_id] = 0
        self.num_swapped_out_blocks += len(mapping)
        self.recorder.emit(ev.SWAP_OUT, request_id, None, len(mapping))
        return mapping

    def swap_in(self, request_id: str) -> BlockMapping | None:
        """Bring a swapped request back: (cpu, gpu) pairs, or None if the GPU pool is too full."""
        if request_id not in self._swapped:
            raise UnknownRequestError(f"request {request_id!r} is not swapped out")
        saved = self._swapped[request_id]
        if len(saved) > self.pool.num_free:
            return None
        blocks = self.pool.allocate(len(saved), request_id)
        for b, (_, filled) in zip(blocks, saved):
            self.pool.fill(b, filled)
        del self._swapped[request_id]
        if self.host is not None:  # tier-outs of this plan must not land on blocks the swap-in reads
            self.host.defer_release([cpu for cpu, _ in reversed(saved)])
        else:
            self._cpu_free.extend(cpu for cpu, _ in reversed(saved))
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
    def compact(self, order: Sequence[str] | None = None, *, drop_cached: bool = False,
                max_copies: int | None = None, max_rounds: int = 4) -> BlockMapping:
        """Move live blocks so each request's own blocks (in ``order``, oldest first) are
        physically contiguous; returns the (src, dst) copies to apply before anything else reads
        or writes the cache (no copy reads a block an earlier one wrote: in order or all at once).
        The pass's counts are in ``last_compaction``; see ``paged.core.compaction`` for the
        objective, the rounds and the bound."""
        from .compaction import compact_manager
        plan = compact_manager(self, order, drop_cached=drop_cached, max_copies=max_copies, max_rounds=max_rounds)
        self.last_compaction = plan
        self.num_compactions += 1
        self.num_compaction_copies += plan.num_copies
        return plan.copies

    def block_fragmentation(self, order: Sequence[str] | None = None) -> float:
        """What a compaction pass can fix: share of adjacent own-block pairs not physically
        consecutive (``paged.core.compaction.fragmentation``; O(table entries))."""
        from .compaction import fragmentation
        ids = list(order) if order is not None else list(self._tables)
        return fragmentation([(r, [b.block_id for b in self._tables[r]]) for r in ids if r in self._tables])

    def snapshot(self, requests=None, **kw):
        """Numpy state for views: a `paged.core.snapshot.KVSnapshot` (see there; O(blocks))."""
        from .snapshot import take_snapshot
        return take_snapshot(self, requests, **kw)

    # ---- checks --------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Assert the manager's invariants (for tests; O(total blocks))."""
        self.pool.check_invariants()
        holders: dict[int, int] = {}
        for table in self._tables.values():
            for b in table:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for bid, n in holders.items():
            assert self.pool.blocks[bid].ref_cnt == n, (bid, self.pool.blocks[bid].ref_cnt, n)
        assert sum(holders.values()) >= self.pool.num_used == len(holders)
        cpu_held = [c for saved in self._swapped.values() for c, _ in saved]
        assert len(set(cpu_held)) == len(cpu_held)
        if self.host is not None:
            self.host.check(self.pool, cpu_held, self.num_cpu_blocks)
            return
        assert len(cpu_held) + len(self._cpu_free) == self.num_cpu_blocks
        assert not set(cpu_held) & set(self._cpu_free)
