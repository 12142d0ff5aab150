"""Block: one physical KV block (id, ref count, hash and the tokens that verify a prefix hit).

Data only: ``BlockPool`` owns every state change of a block; eviction policies link and order
cached-free blocks through ``prev``/``next``/``hits``/``last_access``. One exception, for speed:
the KV manager's decode lane raises ``num_filled`` of a block its request alone holds and reports
the slots to ``BlockPool.add_filled_slots`` (what ``BlockPool.fill`` does, inlined).
"""
from __future__ import annotations

from typing import Hashable

BlockMapping = list[tuple[int, int]]
"""(source block id, destination block id) pairs of a plan's block copies, swaps and tier moves."""


class Block:
    """One physical block. `token_ids`/`parent` are kept to verify prefix hits."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "parent", "parent_gen", "generation",
                 "prev", "next", "hits", "last_access", "num_filled", "alloc_step", "cid", "parent_cid", "depth")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Hashable | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.parent: Block | None = None      # block holding the previous block of the prefix
        self.parent_gen = 0                   # the parent's generation when this block was indexed
        self.generation = 0                   # bumped each time the block loses its hash
        self.prev: Block | None = None        # links for the LRU policy
        self.next: Block | None = None
        self.hits = 0
        self.last_access = 0
        self.num_filled = 0                   # slots holding tokens (for token usage)
        self.alloc_step = 0
        # content identity (set while hashed; it moves with the content between tiers, see
        # paged.core.host_tier): cid of this registration, the parent content's cid (0: first
        # block of a prefix), and the position in the prefix chain (0: first block)
        self.cid: int | None = None
        self.parent_cid: int | None = None
        self.depth = 0

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"
