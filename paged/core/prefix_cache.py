"""Chained block hashes and verified prefix lookup.

hash(block i) = hash_fn(hash(block i-1), token ids of block i, extra keys); block 0's
parent is a seed made from the request's extra keys (cache salt, adapter name), so two
requests share KV only when their whole prefix and extra keys agree.

A hit is *verified*: the indexed block must hold exactly the same token ids, and its
recorded parent must be the block matched for the previous position, still holding
the same content (same generation). A colliding hash function can therefore cost hits
but never return wrong KV.
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Callable, Hashable, Sequence

from .block_pool import Block, BlockPool
from paged.errors import ConfigError

HashFn = Callable[[Hashable, tuple[int, ...], tuple], Hashable]


def sha256_hash(parent: Hashable, token_ids: tuple[int, ...], extra_keys: tuple) -> bytes:
    """Default: collision resistant, stable across processes."""
    h = hashlib.sha256(parent if isinstance(parent, bytes) else repr(parent).encode())
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def builtin_hash(parent: Hashable, token_ids: tuple[int, ...], extra_keys: tuple) -> int:
    """Fast: Python's tuple hash (64-bit, may collide; verification keeps it correct)."""
    return hash((parent, token_ids, extra_keys))


HASH_FUNCTIONS: dict[str, HashFn] = {"sha256": sha256_hash, "builtin": builtin_hash}


def resolve_hash_fn(hash_fn: str | HashFn) -> HashFn:
    if callable(hash_fn):
        return hash_fn
    if hash_fn not in HASH_FUNCTIONS:
        raise ConfigError(f"unknown hash function {hash_fn!r}; use one of {sorted(HASH_FUNCTIONS)} or a callable")
    return HASH_FUNCTIONS[hash_fn]


class BlockHasher:
    """Computes a request's chained block hashes incrementally (full blocks only)."""

    __slots__ = ("hash_fn", "block_size")

    def __init__(self, block_size: int, hash_fn: str | HashFn = "sha256") -> None:
        self.block_size = block_size
        self.hash_fn = resolve_hash_fn(hash_fn)

    def seed(self, extra_keys: tuple) -> Hashable:
        return self.hash_fn(b"", (), ("seed",) + tuple(extra_keys))

    def extend(self, hashes: list[Hashable], token_ids: Sequence[int], extra_keys: tuple,
               num_tokens: int) -> None:
        """Append hashes for every full block within the first `num_tokens` tokens."""
        bs = self.block_size
        parent = hashes[-1] if hashes else self.seed(extra_keys)
        for i in range(len(hashes), num_tokens // bs):
            parent = self.hash_fn(parent, tuple(token_ids[i * bs:(i + 1) * bs]), ())
            hashes.append(parent)


def find_cached_prefix(pool: BlockPool, hashes: Sequence[Hashable], token_ids: Sequence[int],
                       block_size: int, max_blocks: int) -> list[Block]:
    """Longest verified run of cached blocks for the leading full blocks (no state change)."""
    found: list[Block] = []
    parent: Block | None = None
    for i in range(min(max_blocks, len(hashes))):
        block = pool.lookup(hashes[i])
        if block is None:
            break
        if block.token_ids != tuple(token_ids[i * block_size:(i + 1) * block_size]):
            break  # hash collision: different tokens
        if block.parent is not parent or (parent is not None and block.parent_gen != parent.generation):
            break  # the block was computed after a different prefix
        found.append(block)
        parent = block
    return found
