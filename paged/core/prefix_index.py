"""PrefixIndex: the KV manager's prefix-cache bookkeeping per request.

For each request it keeps the chained block hashes (``prefix_cache.BlockHasher``; computed once,
extended as tokens arrive), how many leading blocks of its table are indexed in the pool, and the
content id of the last of them. It finds a prompt's verified cached prefix (in the GPU pool, or in
either tier with a host tier) and indexes a table's blocks as they fill. It reads the manager's
tables and never changes them; the pool's hash index changes only through ``BlockPool.register``.

Invariants: a request's first ``num_indexed[rid]`` table blocks were offered to the index (a
block may stay unindexed when another block already holds its hash: first writer wins);
``chain_cid[rid]`` is the content id of the last of them (0: none), i.e. of the block itself when
it was indexed, else of the indexed block that holds the same tokens after the same content (a
duplicate, e.g. computed by a request that bypassed the prefix cache or swapped back in), else
None (no indexed copy: blocks indexed after it can never be a hit). So a block computed after a
duplicate is indexed as a child of the content the duplicate repeats, and stays reachable.
"""
from __future__ import annotations

from typing import Hashable, Sequence

from .block import Block
from .block_pool import BlockPool
from .host_tier import HostBlock, HostTier
from .prefix_cache import DEFAULT_HASH_FN, BlockHasher, HashFn, find_cached_prefix
from .request import Request

__all__ = ["PrefixIndex"]


class PrefixIndex:
    """Per-request hashes and indexed-block counts over one pool (see module docstring)."""

    __slots__ = ("pool", "block_size", "hasher", "host", "hashes", "num_indexed", "chain_cid")

    def __init__(self, pool: BlockPool, block_size: int, hash_fn: str | HashFn = DEFAULT_HASH_FN,
                 host: HostTier | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.hasher = BlockHasher(block_size, hash_fn)
        self.host = host                             # the host tier, when the manager keeps one
        self.hashes: dict[str, list[Hashable]] = {}  # request id -> hashes of its full blocks so far
        self.num_indexed: dict[str, int] = {}        # request id -> leading table blocks already offered
        self.chain_cid: dict[str, int | None] = {}   # request id -> content id of the last of them

    def find(self, request: Request) -> list[Block | HostBlock]:
        """Verified cached blocks for the prompt's leading full blocks, never all of its tokens
        (at least one is computed); ``HostBlock`` entries are in the host tier. No state change
        but the request's hashes."""
        hashes = self.hashes.setdefault(request.request_id, [])
        self.hasher.extend(hashes, request.token_ids, request.extra_keys, request.num_tokens)
        host = self.host.entries if self.host is not None else None
        return find_cached_prefix(self.pool, hashes, request.token_ids, self.block_size,
                                  (request.num_tokens - 1) // self.block_size, host)  # never all of the prompt

    def index_full(self, request: Request, table: Sequence[Block], end: int) -> None:
        """Offer every block of ``table`` full below position ``end`` and not offered yet to the
        pool's index, each as the child of the content before it (``chain_cid``; with a host tier,
        a block indexed under a hash the tier holds takes over the entry: one tier each)."""
        rid = request.request_id
        first, last = self.num_indexed[rid], end // self.block_size
        if first >= last:
            return
        hashes = self.hashes.setdefault(rid, [])
        self.hasher.extend(hashes, request.token_ids, request.extra_keys, end)
        bs, pool, host, tokens = self.block_size, self.pool, self.host, request.token_ids
        parent_cid = self.chain_cid[rid]
        for i in range(first, last):
            block, block_hash, ids = table[i], hashes[i], tuple(tokens[i * bs:(i + 1) * bs])
            if pool.register(block, block_hash, ids, parent_cid, rid, depth=i):
                if host is not None:
                    host.dedupe(pool, block)
                parent_cid = block.cid
            else:  # a duplicate: go on from the indexed block holding the same content, if any
                held = pool.lookup(block_hash)
                same = held is not None and parent_cid is not None and held.parent_cid == parent_cid \
                    and held.token_ids == ids
                parent_cid = held.cid if same else None
        self.num_indexed[rid] = last
        self.chain_cid[rid] = parent_cid

    def set_offered(self, request_id: str, offered: Sequence[Block] = ()) -> None:
        """The request's table starts with ``offered``, blocks that count as offered: none for a
        new table (or one swapped back in), the blocks of a prefix hit (indexed already)."""
        self.num_indexed[request_id] = len(offered)
        self.chain_cid[request_id] = offered[-1].cid if offered else 0

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares the parent's table: the same blocks are offered, the same hashes apply."""
        self.num_indexed[child_id] = self.num_indexed.get(parent_id, 0)
        self.chain_cid[child_id] = self.chain_cid.get(parent_id, 0)
        if parent_id in self.hashes:
            self.hashes[child_id] = list(self.hashes[parent_id])

    def forget(self, request_id: str) -> None:
        """Drop a request's hashes and count (it holds no blocks any more)."""
        self.hashes.pop(request_id, None)
        self.num_indexed.pop(request_id, None)
        self.chain_cid.pop(request_id, None)
