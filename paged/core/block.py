"""Block: one physical KV block (id, ref count, hash, and the tokens and content ids that verify a prefix hit).

Data only: ``BlockPool`` owns every state change of a block (eviction policies, its parts, link and
order cached-free blocks through ``prev``/``next``/``hits``/``last_access``).
"""
from __future__ import annotations

from typing import Hashable

BlockMapping = list[tuple[int, int]]
"""(source block id, destination block id) pairs of a plan's block copies, swaps and tier moves."""


class Block:
    """One physical block. While indexed, `token_ids` and `cid`/`parent_cid` verify prefix hits."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "prev", "next", "hits", "last_access",
                 "num_filled", "alloc_step", "cid", "parent_cid", "depth")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Hashable | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.prev: Block | None = None        # links for the LRU policy
        self.next: Block | None = None
        self.hits = 0
        self.last_access = 0
        self.num_filled = 0                   # slots holding tokens (for token usage)
        self.alloc_step = 0
        # content identity, set while hashed (None otherwise): cid names this registration and
        # is never given to another (it moves with the content between tiers, see
        # paged.core.host_tier); parent_cid is the cid of the content this block's K/V was
        # computed after (0: first block of a prefix; None: unknown, so never a hit); depth is
        # the position in the prefix chain (0: first block)
        self.cid: int | None = None
        self.parent_cid: int | None = None
        self.depth = 0

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"
