"""HybridKVCacheManager: the KV manager for a layout of several groups (sliding windows, state layers).

A ``KVCache`` (``paged.core.kv_cache``) that wraps a ``KVCacheManager`` (``manager``: the table of
the layout's first group, full attention) and ``paged.core.window.GroupTables`` (the other groups'
tables, in the same pool). Each protocol member is written out below: most answer what the
manager answers (its pool, counts and tables of the first group); these calls add the groups:

- ``num_blocks_to_allocate`` adds the other groups' new pages and subtracts the sliding blocks
  that fall out of every window (freed first, so they count as free);
- ``allocate_slots`` frees those blocks, lets the manager do its table, then the groups theirs,
  and indexes the groups' full blocks; it never half-applies (the same checks come first);
- ``find_cached_prefix`` trims the manager's verified hit to what every group can continue from
  (``GroupTables.trim_hit``): a hit never hands out a block whose window content is gone;
- ``free`` releases the groups' blocks too.

A layout with no full-attention group (every layer slides, e.g. Mistral-7B v0.1) is **anchored**:
``GroupTables`` keeps every group in the pool of pages (``pool``), and the manager keeps only the
content chain (hashes, verified content ids) in a pool of its own that costs no pages
(``anchor_capacity`` entries, enough for every running request's chain: created lazily; cached
ones are its ledger of past prefixes). A hit is then the manager's verified chain of contents,
trimmed from the right to the last window blocks every group still has (vLLM's
``SlidingWindowManager``); ``blocks_of`` is that chain, not pages, and snapshots are refused.

Not offered for hybrid layouts (each raises ``ConfigError`` saying so): fork, swap (``swap_out``
returns None, so preemption recomputes), compaction, the host tier. The decode lane runs the
general allocation per token (a window can retire a block at any token).
"""
from __future__ import annotations

from typing import Any, Sequence

from . import events as ev
from .block import Block, BlockMapping
from .block_pool import BlockPool
from .kv_groups import FULL, SLIDING, KVLayout
from .kv_manager import KVCacheManager
from .request import Request
from .window import GroupHit, GroupTables
from paged.errors import BlockStateError, ConfigError, InvalidRequestError

__all__ = ["HybridKVCacheManager"]


class HybridKVCacheManager:
    """A KV cache over ``layout``'s groups in one pool (see module docstring)."""

    def __init__(self, num_blocks: int, layout: KVLayout, **settings: Any) -> None:
        if not layout.groups or layout.groups[0].kind not in (FULL, SLIDING):
            raise ConfigError("a hybrid layout's pool needs an attention group (full or sliding) to order its "
                              "prefix cache; give the model at least one attention layer")
        if settings.get("enable_host_tier") or settings.get("host_tier_threshold", 1.0) != 1.0:
            raise ConfigError("the host tier is not offered for hybrid (sliding-window / state) layouts; "
                              "turn enable_host_tier off")
        self.anchored = layout.groups[0].kind != FULL
        if self.anchored:  # the manager keeps only the content chain, in a pool of its own (no pages)
            bs, recorder = layout.block_size, settings.pop("recorder", None) or ev.NullRecorder()
            settings.setdefault("max_model_len", None)
            if settings["max_model_len"] is None:
                settings["max_model_len"] = num_blocks * bs
            self.manager = KVCacheManager(self.anchor_capacity(num_blocks, layout, settings["max_model_len"]),
                                          bs, **settings)
            self.pool = BlockPool(num_blocks, eviction=settings.get("eviction", "lru"), recorder=recorder)
            self.recorder = recorder
            self.groups = GroupTables(layout, self.pool, recorder, first=0, anchors=self.manager.pool)
        else:
            self.manager = KVCacheManager(num_blocks, layout.block_size, **settings)
            self.pool, self.recorder = self.manager.pool, self.manager.recorder
            self.groups = GroupTables(layout, self.pool, self.recorder)
        self.layout = layout
        self._hits: dict[str, tuple[int, GroupHit]] = {}  # request id -> its pending trimmed hit

        m = self.manager  # its parts, read-only here: the prefix index, swap space
        self.prefix, self.swap_space = m.prefix, m.swap_space
        self.block_size, self.num_blocks, self.max_model_len = m.block_size, num_blocks, m.max_model_len
        self.num_cpu_blocks, self.enable_prefix_caching = m.num_cpu_blocks, m.enable_prefix_caching
        self.host = None  # no host tier (refused above)

    @staticmethod
    def anchor_capacity(num_blocks: int, layout: KVLayout, max_model_len: int) -> int:
        """Entries of an anchored manager's chain pool: a running request holds at least one page per
        ``need`` (window blocks) of chain entries, so ``num_blocks x (cdiv(max_model_len, block_size)
        // need + 1)`` never runs out."""
        bs = layout.block_size
        need = min(max(1, -(-(g.window - 1) // bs)) for g in layout.groups if g.kind == SLIDING)
        return num_blocks * (-(-max_model_len // bs) // need + 1)

    # ---- the manager's counters and reads (the groups hold no request's table of their own) ----
    @property
    def prefix_cache_queries(self) -> int:
        return self.manager.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.manager.prefix_cache_hits

    @property
    def num_cow_copies(self) -> int:
        return self.manager.num_cow_copies

    @property
    def num_swapped_out_blocks(self) -> int:
        return self.manager.num_swapped_out_blocks

    @property
    def num_swapped_in_blocks(self) -> int:
        return self.manager.num_swapped_in_blocks

    host_cache_hits = 0
    has_host_tier = False
    num_host_cached_blocks = 0

    @property
    def kv_cache_usage_perc(self) -> float:
        return self.pool.num_used / self.num_blocks  # KVCacheParts' formulas, over the pages

    @property
    def token_usage(self) -> float:
        used = self.pool.num_used
        return self.pool.num_filled_slots / (used * self.block_size) if used else 0.0

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_cached_free_blocks(self) -> int:
        return self.pool.num_cached_free

    def has(self, request_id: str) -> bool:
        return self.manager.has(request_id)

    def request_ids(self) -> list[str]:
        return self.manager.request_ids()

    def blocks_of(self, request_id: str) -> Sequence[Block]:
        """The first (full-attention) group's table; anchored: the content chain (no pages)."""
        return self.manager.blocks_of(request_id)

    def block_table(self, request_id: str) -> list[int]:
        return self.manager.block_table(request_id)

    def is_swapped(self, request_id: str) -> bool:
        return self.manager.is_swapped(request_id)

    def can_swap_in(self, request: Request, num_new_tokens: int, *, keep_free: int = 0) -> bool:
        return self.manager.can_swap_in(request, num_new_tokens, keep_free=keep_free)

    def take_freed_blocks(self) -> list[int]:
        return self.pool.take_freed() if self.pool.freed else []

    def demote_above_threshold(self) -> int:
        return self.manager.demote_above_threshold()

    def take_tier_ops(self) -> tuple[BlockMapping, BlockMapping, int]:
        return self.manager.take_tier_ops()

    def reset_prefix_cache(self) -> int:
        return self.manager.reset_prefix_cache() + (self.pool.reset() if self.anchored else 0)

    def snapshot(self, requests=None, **kw):
        if self.anchored:
            raise ConfigError("snapshots of a layout with no full-attention group (every layer slides) are not "
                              "offered; read the counts (num_used_blocks, kv_cache_usage_perc) instead")
        return self.manager.snapshot(requests, **kw)

    def append_decode_slots(self, requests: Sequence[Request], i: int, stop: int, starts: list[int],
                            tables: list, last_only: bool = True) -> int:
        """The scheduler's decode lane over every group: for ``requests[i:stop]`` in order, while a
        request computes exactly its one last token and ``allocate_slots(request, 1)`` fits (it
        never copies here: no block of a hybrid pool is shared partly filled), allocate it, append
        its position and table; returns the index of the first request not handled."""
        j = i
        for req in requests[i:stop]:
            start = req.num_computed_tokens
            if len(req.token_ids) - start != 1 or not self.has(req.request_id):
                break
            if self.allocate_slots(req, 1) is None:
                break  # the general path preempts
            starts.append(start)
            tables.append(self.blocks_of(req.request_id))
            j += 1
        return j

    # ---- input -------------------------------------------------------------------------
    def check_request(self, request: Request) -> None:
        self.manager.check_request(request)
        total = request.max_total_tokens
        need = (0 if self.anchored else -(-total // self.block_size)) + self.groups.max_pages(total)
        if need > self.num_blocks:
            raise InvalidRequestError(
                f"request needs up to {need} pages of this hybrid layout (all groups) but the pool has only "
                f"{self.num_blocks}; give the cache more blocks or lower max_tokens")

    # ---- prefix cache --------------------------------------------------------------------
    def find_cached_prefix(self, request: Request) -> list[Block]:
        """The manager's verified hit, trimmed so every group can continue from it."""
        hit = self.manager.find_cached_prefix(request)
        rid = request.request_id
        self._hits.pop(rid, None)
        if not hit:
            return hit
        length, group_hit = self.groups.trim_hit(self.prefix.hashes[rid], request.token_ids, hit)
        if not length:
            return []
        self._hits[rid] = (length, group_hit)
        return list(hit[:length])

    def _group_hit(self, request: Request, cached_blocks: Sequence[Block]) -> GroupHit | None:
        if not cached_blocks:
            return None
        pending = self._hits.get(request.request_id)
        if pending is None or pending[0] != len(cached_blocks):
            raise BlockStateError(f"request {request.request_id!r}: cached blocks must come from this manager's "
                                  "find_cached_prefix, called just before")
        return pending[1]

    # ---- allocation ------------------------------------------------------------------------
    def num_blocks_to_allocate(self, request: Request, num_new_tokens: int,
                               cached_blocks: Sequence[Block] = ()) -> int:
        rid = request.request_id
        end = request.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        own = 0 if self.anchored else self.manager.num_blocks_to_allocate(request, num_new_tokens, cached_blocks)
        hit = self._group_hit(request, cached_blocks)
        return own + self.groups.pages_needed(rid, end, hit) \
            - self.groups.retirable(rid, request.num_computed_tokens)

    def can_allocate(self, request: Request, num_new_tokens: int, cached_blocks: Sequence[Block] = (),
                     *, keep_free: int = 0) -> bool:
        """Whether ``allocate_slots`` fits now, every group counted, leaving ``keep_free`` blocks free."""
        return self.pool.num_free - self.num_blocks_to_allocate(request, num_new_tokens, cached_blocks) >= keep_free

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached_blocks: Sequence[Block] = ()) -> BlockMapping | None:
        rid = request.request_id
        start = request.num_computed_tokens + len(cached_blocks) * self.block_size
        if num_new_tokens < 0 or start + num_new_tokens > request.num_tokens:
            return self.manager.allocate_slots(request, num_new_tokens, cached_blocks)  # raises what it raises
        if self.swap_space.holds(rid) or (cached_blocks and self.has(rid)):
            return self.manager.allocate_slots(request, num_new_tokens, cached_blocks)  # raises BlockStateError
        hit = self._group_hit(request, cached_blocks)
        if self.num_blocks_to_allocate(request, num_new_tokens, cached_blocks) > self.pool.num_free:
            return None
        # ---- commit (nothing below can fail) ----
        self.groups.retire(rid, request.num_computed_tokens)
        copies = self.manager.allocate_slots(request, num_new_tokens, cached_blocks)
        assert copies is not None, "checked above: the pool holds every group (anchored: see anchor_capacity)"
        self._hits.pop(rid, None)
        end = start + num_new_tokens
        self.groups.allocate(rid, start, end, hit)
        if self.anchored and hit and type(self.recorder) is not ev.NullRecorder:  # the hit's pages (the chain has none)
            for b in hit[0]:
                if b is not None:
                    self.recorder.emit(ev.PREFIX_HIT, rid, b.block_id, self.block_size)
        if self.enable_prefix_caching:
            self.groups.index(rid, self.prefix.hashes.get(rid, ()), request.token_ids, end, self.blocks_of(rid))
        return copies

    # ---- release ---------------------------------------------------------------------------
    def free(self, request_id: str) -> None:
        hashes = self.prefix.hashes.get(request_id, ())
        primary = () if self.anchored or not self.has(request_id) else list(self.blocks_of(request_id))
        self.manager.free(request_id)
        self.groups.free(request_id, hashes, primary)
        self._hits.pop(request_id, None)

    def release_if_held(self, request_id: str) -> None:
        if self.manager.has(request_id):
            self.free(request_id)
        else:
            self.manager.release_if_held(request_id)
        self._hits.pop(request_id, None)

    # ---- not offered -------------------------------------------------------------------------
    def fork(self, parent_id: str, child_id: str) -> None:
        raise ConfigError("fork (n > 1, beams) is not offered for hybrid layouts; sample one sequence per request")

    def swap_out(self, request_id: str) -> BlockMapping | None:
        return None  # the scheduler then preempts by recompute

    def swap_in(self, request_id: str) -> BlockMapping | None:
        raise ConfigError("swap is not offered for hybrid layouts (preemption recomputes)")

    def compact(self, order=None, **kw: Any) -> BlockMapping:
        raise ConfigError("block compaction is not offered for hybrid layouts; turn enable_block_compaction off")

    def block_fragmentation(self, order=None) -> float:
        raise ConfigError("block compaction is not offered for hybrid layouts; turn enable_block_compaction off")

    # ---- checks --------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """The manager's invariants over every group: each used block is held exactly by the
        table entries that name it (its ref count), and by nothing else."""
        self.manager.check_parts()
        holders = self.groups.holders()
        if self.anchored:
            self.pool.check_invariants()
        for rid in () if self.anchored else self.request_ids():
            for b in self.blocks_of(rid):
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for bid, n in holders.items():
            assert self.pool.blocks[bid].ref_cnt == n, (bid, self.pool.blocks[bid].ref_cnt, n)
        assert self.pool.num_used == len(holders), (self.pool.num_used, len(holders))
