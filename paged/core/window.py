"""GroupTables: the block tables of a hybrid layout's other groups, window retirement, trimmed hits.

A hybrid model (``paged.core.kv_groups.KVLayout`` with several groups) keeps one table per group
per request in one shared pool. The KV manager's own table is the first group when it is full
attention and this class keeps the others (``first=1``); when no group is full (every layer
slides) this class keeps every group (``first=0``) and the manager's table is only the content
chain the groups are anchored to, in a pool of its own (``anchors``), costing no pages:

- **full** groups hold a block per ``block_size`` tokens, like the manager's table;
- **sliding** groups hold the same, but a block no future query of the group can read (all its
  tokens below ``skipped_tokens(num_computed)``) is freed (``retire``) and its entry becomes None;
  a full block stays indexed when freed, so it can still serve a prefix hit until it is evicted;
- **state** groups hold ``state_pages`` pages per request from its first token to its end.

Prefix hits (``trim_hit``, after vLLM v1's ``SlidingWindowManager.find_longest_cache_hit`` and the
hybrid coordinator's fixed point): a hit of ``L`` leading blocks is only valid when every group
can continue from it: an extra full group must hold all ``L`` blocks cached, a sliding group of
window ``w`` the last ``cdiv(w - 1, block_size)`` blocks before position ``L x block_size`` (what
the next query attends), a state group a state at that position (never kept: so a hit on a
model with state layers is 0). ``L`` shrinks until every group accepts it. A group block is
indexed under ``("group", g, chained hash)`` with ``parent_cid`` set to the content id of the manager's
indexed block at the same position (its anchor; None when that block is not indexed, so never a
hit): a hit takes it only when its tokens match and its anchor is the verified hit block there, so
a hash collision never hands out another prefix's window.

Invariants: ``tables[rid][g]`` has an entry per block position of the request's computed (or
being computed) tokens; a sliding table's None entries are exactly its leading positions below
``start[rid][g]``; every non-None entry is held once (ref count) by this table.
"""
from __future__ import annotations

from typing import Hashable, Sequence

from . import events as ev
from .block import Block
from .block_pool import BlockPool
from .kv_groups import FULL, SLIDING, STATE, KVGroupSpec, KVLayout

__all__ = ["GroupHit", "GroupTables"]

GroupHit = list[list[Block | None]]
"""Per extra group, the table a prefix hit starts it with (None: a position outside its window)."""


def _key(group: int, block_hash: Hashable) -> tuple:
    return ("group", group, block_hash)


class GroupTables:
    """Tables of ``layout.groups[1:]`` per request over ``pool`` (see the module docstring)."""

    __slots__ = ("layout", "groups", "pool", "anchors", "block_size", "recorder", "tables", "start", "offered",
                 "chain", "need", "sliding")

    def __init__(self, layout: KVLayout, pool: BlockPool, recorder: ev.Recorder, *, first: int = 1,
                 anchors: BlockPool | None = None) -> None:
        """Tables of ``layout.groups[first:]`` over ``pool``; ``anchors``: the pool indexing the
        manager's table (``pool`` itself unless every group is kept here)."""
        self.layout, self.pool, self.recorder = layout, pool, recorder
        self.anchors = anchors if anchors is not None else pool
        self.groups: tuple[KVGroupSpec, ...] = layout.groups[first:]
        self.block_size = layout.block_size
        bs = self.block_size
        # blocks before a hit's end that a sliding group must still have (its next query's window)
        self.need = [-(-(g.window - 1) // bs) if g.kind == SLIDING else 0 for g in self.groups]
        self.sliding = [(i, g.window) for i, g in enumerate(self.groups) if g.kind == SLIDING]
        self.tables: dict[str, list[list[Block | None]]] = {}
        self.start: dict[str, list[int]] = {}    # first live position of each sliding table
        self.offered: dict[str, int] = {}  # leading positions offered to the hash index (every attention group)
        self.chain: dict[str, int | None] = {}  # the anchor (content id) of the last offered position

    # ---- counts ------------------------------------------------------------------------
    def held(self, rid: str) -> int:
        """Pages the request's extra groups hold."""
        return sum(sum(b is not None for b in t) for t in self.tables.get(rid, ()))

    def max_pages(self, num_tokens: int) -> int:
        """Pages the extra groups hold for a request of ``num_tokens`` tokens at most, a sliding group
        counted at its window (``check_request``'s necessary condition; a long chunk holds more)."""
        bs, total = self.block_size, 0
        for g, need in zip(self.groups, self.need):
            blocks = -(-num_tokens // bs)
            total += self.layout.state_pages(g) if g.kind == STATE else \
                min(blocks, need + 2) if g.kind == SLIDING else blocks
        return total

    def retirable(self, rid: str, num_computed: int) -> int:
        """Blocks ``retire(rid, num_computed)`` would make free (not those another request still holds)."""
        tables = self.tables.get(rid)
        if tables is None:
            return 0
        n, bs, starts = 0, self.block_size, self.start[rid]
        for i, window in self.sliding:
            stop = (num_computed - window + 1) // bs  # KVGroupSpec.skipped_tokens, inlined (hot)
            if stop > starts[i]:
                table = tables[i]
                n += sum(1 for p in range(starts[i], min(stop, len(table))) if table[p].ref_cnt == 1)
        return n

    def pages_needed(self, rid: str, end: int, hit: GroupHit | None) -> int:
        """New pages ``allocate(rid, ..., end, hit)`` takes, plus the cached-free hit blocks it revives."""
        bs, total = self.block_size, 0
        tables = self.tables.get(rid)
        for i, g in enumerate(self.groups):
            have = tables[i] if tables is not None else (hit[i] if hit else [])
            if g.kind == STATE:
                total += 0 if have else self.layout.state_pages(g)
                continue
            total += max(0, -(-end // bs) - len(have))
            if tables is None and hit:
                total += sum(1 for b in have if b is not None and b.ref_cnt == 0)
        return total

    # ---- changes -----------------------------------------------------------------------
    def retire(self, rid: str, num_computed: int) -> int:
        """Free every sliding-group block of ``rid`` whose tokens no query from position
        ``num_computed`` on reads. Returns how many were freed."""
        tables = self.tables.get(rid)
        if tables is None:
            return 0
        freed, starts, bs = 0, self.start[rid], self.block_size
        for i, window in self.sliding:
            table = tables[i]
            stop = min((num_computed - window + 1) // bs, len(table))  # skipped_tokens, inlined
            if stop <= starts[i]:
                continue
            for p in range(starts[i], stop):
                block = table[p]
                if block is not None:
                    self.pool.free(block, rid)
                    table[p] = None
                    freed += 1
            starts[i] = stop
        return freed

    def allocate(self, rid: str, start: int, end: int, hit: GroupHit | None) -> None:
        """Give ``rid``'s groups the blocks for tokens [start, end) (a new request starts from
        ``hit``, whose blocks it takes a hold on). The caller checked ``pages_needed`` fits."""
        pool, bs = self.pool, self.block_size
        tables = self.tables.get(rid)
        if tables is None:
            tables = self.tables[rid] = [list(h) for h in hit] if hit else [[] for _ in self.groups]
            self.start[rid] = [next((p for p, b in enumerate(t) if b is not None), len(t)) for t in tables]
            self.offered[rid] = len(hit[0]) if hit else 0  # a hit's blocks are indexed already
            for table in tables:
                for block in table:
                    if block is not None:
                        pool.touch(block, rid)
        for g, table in zip(self.groups, tables):
            if g.kind == STATE:
                if not table:
                    table.extend(pool.allocate(self.layout.state_pages(g), rid))
                    pool.fill_span(table, 0, len(table) * bs, bs)  # a state fills its pages
                continue
            missing = -(-end // bs) - len(table)
            if missing > 0:
                table.extend(pool.allocate(missing, rid))
            pool.fill_span(table, start // bs, end, bs)  # positions from start // bs on are live

    def index(self, rid: str, hashes: Sequence[Hashable], token_ids: Sequence[int], end: int,
              primary: Sequence[Block]) -> None:
        """Offer the attention-group blocks of ``rid`` full below ``end`` to the pool's index, each
        anchored to the content the manager indexed at its position: ``primary[p]`` itself, or the
        indexed block holding the same tokens after the same content (a duplicate ``primary[p]``
        repeats, as ``PrefixIndex`` chains it; None when there is none: never a hit). An entry
        under the same key anchored elsewhere (stale: its anchor was evicted and recomputed, or
        None) gives way, so a window recomputed after an eviction serves hits again."""
        bs, pool, lookup = self.block_size, self.pool, self.anchors.lookup
        last, first = min(end // bs, len(hashes), len(primary)), self.offered[rid]
        if last <= first:
            return
        tables = self.tables[rid]
        chain = self.chain.get(rid, 0) if first == 0 else self.chain.get(rid, primary[first - 1].cid)
        for p in range(first, last):
            ids, held = tuple(token_ids[p * bs:(p + 1) * bs]), lookup(hashes[p])
            chain = held.cid if held is not None and chain is not None and held.parent_cid == chain \
                and held.token_ids == ids else None
            for i, g in enumerate(self.groups):
                block = tables[i][p] if g.kind != STATE else None
                if block is None:
                    continue
                key = _key(i, hashes[p])
                if chain is not None:
                    old = pool.lookup(key)
                    if old is not None and old is not block and old.parent_cid != chain:
                        pool.uncache(old.block_id)  # stale: anchored to content no longer indexed
                pool.register(block, key, ids, chain, rid, depth=p)
        self.offered[rid], self.chain[rid] = last, chain

    def free(self, rid: str, hashes: Sequence[Hashable] = (), primary: Sequence[Block] = ()) -> None:
        """Release every block the request's groups hold (tail first, as the manager does); then,
        from the tail, give each cached-free page of its content (``primary``: the manager's table,
        just freed; each group's page under ``hashes``, the retired ones included) the place of a
        page freed now, so that in every group a prefix and its windows outlive the suffix, as the
        manager's tail-first free keeps it for the full group (a window page retired mid-request
        would otherwise be evicted before the suffix computed after it)."""
        tables = self.tables.pop(rid, None)
        self.start.pop(rid, None)
        self.offered.pop(rid, None)
        self.chain.pop(rid, None)
        pool = self.pool
        for table in tables or ():
            pool.free_blocks([b for b in reversed(table) if b is not None], rid)
        attending = [i for i, g in enumerate(self.groups) if g.kind != STATE]
        for p in range(len(hashes) - 1, -1, -1):
            if p < len(primary):
                pool.refresh(primary[p])
            for i in attending:
                block = pool.lookup(_key(i, hashes[p]))
                if block is not None:
                    pool.refresh(block)

    # ---- prefix hits -------------------------------------------------------------------
    def _cached(self, i: int, hashes: Sequence[Hashable], token_ids: Sequence[int], p: int,
                primary: Sequence[Block]) -> Block | None:
        """Group ``i``'s cached block at position ``p``, verified against the hit's ``primary[p]``."""
        bs = self.block_size
        block = self.pool.lookup(_key(i, hashes[p]))
        if block is None or block.parent_cid is None or block.parent_cid != primary[p].cid \
                or block.token_ids != tuple(token_ids[p * bs:(p + 1) * bs]):
            return None
        return block

    def _valid(self, i: int, length: int, hashes: Sequence[Hashable], token_ids: Sequence[int],
               primary: Sequence[Block]) -> int:
        """The longest hit of at most ``length`` blocks group ``i`` can continue from."""
        g = self.groups[i]
        if g.kind == STATE:
            return 0
        if g.kind == FULL:
            n = 0
            while n < length and self._cached(i, hashes, token_ids, n, primary) is not None:
                n += 1
            return n
        need, run = self.need[i], 0
        if need == 0:  # a window of one token: each query reads only itself
            return length
        for p in range(length - 1, -1, -1):  # from the right: the first run of `need` cached blocks ends the hit
            if self._cached(i, hashes, token_ids, p, primary) is None:
                run = 0
                continue
            run += 1
            if run >= need:
                return p + run
        return run  # blocks 0 .. run - 1 are cached: a hit shorter than the window is whole

    def trim_hit(self, hashes: Sequence[Hashable], token_ids: Sequence[int],
                 primary: Sequence[Block]) -> tuple[int, GroupHit]:
        """The longest prefix of the manager's verified hit ``primary`` that every extra group can
        continue from, in blocks, and each group's starting table for it (no state change)."""
        length = len(primary)
        while True:
            new = length
            for i in range(len(self.groups)):
                new = min(new, self._valid(i, new, hashes, token_ids, primary))
            if new == length:
                break
            length = new
        hit: GroupHit = []
        for i, g in enumerate(self.groups):
            lo = max(0, length - self.need[i]) if g.kind == SLIDING else 0
            if g.kind == STATE:
                hit.append([])
            else:
                hit.append([None] * lo + [self._cached(i, hashes, token_ids, p, primary) for p in range(lo, length)])
        return length, hit

    # ---- checks ------------------------------------------------------------------------
    def holders(self) -> dict[int, int]:
        """Block id -> how many group-table entries hold it (for the manager's invariant check)."""
        out: dict[int, int] = {}
        for tables in self.tables.values():
            for table in tables:
                for b in table:
                    if b is not None:
                        out[b.block_id] = out.get(b.block_id, 0) + 1
        return out
