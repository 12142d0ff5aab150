"""The host tier: cached-free prefix blocks kept in the CPU pool instead of being dropped.

When an allocation would evict a cached-free GPU block (ref 0, hashed), ``HostTier.demote``
takes a CPU block for its content and plans a GPU -> CPU copy (``tier_out``); the GPU block
then loses its hash and is reused. A later prefix hit that finds the content here gets a new
GPU block and a CPU -> GPU copy (``tier_in``), applied before the forward pass that reads it.
The runner applies, per step: tier_out, swap_out, block copies, swap_in, tier_in (see
``paged.core.scheduler``), so a demoted GPU block is read before anything overwrites it.

Invariants (``check``, ``KVCacheManager.check_invariants``):
- a cached block lives in exactly one tier: no hash (and no content id) is both in the GPU
  pool's index and here;
- the CPU pool is shared with preemption swap: every CPU block is exactly one of free, held
  by a swapped-out request, a host-tier entry, or released this step (``_deferred``: a swap-in
  or tier-in source read by this step's copies; free again when the plan is taken);
- tier entries are evictable when a swap-out needs room (``make_room``): a preempted request's
  K/V is the only copy, a tier entry is a cache.

Prefix chains survive moves because hits are verified on content ids (``Block.cid``,
``parent_cid``), which travel with the content, not on the GPU block's identity.
"""
from __future__ import annotations

from typing import Hashable, Sequence

from . import events as ev
from .block import Block, BlockMapping
from .block_pool import BlockPool
from .eviction import EvictionPolicy, make_policy

__all__ = ["HostBlock", "HostTier"]


class HostBlock:
    """One host-tier entry: a prefix block's content in CPU block ``block_id``."""

    __slots__ = ("block_id", "block_hash", "token_ids", "cid", "parent_cid", "depth", "hits", "last_access",
                 "prev", "next")
    ref_cnt = 0  # never held by a request: a hit on it costs one new GPU block (the manager's count)

    def __init__(self, cpu: int, block: "Block | HostBlock") -> None:
        self.block_id = cpu
        self.block_hash = block.block_hash
        self.token_ids = block.token_ids
        self.cid, self.parent_cid, self.depth = block.cid, block.parent_cid, block.depth
        self.hits, self.last_access = block.hits, block.last_access
        self.prev: HostBlock | None = None
        self.next: HostBlock | None = None

    def __repr__(self) -> str:
        return f"HostBlock(cpu={self.block_id}, depth={self.depth}, hits={self.hits})"


class HostTier:
    """Host-tier index and CPU-block accounting over the manager's CPU free list ``cpu_free``."""

    def __init__(self, cpu_free: list[int], *, eviction: str | EvictionPolicy = "lru",
                 recorder: ev.Recorder | None = None) -> None:
        self.free = cpu_free                      # shared with KVCacheManager's swap (same list)
        self.entries: dict[Hashable, HostBlock] = {}
        self.policy: EvictionPolicy = make_policy(eviction)
        self.recorder = recorder if recorder is not None else ev.NullRecorder()
        self._out: dict[int, int] = {}             # cpu -> gpu: tier-out copies planned this step
        self._in: BlockMapping = []                # (cpu, gpu): tier-in copies planned this step
        self._deferred: list[int] = []             # CPU blocks this step's copies still read
        self._evicted = 0                          # host evictions this step
        self.num_tier_out_blocks = 0               # cumulative counters
        self.num_tier_in_blocks = 0
        self.num_host_evicted_blocks = 0

    # ---- queries -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.entries)

    @property
    def room(self) -> int:
        """CPU blocks a demotion or swap-out could get now (free + evictable entries)."""
        return len(self.free) + len(self.policy)

    # ---- moves ---------------------------------------------------------------------------
    def demote(self, block: Block) -> bool:
        """Keep a cached-free GPU block's content (the pool's ``on_evict``): plan its copy to a
        CPU block, evicting an entry if none is free. False (plain eviction) when nothing fits."""
        if not self.free and not self._evict_one():
            return False
        cpu = self.free.pop()
        entry = self.entries[block.block_hash] = HostBlock(cpu, block)
        self.policy.add(entry)
        self._out[cpu] = block.block_id
        self.num_tier_out_blocks += 1
        self.recorder.emit(ev.TIER_OUT, None, block.block_id, cpu)
        return True

    def receive(self, source: HostBlock, cid: int, parent_cid: int) -> HostBlock | None:
        """Keep a copy of another node's entry ``source`` (a pooled tier's remote hit: the network
        wrote it into host memory, so no copy is planned) under this manager's content ids ``cid``
        (new) and ``parent_cid`` (the content it follows here), as the most recent entry, evicting
        the least recent one if no CPU block is free. None, and nothing changed, when nothing fits
        or the hash is already here."""
        if source.block_hash in self.entries or (not self.free and not self._evict_one()):
            return None
        entry = self.entries[source.block_hash] = HostBlock(self.free.pop(), source)
        entry.cid, entry.parent_cid = cid, parent_cid
        self.policy.add(entry)
        return entry

    def refresh(self, entry: HostBlock) -> None:
        """``entry`` was just read (by another node): it becomes the most recent for eviction."""
        entry.hits += 1
        self.policy.remove(entry)
        self.policy.add(entry)

    def take(self, entry: HostBlock) -> None:
        """Remove a hit entry from the tier (index and policy) before it is brought back."""
        self.policy.remove(entry)
        del self.entries[entry.block_hash]

    def promoted(self, entry: HostBlock, gpu: int, request_id: str | None = None) -> None:
        """Plan the copy of a taken entry into GPU block ``gpu``; its CPU block is free after
        this step's copies."""
        self._in.append((entry.block_id, gpu))
        self._deferred.append(entry.block_id)
        self.num_tier_in_blocks += 1
        self.recorder.emit(ev.TIER_IN, request_id, gpu, entry.block_id)

    def discard(self, block_hash: Hashable) -> HostBlock | None:
        """Drop the entry under ``block_hash`` (the GPU pool indexed the same hash: one tier
        each); returns it, or None."""
        entry = self.entries.pop(block_hash, None)
        if entry is not None:
            self.policy.remove(entry)
            self._out.pop(entry.block_id, None)
            self.free.append(entry.block_id)
        return entry

    def _evict_one(self) -> bool:
        if not len(self.policy):
            return False
        entry = self.policy.pop()
        del self.entries[entry.block_hash]
        self._out.pop(entry.block_id, None)  # demoted and dropped in the same step: no copy
        self.free.append(entry.block_id)
        self._evicted += 1
        self.num_host_evicted_blocks += 1
        self.recorder.emit(ev.HOST_EVICT, None, None, entry.block_id)
        return True

    def demote_excess(self, pool: BlockPool, limit: int) -> int:
        """Demote cached-free GPU blocks (the pool's policy order) until used + cached-free blocks
        are at most ``limit`` or the tier has no room. Returns blocks moved (copies in ``take_ops``)."""
        n = min(pool.num_used + pool.num_cached_free - limit, pool.num_cached_free, self.room)
        return pool.demote_cached_free(n) if n > 0 else 0

    def bring_back(self, pool: BlockPool, cached: Sequence[Block | HostBlock], request_id: str,
                   block_size: int) -> list[Block]:
        """Take a prefix hit over both tiers (``prefix_cache.find_cached_prefix`` over this tier's
        ``entries`` too; the caller checked the pool's room) and return the GPU blocks of the
        request's new table, in order: the GPU blocks are revived, each host entry gets a new GPU
        block indexed under its hash and content id and a planned copy back (an allocation here may
        demote other cached-free blocks, never these). Emits a ``prefix_hit`` per block."""
        for e in cached:
            if isinstance(e, HostBlock):
                self.take(e)  # out of reach of the demotions below
            else:
                pool.touch(e, request_id)
        fresh = iter(pool.allocate(sum(isinstance(e, HostBlock) for e in cached), request_id))
        table: list[Block] = []
        for e in cached:
            if isinstance(e, HostBlock):
                b = next(fresh)
                parent = table[-1] if table else None
                ok = pool.register(b, e.block_hash, e.token_ids, e.parent_cid, request_id,
                                   depth=parent.depth + 1 if parent else 0, cid=e.cid)
                assert ok and e.parent_cid == (parent.cid if parent else 0), "a host-tier hit follows its parent"
                pool.fill(b, block_size)
                pool.restore_hits(b, e.hits + 1)
                self.promoted(e, b.block_id, request_id)
                e = b
            table.append(e)
            self.recorder.emit(ev.PREFIX_HIT, request_id, e.block_id, block_size)
        return table

    def dedupe(self, pool: BlockPool, block: Block) -> None:
        """A GPU block was indexed under a hash this tier holds: keep one tier. The same tokens
        after the same parent content are the same K/V, so the block takes the entry's content id
        and the entry's cached children stay reachable."""
        entry = self.discard(block.block_hash)
        if entry is not None and entry.token_ids == block.token_ids and entry.parent_cid == block.parent_cid:
            pool.adopt_cid(block, entry.cid)

    def make_room(self, n: int) -> bool:
        """Evict entries until ``n`` CPU blocks are free (for a swap-out); False, and nothing
        changed, when even evicting every entry would not do."""
        if self.room < n:
            return False
        while len(self.free) < n:
            self._evict_one()
        return True

    def defer_release(self, cpus: Sequence[int]) -> None:
        """CPU blocks a swap-in of this step still reads: free once the plan is taken."""
        self._deferred.extend(cpus)

    def drop_blocks(self, cpus: Sequence[int]) -> int:
        """Drop the entries in CPU blocks ``cpus`` (their tier-out copy failed). Returns how many."""
        wanted = set(cpus)
        gone = [e for e in self.entries.values() if e.block_id in wanted]
        for e in gone:
            self.discard(e.block_hash)
        return len(gone)

    def reset(self) -> int:
        """Drop every entry (between steps). Returns how many."""
        return sum(self.discard(h) is not None for h in list(self.entries))

    def take_ops(self) -> tuple[BlockMapping, BlockMapping, int]:
        """This step's (gpu, cpu) tier-out and (cpu, gpu) tier-in copies and host evictions;
        releases the CPU blocks the step's copies read (they are free for the next plan)."""
        out = [(gpu, cpu) for cpu, gpu in self._out.items()]
        tin, evicted = self._in, self._evicted
        self._out, self._in, self._evicted = {}, [], 0
        self.free.extend(self._deferred)
        self._deferred = []
        return out, tin, evicted

    # ---- checks --------------------------------------------------------------------------
    def check(self, pool: BlockPool, swapped_cpus: Sequence[int], num_cpu_blocks: int) -> None:
        """Assert the invariants of the module docstring (O(blocks); for tests)."""
        assert len(self.policy) == len(self.entries)
        assert {id(e) for e in self.policy} == {id(e) for e in self.entries.values()}
        assert all(self.entries[e.block_hash] is e for e in self.entries.values())
        assert not set(self.entries) & set(pool.index), "a block lives in two tiers"
        cids = [e.cid for e in self.entries.values()] + [b.cid for b in pool.index.values()]
        assert len(set(cids)) == len(cids) and None not in cids
        held = [e.block_id for e in self.entries.values()]
        every = held + list(swapped_cpus) + list(self.free) + self._deferred
        assert len(every) == len(set(every)) == num_cpu_blocks, (len(every), len(set(every)), num_cpu_blocks)

