"""BlockPool: fixed-size physical KV blocks with ref counts, a free queue and a hash index.

Invariants (checked by `check_invariants`, relied on everywhere):
- every block is in exactly one of: used (ref_cnt > 0), free-uncached (ref_cnt == 0,
  no hash), cached-free (ref_cnt == 0, hashed; held by the eviction policy);
- a block is in the hash index iff it has a hash; cached-free blocks are exactly the
  indexed blocks with ref_cnt == 0;
- allocate takes never-hashed blocks first and evicts a cached-free block (dropping
  its hash) only when none is left; every operation is O(1) per block (LRU) or
  O(log n) (heap policies).
Blocks are created lazily on first use, so a pool of a million blocks costs nothing
until it is used.

The pool owns this state: other modules read it through the queries below (``blocks`` and
``index`` are read-only outside the pool) and change it only through its methods; compaction
moves blocks with ``relocate`` and drops cached entries with ``evict_cached``, the manager drops
entries of never-written blocks with ``uncache``.
"""
from __future__ import annotations

from typing import Callable, Hashable, Iterable

from . import events as ev
from paged.errors import BlockStateError, CacheInUseError, ConfigError
from .block import Block
from .eviction import EvictionPolicy, make_policy

__all__ = ["Block", "BlockPool"]


class BlockPool:
    def __init__(self, num_blocks: int, *, eviction: str | EvictionPolicy = "lru",
                 recorder: ev.Recorder | None = None, on_evict: Callable[[Block], bool] | None = None) -> None:
        """``on_evict(block)``: offered each cached-free block before it loses its hash; True when it
        kept the content elsewhere (the host tier's demote), None/False: plain eviction."""
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ConfigError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.blocks: list[Block | None] = [None] * num_blocks
        self._next_fresh = 0               # blocks >= this id were never used
        self._free_plain: list[Block] = []  # ref 0, no hash: reused first (stack)
        self.cached_free: EvictionPolicy = make_policy(eviction)
        self.index: dict[Hashable, Block] = {}
        self.num_used = 0
        self.num_filled_slots = 0          # sum of num_filled over used blocks
        self._clock = 0
        self.recorder = recorder if recorder is not None else ev.NullRecorder()
        self.freed: set[int] = set()  # ids whose ref count reached 0 since the manager last took them
        self._next_cid = 1                 # content ids of registrations (0 is "no parent")
        self.on_evict = on_evict

    # ---- queries -------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (plain free + cached-free)."""
        return self.num_blocks - self.num_used

    def ref_count(self, block_id: int) -> int:
        b = self.blocks[block_id] if 0 <= block_id < self.num_blocks else None
        return 0 if b is None else b.ref_cnt

    @property
    def num_created(self) -> int:
        """Blocks created so far: ``blocks[i]`` is a ``Block`` below this id and None from it on
        (never used)."""
        return self._next_fresh

    @property
    def num_cached_free(self) -> int:
        """Cached-free blocks (ref 0, still hashed; held by the eviction policy)."""
        return len(self.cached_free)

    def free_block_ids(self) -> list[int]:
        """Ids of the free blocks without a hash: plain-free ones, then the never-used ones."""
        return [b.block_id for b in self._free_plain] + list(range(self._next_fresh, self.num_blocks))

    def cached_free_block_ids(self) -> set[int]:
        """Ids of the cached-free blocks."""
        return {b.block_id for b in self.cached_free}

    def take_freed(self) -> list[int]:
        """Ids whose ref count reached 0 since the last call and are still free now, sorted
        (a block freed and reused in between starts a new life through its new owner)."""
        blocks = self.blocks
        ids = sorted(i for i in self.freed if blocks[i] is None or blocks[i].ref_cnt == 0)
        self.freed.clear()
        return ids

    # ---- allocation ----------------------------------------------------------------
    def allocate(self, n: int, request_id: str | None = None) -> list[Block]:
        """Take `n` blocks (ref_cnt 1 each). Caller checks `num_free >= n` first."""
        if n > self.num_free:
            raise BlockStateError(f"asked for {n} blocks with {self.num_free} free; check num_free first")
        out = []
        rec = self.recorder
        emit = rec.emit if ev.ALLOCATE in rec.hears else None  # no calls for kinds no one hears
        emit_evict = rec.emit if ev.EVICT in rec.hears else None
        step, clock, free_plain = rec.step, self._clock, self._free_plain
        for _ in range(n):
            if free_plain:
                block = free_plain.pop()
            elif self._next_fresh < self.num_blocks:
                block = Block(self._next_fresh)
                self.blocks[self._next_fresh] = block
                self._next_fresh += 1
            else:
                block = self.cached_free.pop()
                if (self.on_evict is None or not self.on_evict(block)) and emit_evict is not None:
                    emit_evict(ev.EVICT, request_id, block.block_id, None)
                self._drop_hash(block)
            block.ref_cnt = 1
            block.num_filled = 0
            block.hits = 0
            block.alloc_step = step
            clock += 1
            block.last_access = clock
            if emit is not None:
                emit(ev.ALLOCATE, request_id, block.block_id, None)
            out.append(block)
        self._clock = clock
        self.num_used += n
        return out

    def touch(self, block: Block, request_id: str | None = None) -> None:
        """Add a holder to a block found by a prefix hit (revives it if cached-free)."""
        if block.ref_cnt == 0:
            self.cached_free.remove(block)
            self.num_used += 1
            self.num_filled_slots += block.num_filled
        block.ref_cnt += 1
        block.hits += 1
        self._clock += 1
        block.last_access = self._clock

    def share(self, block: Block) -> None:
        """Add a holder to a block already in use (fork)."""
        if block.ref_cnt < 1:
            raise BlockStateError(f"cannot share {block}: it is not in use")
        block.ref_cnt += 1

    def free(self, block: Block, request_id: str | None = None) -> None:
        """Drop one holder. At ref 0 a hashed block becomes cached-free, others plain free."""
        if block.ref_cnt < 1:
            raise BlockStateError(f"double free of block {block.block_id}: its ref count is already 0")
        block.ref_cnt -= 1
        if block.ref_cnt:
            return
        self.num_used -= 1
        self.num_filled_slots -= block.num_filled
        self.freed.add(block.block_id)
        self._clock += 1
        block.last_access = self._clock
        cached = block.block_hash is not None
        if cached:
            self.cached_free.add(block)
        else:
            self._free_plain.append(block)
        if ev.FREE in self.recorder.hears:
            self.recorder.emit(ev.FREE, request_id, block.block_id, int(cached))

    def refresh(self, block: Block) -> None:
        """Give a cached-free ``block`` the policy place of a block freed now (its content was just
        in use: a hybrid pool's window page retired before its request ended); else nothing."""
        if block.ref_cnt or block.block_hash is None:
            return
        self.cached_free.remove(block)
        self._clock += 1
        block.last_access = self._clock
        self.cached_free.add(block)

    def free_blocks(self, blocks: Iterable[Block], request_id: str | None = None) -> None:
        """``free(b)`` for each of ``blocks`` in order (one call for a request's table)."""
        for block in blocks:
            if block.ref_cnt > 1:  # another holder remains: the common fork/prefix-sharing case
                block.ref_cnt -= 1
            else:
                self.free(block, request_id)

    def fill(self, block: Block, num_filled: int) -> None:
        """Record that `num_filled` slots of a used block hold tokens."""
        if num_filled > block.num_filled:
            self.num_filled_slots += num_filled - block.num_filled
            block.num_filled = num_filled

    def fill_next(self, blocks: list[Block]) -> None:
        """``fill(block, block.num_filled + 1)`` for each of ``blocks``: one more token written into
        each, right after its filled slots (the caller knows each has room); the KV manager's decode
        lane reports a whole run of decodes in one call."""
        for block in blocks:
            block.num_filled += 1
        self.num_filled_slots += len(blocks)

    def fill_span(self, blocks: list[Block], first: int, end: int, block_size: int) -> None:
        """``fill(blocks[i], min(block_size, end - i * block_size))`` for every block holding a
        position below ``end`` from index ``first`` on (one call for a chunk's blocks)."""
        added = 0
        for i in range(first, -(-end // block_size)):
            block = blocks[i]
            n = min(end - i * block_size, block_size)
            if n > block.num_filled:
                added += n - block.num_filled
                block.num_filled = n
        self.num_filled_slots += added

    # ---- hash index ----------------------------------------------------------------
    def register(self, block: Block, block_hash: Hashable, token_ids: tuple[int, ...], parent_cid: int | None = 0,
                 request_id: str | None = None, *, depth: int = 0, cid: int | None = None) -> bool:
        """Index a full, used block under `block_hash`. First writer wins on a clash.

        ``parent_cid``: the content id of the block its K/V was computed after (0: the first block
        of a prefix; None: not known, so the block is indexed but never verified as a hit);
        ``depth``: its position in the prefix chain; ``cid``: the content id it keeps (content
        moved back from the host tier), else a new one, never given before."""
        if block.block_hash is not None or block_hash in self.index:
            return False
        block.block_hash = block_hash
        block.token_ids = token_ids
        block.parent_cid = parent_cid
        block.depth = depth
        block.cid = self.new_cid() if cid is None else cid
        self.index[block_hash] = block
        if ev.CACHE_BLOCK in self.recorder.hears:
            self.recorder.emit(ev.CACHE_BLOCK, request_id, block.block_id, len(token_ids))
        return True

    def lookup(self, block_hash: Hashable) -> Block | None:
        return self.index.get(block_hash)

    def new_cid(self) -> int:
        """A content id never given before (for content that arrives from outside this pool, such
        as a pooled tier's remote copy)."""
        cid, self._next_cid = self._next_cid, self._next_cid + 1
        return cid

    def restore_hits(self, block: Block, hits: int) -> None:
        """Give used ``block`` the hit count its content had in another tier (a host-tier hit)."""
        if block.ref_cnt < 1:
            raise BlockStateError(f"{block} is not in use")
        block.hits = hits

    def adopt_cid(self, block: Block, cid: int) -> None:
        """Give indexed ``block`` the content id ``cid`` of an identical copy that was dropped
        (the host tier's entry for the same hash, tokens and parent content)."""
        if self.index.get(block.block_hash) is not block:
            raise BlockStateError(f"{block} is not indexed; only an indexed block takes a content id")
        block.cid = cid

    def uncache(self, block_id: int) -> bool:
        """Drop the prefix-cache entry of block ``block_id`` if the index holds it (its K/V was
        never written: a failed step). An in-use block keeps its holders; a cached-free one
        becomes plain free. Returns whether an entry was dropped."""
        block = self.blocks[block_id]
        if block is None or block.block_hash is None or self.index.get(block.block_hash) is not block:
            return False
        if block.ref_cnt == 0:
            self.cached_free.remove(block)
            self._free_plain.append(block)
        self._drop_hash(block)
        return True

    def evict_cached(self, block_id: int) -> None:
        """Evict cached-free block ``block_id`` now (an ``evict`` event): its entry is dropped
        and it becomes plain free (compaction taking its id; the host tier is not asked)."""
        block = self.blocks[block_id]
        if block is None or block.ref_cnt or block.block_hash is None:
            raise BlockStateError(f"block {block_id} is not cached-free; only cached-free blocks can be evicted")
        self.cached_free.remove(block)
        self._drop_hash(block)
        self._free_plain.append(block)
        self.recorder.emit(ev.EVICT, None, block_id, None)

    def relocate(self, src: int, dst: int) -> None:
        """Give the in-use block at id ``src`` the id ``dst`` (plain free or never used) and the
        free block at ``dst`` the id ``src`` (O(1), or O(ids created) when ``dst`` was never used:
        the ids up to it are created and reused after the blocks freed so far). Tables, the hash
        index and parent links hold ``Block`` objects, so every holder sees the new id."""
        blocks = self.blocks
        if not (0 <= src < self.num_blocks and 0 <= dst < self.num_blocks):
            raise BlockStateError(f"relocate({src}, {dst}): ids must be in [0, {self.num_blocks})")
        moved, target = blocks[src], blocks[dst]
        if moved is None or moved.ref_cnt < 1:
            raise BlockStateError(f"relocate({src}, {dst}): block {src} is not in use")
        if target is not None and (target.ref_cnt or target.block_hash is not None):
            raise BlockStateError(f"relocate({src}, {dst}): block {dst} is not plain free")
        if target is None:
            new = [Block(i) for i in range(self._next_fresh, dst + 1)]
            blocks[self._next_fresh:dst + 1] = new
            self._free_plain[:0] = reversed(new)
            self._next_fresh = dst + 1
            target = blocks[dst]
        moved.block_id, target.block_id = dst, src
        blocks[dst], blocks[src] = moved, target
        self.freed.add(src)

    def _drop_hash(self, block: Block) -> None:
        del self.index[block.block_hash]
        block.block_hash = None
        block.token_ids = None
        block.cid = block.parent_cid = None

    def demote_cached_free(self, n: int) -> int:
        """Hand up to `n` cached-free blocks (policy order) to `on_evict` and make them plain
        free; stops at the first one it refuses (kept cached). Returns how many moved."""
        moved = 0
        while moved < n and len(self.cached_free) and self.on_evict is not None:
            block = self.cached_free.pop()
            if not self.on_evict(block):
                self.cached_free.add(block)
                break
            self._drop_hash(block)
            self._free_plain.append(block)
            moved += 1
        return moved

    def reset(self) -> int:
        """Drop every hash. Only allowed when no block is in use. Returns blocks dropped."""
        if self.num_used:
            raise CacheInUseError(f"cannot reset the prefix cache while {self.num_used} blocks are in use; "
                                  "finish or abort all requests first")
        dropped = len(self.cached_free)  # every one is popped below
        while len(self.cached_free):
            block = self.cached_free.pop()
            self._drop_hash(block)
            self._free_plain.append(block)
        self.recorder.emit(ev.RESET, None, None, dropped)
        return dropped

    # ---- checks --------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Assert the pool's invariants (O(num_blocks); for tests)."""
        used = [b for b in self.blocks if b is not None and b.ref_cnt > 0]
        assert len(used) == self.num_used, (len(used), self.num_used)
        cached = list(self.cached_free)
        assert len(cached) == len(self.cached_free)
        assert all(b.ref_cnt == 0 and b.block_hash is not None for b in cached)
        assert all(b.ref_cnt == 0 and b.block_hash is None for b in self._free_plain)
        assert self.num_used + len(cached) + len(self._free_plain) == self._next_fresh  # the rest never used
        assert {b.block_id for b in self.index.values() if b.ref_cnt == 0} == {b.block_id for b in cached}
        assert all(self.index[b.block_hash] is b for b in self.index.values())
        assert self.num_filled_slots == sum(b.num_filled for b in used)

