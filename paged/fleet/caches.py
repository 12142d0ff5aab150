"""Two views a router can have of one replica's prefix cache.

``PreciseCache``: rebuilt from the replica's own KV events (vLLM's protocol, decoded by
``paged.connect.wire``) into a ``paged.connect.forest.PrefixForest``; it holds exactly the blocks
the replica reported stored and not removed since (llm-d's precise prefix-cache scorer and
NVIDIA Dynamo's KV indexer work this way).

``ApproxCache``: the router's own guess, with no events at all: the full prompt blocks of every
request it sent to the replica, kept in an LRU of ``capacity_blocks`` blocks (SGLang's router
keeps such an approximate tree per worker; Dynamo has an "approximate mode"). It is wrong when
the replica evicted sooner or later than the guess, or shared blocks the router never sent.

Both answer ``match_blocks(token_ids)``: how many leading full blocks of ``token_ids`` the
replica holds (by tokens, so neither needs the replica's hash function). ``gap`` compares them.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Protocol, Sequence

from paged.connect.forest import PrefixForest
from paged.connect.wire import Batch, KVEvent, MEDIUM_GPU
from paged.errors import ConfigError


class CacheView(Protocol):
    """What a router asks of a replica's cache."""

    block_size: int

    def match_blocks(self, token_ids: Sequence[int]) -> int:
        """Leading full blocks of ``token_ids`` held (a prefix hit of that many blocks)."""
        ...

    def num_blocks(self) -> int:
        """Blocks the view believes are cached."""
        ...


def _check_block_size(block_size: int) -> int:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ConfigError(f"block_size must be a positive integer (the replica's KV block size), got {block_size!r}")
    return block_size


class PreciseCache:
    """A replica's cache as its KV-event stream rebuilds it (see the module docstring).
    Invariant: ``forest.live`` is what the stream says the replica holds on ``medium``."""

    def __init__(self, block_size: int, medium: str = MEDIUM_GPU) -> None:
        self.block_size = _check_block_size(block_size)
        self.forest = PrefixForest(medium)
        self.num_batches = 0

    def apply(self, events: Iterable[KVEvent], t: float = 0.0) -> None:
        """Apply decoded events in order at time ``t`` (seconds on the caller's clock)."""
        for e in events:
            self.forest.apply(e, t)

    def apply_batch(self, batch: Batch, t: float = 0.0) -> None:
        """Apply one decoded message; a batch after a publisher restart clears the view first
        (a restarted replica starts with an empty cache)."""
        if batch.after_restart:
            self.forest.clear(t)
        self.apply(batch.events, t)
        self.num_batches += 1

    def match_blocks(self, token_ids: Sequence[int]) -> int:
        if self.forest.block_size is None:
            return 0  # nothing reported yet
        n = 0
        for node in self.forest.match(token_ids):
            if node is None or not node.live:
                break
            n += 1
        return n

    def num_blocks(self) -> int:
        return len(self.forest.live)

    def clear(self, t: float = 0.0) -> None:
        """Forget everything (the replica went away or reset)."""
        self.forest.clear(t)


class ApproxCache:
    """The router's guess of a replica's cache (see the module docstring). Keys chain like
    block hashes: key(i) = hash((key(i-1), tokens of block i)) (Python's tuple hash of ints,
    the same in every process). Invariant: at most ``capacity_blocks`` keys; the least recently
    sent prefix goes first, a chain's last block before its first (as vLLM frees a request's
    blocks tail first)."""

    def __init__(self, block_size: int, capacity_blocks: int) -> None:
        self.block_size = _check_block_size(block_size)
        if not isinstance(capacity_blocks, int) or isinstance(capacity_blocks, bool) or capacity_blocks < 0:
            raise ConfigError(f"capacity_blocks must be an integer >= 0 (the replica's pool in blocks), "
                              f"got {capacity_blocks!r}")
        self.capacity_blocks = capacity_blocks
        self.lru: OrderedDict[int, None] = OrderedDict()   # oldest first
        self.num_evicted = 0

    def keys(self, token_ids: Sequence[int]) -> list[int]:
        """The chained key of every full block of ``token_ids``."""
        bs, out, parent = self.block_size, [], 0
        for i in range(len(token_ids) // bs):
            parent = hash((parent, tuple(token_ids[i * bs:(i + 1) * bs])))
            out.append(parent)
        return out

    def match_blocks(self, token_ids: Sequence[int]) -> int:
        n = 0
        for k in self.keys(token_ids):
            if k not in self.lru:
                break
            n += 1
        return n

    def record(self, token_ids: Sequence[int]) -> None:
        """The router sent ``token_ids`` here: its full blocks are (about to be) cached."""
        lru = self.lru
        for k in reversed(self.keys(token_ids)):  # the first block ends most recent
            if k in lru:
                lru.move_to_end(k)
            else:
                lru[k] = None
        while len(lru) > self.capacity_blocks:
            lru.popitem(last=False)
            self.num_evicted += 1

    def num_blocks(self) -> int:
        return len(self.lru)

    def clear(self) -> None:
        self.lru.clear()


def gap(precise: CacheView, approx: CacheView, prompts: Iterable[Sequence[int]]) -> dict[str, float]:
    """How far the guess is from the stream over ``prompts``: blocks the guess over- and
    under-counts (summed over prompts), and the fraction of prompts where both agree."""
    over = under = same = n = 0
    for p in prompts:
        a, b = approx.match_blocks(p), precise.match_blocks(p)
        over += max(0, a - b)
        under += max(0, b - a)
        same += a == b
        n += 1
    return {"prompts": n, "over_blocks": over, "under_blocks": under, "agree": same / n if n else float("nan")}
