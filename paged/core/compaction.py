"""Block compaction: move live blocks so each running request's block table is physically contiguous.

The seed's ``--enable-block-compaction``, made precise and measurable.

**Objective.** Requests are taken in the order given (the scheduler passes its running order:
oldest first). A request's *own* blocks are the blocks of its table that no earlier request holds
(first-holder rule). After a pass every compacted request's own blocks, in table order, have
consecutive ascending ids. A block shared by several tables (prefix hit, fork, beams) sits in one
place, so it can be contiguous for one holder only: the first. A request that shares a prefix with
an older one therefore reads at most two runs (the shared prefix where its first holder put it,
then its own blocks); a request sharing nothing reads one. ``fragmentation`` measures what a pass
can fix: the share of adjacent own-block pairs that are not physically consecutive.

**Moves only into free blocks, in rounds.** In a round every destination is a block that is free
when the round starts (plain free or never used), or one of the request's own blocks already at
its target place (it does not move); sources are live blocks no copy has written. A round is one
parallel copy: no destination is also a source of it, no two copies share a destination, so there
are no chains or cycles and no scratch block is needed. The blocks a round vacates become free for
the next round (requests the round could not place try again; ``max_rounds``, default 4). The whole
pass is one list in which no copy reads a block an earlier copy wrote (a later round may overwrite
a block an earlier round only read), so applying it in order or all at once gives the same cache;
with ``max_rounds=1`` no destination is a source at all (``kernels.copy_blocks`` then takes its
parallel Triton path on GPU).

**Bound.** copies = own blocks moved <= own blocks of the fragmented requests; each block moves at
most once per pass (a request placed in one round is not revisited); round 1 moves at most as many
blocks as were free. For each fragmented request the pass picks the
window of ids that keeps the most of its blocks in place (fewest copies), then drops the fewest
cached-free blocks, then starts lowest. A request with no window (``n`` own blocks need ``n`` ids
each free or already holding its own block at that position) stays as it is (``skipped``).

**Cached-free blocks** (ref 0, still hashed) are never moved: by default a window may not contain
one (compaction never costs a prefix hit); with ``drop_cached=True`` a window may, and the block's
prefix entry is dropped (an ``evict`` event; the host tier is not asked to keep it, because its copy
to the host would run after this pass's copies overwrote the block).

**Prefix entries follow the data.** A move relocates the ``Block`` object itself (``BlockPool.relocate``:
its id changes, the free block that was at the destination takes the source id). Tables and the hash
index hold ``Block`` objects (and prefix chains are kept by content ids), so every prefix entry and every holder of a
shared block sees the new id, and verified hits keep working (content ids do not change).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Collection, Iterable, Sequence

from . import events as ev
from .block_pool import BlockPool
from paged.errors import BlockStateError

__all__ = ["CompactionPlan", "compact_pool", "count_runs", "fragmentation", "own_blocks", "plan_compaction"]

_BLOCKED, _FREE, _CACHED = 0, 1, 2


@dataclass
class CompactionPlan:
    """One pass: ``copies`` (src, dst) to apply before anything else of the step (in order, or at once),
    ``moves`` (request, src, dst) in the same order, cached-free blocks dropped, and the counts."""

    copies: list[tuple[int, int]] = field(default_factory=list)
    moves: list[tuple[str, int, int]] = field(default_factory=list)
    dropped_cached: list[int] = field(default_factory=list)
    num_requests: int = 0
    num_fragmented: int = 0      # requests whose own blocks were in more than one run
    num_compacted: int = 0       # of those, made contiguous by this pass
    num_skipped: int = 0         # of those, left as they were (no window, or max_copies reached)
    num_rounds: int = 0          # rounds that moved blocks
    runs_before: int = 0         # own-block runs over all requests
    runs_after: int = 0
    fragmentation_before: float = 0.0
    fragmentation_after: float = 0.0

    @property
    def num_copies(self) -> int:
        return len(self.copies)


def count_runs(ids: Sequence[int]) -> int:
    """Maximal runs of consecutive ascending ids (0 for an empty table, 1 when contiguous)."""
    return 1 + sum(1 for a, b in zip(ids, ids[1:]) if b != a + 1) if ids else 0


def own_blocks(tables: Iterable[tuple[str, Sequence[int]]]) -> list[tuple[str, list[int]]]:
    """Each request's own blocks (those no earlier request in ``tables`` holds), in table order."""
    seen: set[int] = set()
    out = []
    for rid, table in tables:
        out.append((rid, [b for b in table if b not in seen]))
        seen.update(table)
    return out


def fragmentation(tables: Iterable[tuple[str, Sequence[int]]]) -> float:
    """Share of adjacent own-block pairs (see ``own_blocks``) whose ids are not consecutive, in
    [0, 1]: 0 when every request's own blocks are one run (what a full pass achieves)."""
    breaks = pairs = 0
    for _, own in own_blocks(tables):
        if len(own) > 1:
            breaks += count_runs(own) - 1
            pairs += len(own) - 1
    return breaks / pairs if pairs else 0.0


def _best_window(own: list[int], avail: bytearray, prefix_blocked: list[int],
                 prefix_cached: list[int]) -> tuple[int, int, int] | None:
    """(start, copies, cached dropped) of the best window for ``own`` or None (see module docstring)."""
    n, num_blocks = len(own), len(avail)
    in_place = Counter(b - i for i, b in enumerate(own))  # window start -> own blocks already in place
    best = None
    for s, keep in in_place.items():  # windows keeping some blocks in place: fewer copies than any other
        if 0 <= s <= num_blocks - n and prefix_blocked[s + n] - prefix_blocked[s] == keep:
            key = (n - keep, prefix_cached[s + n] - prefix_cached[s], s)
            best = key if best is None or key < best else best
    if best is None:  # a window of free (or droppable cached) ids only: the fewest cached, then the lowest
        for s in range(num_blocks - n + 1):
            if prefix_blocked[s + n] == prefix_blocked[s]:
                key = (n, prefix_cached[s + n] - prefix_cached[s], s)
                if best is None or key < best:
                    best = key
                    if key[1] == 0:
                        break
    return None if best is None else (best[2], best[0], best[1])  # key (copies, dropped, start) reordered


def plan_compaction(tables: Sequence[tuple[str, Sequence[int]]], num_blocks: int, free: Iterable[int],
                    cached: Collection[int] = (), *, drop_cached: bool = False,
                    max_copies: int | None = None, max_rounds: int = 4) -> CompactionPlan:
    """Plan one pass over block ids (pure: no state changes).

    ``tables``: (request id, block ids) in priority order; ``free``: ids free now (plain free or
    never used); ``cached``: cached-free ids (used as destinations only with ``drop_cached``);
    ``max_copies``: a budget per pass (requests that would exceed it are skipped); ``max_rounds``:
    rounds of the pass (see the module docstring; 1 = no destination is ever a source). Every other
    id is live. Raises BlockStateError (and plans nothing) when a table names a free or out-of-range id.
    """
    if not isinstance(max_rounds, int) or max_rounds < 1:
        raise BlockStateError(f"max_rounds must be an integer >= 1, got {max_rounds!r}")
    avail = bytearray(num_blocks)  # _BLOCKED
    for b in free:
        avail[b] = _FREE
    if drop_cached:
        for b in cached:
            avail[b] = _CACHED
    owned = own_blocks(tables)
    for rid, own in owned:
        for b in own:
            if not 0 <= b < num_blocks or avail[b] != _BLOCKED or b in cached:
                raise BlockStateError(f"request {rid!r} holds block {b}, which is free, cached-free or outside "
                                      f"[0, {num_blocks}); compaction needs the manager's own tables")
    plan = CompactionPlan(num_requests=len(owned), fragmentation_before=fragmentation(tables),
                          runs_before=sum(count_runs(own) for _, own in owned))
    pending = [(rid, own) for rid, own in owned if count_runs(own) > 1]
    plan.num_fragmented = len(pending)
    budget = max_copies if max_copies is not None else num_blocks
    for _ in range(max_rounds):
        vacated: list[int] = []
        left = []
        prefix_blocked = prefix_cached = None
        for rid, own in pending:
            if prefix_blocked is None:  # rebuilt only after a request took blocks
                prefix_blocked = [0, *accumulate(1 if a == _BLOCKED else 0 for a in avail)]
                prefix_cached = [0, *accumulate(1 if a == _CACHED else 0 for a in avail)]
            best = _best_window(own, avail, prefix_blocked, prefix_cached)
            if best is None or best[1] > budget:
                left.append((rid, own))
                continue
            s, copies, _ = best
            budget -= copies
            for i, b in enumerate(own):
                d = s + i
                if b != d:
                    if avail[d] == _CACHED:
                        plan.dropped_cached.append(d)
                    avail[d] = _BLOCKED
                    plan.copies.append((b, d))
                    plan.moves.append((rid, b, d))
                    vacated.append(b)
            prefix_blocked = None
            plan.num_compacted += 1
        plan.num_rounds += 1 if vacated else 0
        pending = left
        if not vacated or not pending:
            break
        for b in vacated:  # free for the next round only: its copies come after this round's reads
            avail[b] = _FREE
    plan.num_skipped = len(pending)
    moved = dict(plan.copies)
    after = [(rid, [moved.get(b, b) for b in t]) for rid, t in tables]
    plan.runs_after = sum(count_runs(own) for _, own in own_blocks(after))
    plan.fragmentation_after = fragmentation(after)
    return plan


def compact_pool(pool: BlockPool, tables: Sequence[tuple[str, Sequence[int]]], *, drop_cached: bool = False,
                 max_copies: int | None = None, max_rounds: int = 4,
                 recorder: ev.Recorder | None = None) -> CompactionPlan:
    """Plan one pass over ``tables`` ((request id, block ids) in priority order: the KV manager's)
    and commit it to ``pool``: drop the cached-free blocks the plan takes (``evict`` events), then
    relocate each moved block (a ``compact`` event on ``recorder`` each). The caller applies
    ``plan.copies`` to the cache before any other operation that reads or writes those blocks."""
    plan = plan_compaction(tables, pool.num_blocks, pool.free_block_ids(), pool.cached_free_block_ids(),
                           drop_cached=drop_cached, max_copies=max_copies, max_rounds=max_rounds)
    for d in plan.dropped_cached:
        pool.evict_cached(d)
    emit = (recorder if recorder is not None else pool.recorder).emit
    for rid, s, d in plan.moves:
        pool.relocate(s, d)
        emit(ev.COMPACT, rid, d, s)
    return plan
