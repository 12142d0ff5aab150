"""Chained block hashes and verified prefix lookup.

hash(block i) = hash_fn(hash(block i-1), token ids of block i, extra keys); block 0's
parent is a seed made from the request's extra keys (cache salt, adapter name), so two
requests share KV only when their whole prefix and extra keys agree.

A hit is *verified*: the indexed block must hold exactly the same token ids, and the
content it was computed after (its ``parent_cid``) must be the content matched for the
previous position (that block's ``cid``). A content id names one registration of one
block's content and is never given to another, so a parent that was evicted, reused,
or never indexed at all (a duplicate of content another block holds) cannot stand in
for the content a child was computed after. A colliding hash function can therefore
cost hits but never return wrong KV.

That is why the default hash is xxh3-128 (the ``xxhash`` package), not a cryptographic
one: a collision (two blocks with one hash) only means the second block is not indexed
or found, i.e. a lost hit, and a forged collision can do no more than that. ``"sha256"``
stays selectable (``hash_fn="sha256"``), e.g. for hashes compared across processes with
untrusted peers; ``"builtin"`` (Python's tuple hash, salted per process) is fastest. All
three take the parent hash, the block's token ids as native int64 bytes, and extra keys.
"""
from __future__ import annotations

import functools
import hashlib
import struct
from typing import Any, Callable, Hashable, Mapping, Sequence

from .block_pool import BlockPool
from paged.errors import ConfigError

try:
    import xxhash
except ImportError:  # a dependency (pyproject); an old environment falls back to sha256
    xxhash = None

HashFn = Callable[[Hashable, tuple[int, ...], tuple], Hashable]


@functools.cache
def _packer(n: int) -> struct.Struct:
    """The cached packer of ``n`` token ids as native-order int64 (one per block length)."""
    return struct.Struct(f"={n}q")


def _token_bytes(token_ids: tuple[int, ...]) -> bytes:
    """Token ids as native-order int64 bytes (what ``array("q", ids).tobytes()`` gives, ~3x faster)."""
    return _packer(len(token_ids)).pack(*token_ids)


def sha256_hash(parent: Hashable, token_ids: tuple[int, ...], extra_keys: tuple) -> bytes:
    """Collision resistant, stable across processes (32-byte digest)."""
    h = hashlib.sha256(parent if isinstance(parent, bytes) else repr(parent).encode())
    h.update(_token_bytes(token_ids))
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def xxh3_128_hash(parent: Hashable, token_ids: tuple[int, ...], extra_keys: tuple) -> bytes:
    """Default: xxh3-128 (16-byte digest), stable across processes; fast, not collision
    resistant, which verified hits make harmless (see the module docstring)."""
    data = (parent if isinstance(parent, bytes) else repr(parent).encode()) + _token_bytes(token_ids)
    if extra_keys:
        data += repr(extra_keys).encode()
    return xxhash.xxh3_128_digest(data)


def builtin_hash(parent: Hashable, token_ids: tuple[int, ...], extra_keys: tuple) -> int:
    """Fast: Python's tuple hash (64-bit, may collide; verification keeps it correct)."""
    return hash((parent, token_ids, extra_keys))


HASH_FUNCTIONS: dict[str, HashFn] = {"xxh3_128": xxh3_128_hash, "sha256": sha256_hash, "builtin": builtin_hash}
DEFAULT_HASH_FN = "xxh3_128" if xxhash is not None else "sha256"


def resolve_hash_fn(hash_fn: str | HashFn) -> HashFn:
    if callable(hash_fn):
        return hash_fn
    if hash_fn not in HASH_FUNCTIONS:
        raise ConfigError(f"unknown hash function {hash_fn!r}; use one of {sorted(HASH_FUNCTIONS)} or a callable")
    if hash_fn == "xxh3_128" and xxhash is None:
        raise ConfigError("hash_fn='xxh3_128' needs the xxhash package (pip install xxhash); "
                          "or pass hash_fn='sha256'")
    return HASH_FUNCTIONS[hash_fn]


class BlockHasher:
    """Computes a request's chained block hashes incrementally (full blocks only)."""

    __slots__ = ("hash_fn", "block_size")

    def __init__(self, block_size: int, hash_fn: str | HashFn = DEFAULT_HASH_FN) -> None:
        self.block_size = block_size
        self.hash_fn = resolve_hash_fn(hash_fn)

    def seed(self, extra_keys: tuple) -> Hashable:
        return self.hash_fn(b"", (), ("seed",) + tuple(extra_keys))

    def extend(self, hashes: list[Hashable], token_ids: Sequence[int], extra_keys: tuple,
               num_tokens: int) -> None:
        """Append hashes for every full block within the first `num_tokens` tokens."""
        bs = self.block_size
        parent = hashes[-1] if hashes else self.seed(extra_keys)
        first, last = len(hashes), num_tokens // bs
        if self.hash_fn is xxh3_128_hash:  # xxh3_128_hash inlined: the same digests, no tuple per block
            pack, digest = _packer(bs).pack, xxhash.xxh3_128_digest
            for i in range(first, last):
                parent = digest(parent + pack(*token_ids[i * bs:(i + 1) * bs]))
                hashes.append(parent)
            return
        for i in range(first, last):
            parent = self.hash_fn(parent, tuple(token_ids[i * bs:(i + 1) * bs]), ())
            hashes.append(parent)


def find_cached_prefix(pool: BlockPool, hashes: Sequence[Hashable], token_ids: Sequence[int], block_size: int,
                       max_blocks: int, host: Mapping[Hashable, Any] | None = None) -> list[Any]:
    """Longest verified run of cached blocks for the leading full blocks (no state change): each
    holds the same tokens and was computed after the content matched for the previous position
    (content ids). ``host``: the host tier's entries by hash (``HostTier.entries``), searched
    where the pool's index has no block; its ``HostBlock`` entries verify the same way."""
    found: list[Any] = []
    parent_cid = 0
    lookup = pool.index.get
    second = host.get if host else None
    for i in range(min(max_blocks, len(hashes))):
        entry = lookup(hashes[i])
        if entry is None and second is not None:
            entry = second(hashes[i])
        if entry is None or entry.parent_cid != parent_cid:
            break  # not cached, or computed after another prefix (or a hash collision)
        if entry.token_ids != tuple(token_ids[i * block_size:(i + 1) * block_size]):
            break  # hash collision: different tokens
        found.append(entry)
        parent_cid = entry.cid
    return found
