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
from itertools import takewhile
from typing import Container, Iterable, Protocol, Sequence

from paged.connect.forest import PrefixForest
from paged.connect.wire import AllBlocksCleared, Batch, BlockRemoved, BlockStored, KVEvent, MEDIUM_GPU
from paged.errors import ConfigError


def chain_keys(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained key of every full block: key(i) = hash((key(i-1), tokens of block i)), key(-1) = 0
    (Python's tuple hash of ints: the same in every process; a 64-bit collision costs a wrong
    guess of one block, never wrong KV, since a view only advises the router)."""
    out, parent = [], 0
    for i in range(len(token_ids) // block_size):
        parent = hash((parent, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        out.append(parent)
    return out


class CacheView(Protocol):
    """What a router asks of a replica's cache."""

    block_size: int

    def match_keys(self, keys: Sequence[int]) -> int:
        """Leading keys (``chain_keys`` of a prompt) held: a prefix hit of that many blocks."""
        ...

    def match_blocks(self, token_ids: Sequence[int]) -> int:
        """``match_keys`` of ``token_ids``' chain keys."""
        ...

    def num_blocks(self) -> int:
        """Blocks the view believes are cached."""
        ...


def _check_block_size(block_size: int) -> int:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ConfigError(f"block_size must be a positive integer (the replica's KV block size), got {block_size!r}")
    return block_size


class _KeyMatch:
    """``match_blocks`` and ``match_keys`` over the view's key container ``_known()`` (both views)."""

    block_size: int

    def _known(self) -> Container[int]:
        raise NotImplementedError

    def match_keys(self, keys: Sequence[int]) -> int:
        """Leading keys the view holds (counted at C speed: ``takewhile`` of the container's test)."""
        return len(list(takewhile(self._known().__contains__, keys)))

    def match_blocks(self, token_ids: Sequence[int]) -> int:
        return self.match_keys(chain_keys(token_ids, self.block_size))


class PreciseCache(_KeyMatch):
    """A replica's cache as its KV-event stream rebuilds it (see the module docstring).

    Each stored block gets the chain key of its tokens under its parent's key (the replica's own
    hashes name blocks in the stream; keys make views of replicas with different hash functions
    comparable). Invariant: ``live`` maps the key of every block stored and not removed since to
    its hash; with ``keep_forest`` the same events also build a ``PrefixForest`` (history, views),
    whose ``live`` set is then exactly ``set(live.values())``."""

    def __init__(self, block_size: int, medium: str = MEDIUM_GPU, keep_forest: bool = True) -> None:
        self.block_size = _check_block_size(block_size)
        self.medium = medium
        self.forest = PrefixForest(medium) if keep_forest else None
        self.live: dict[int, object] = {}         # chain key -> block hash
        self.key_of: dict[object, int] = {}      # block hash -> chain key (live blocks)
        self.num_batches = 0
        self.num_events = 0        # decoded events applied
        self.num_stored = 0        # blocks stored (through events or ``store``)
        self.num_removed = 0       # live blocks removed

    def apply(self, events: Iterable[KVEvent], t: float = 0.0) -> None:
        """Apply decoded events in order at time ``t`` (seconds on the caller's clock)."""
        for e in events:
            self.num_events += 1
            if self.forest is not None:
                self.forest.apply(e, t)
            if isinstance(e, AllBlocksCleared):
                self.live.clear()
                self.key_of.clear()
            elif (e.medium or MEDIUM_GPU) != self.medium:
                continue
            elif isinstance(e, BlockStored):
                for h, parent, tokens in e.blocks():
                    self.store(h, parent, tokens)
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    self.remove(h)

    def store(self, h: object, parent: object, tokens: Sequence[int]) -> None:
        """One block of a ``BlockStored`` (``apply`` calls it per block; an in-process publisher
        may call it directly, without the forest)."""
        pkey = 0 if parent is None else self.key_of.get(parent)
        if pkey is None:
            pkey = hash(("unknown parent", parent))   # joined late: matches nothing we route
        key = hash((pkey, tuple(tokens)))
        self.key_of[h] = key
        self.live[key] = h
        self.num_stored += 1

    def remove(self, h: object) -> None:
        """One hash of a ``BlockRemoved``."""
        key = self.key_of.pop(h, None)
        if key is not None and self.live.get(key) == h:
            del self.live[key]
            self.num_removed += 1

    def apply_batch(self, batch: Batch, t: float = 0.0) -> None:
        """Apply one decoded message; a batch after a publisher restart clears the view first
        (a restarted replica starts with an empty cache)."""
        if batch.after_restart:
            self.apply([AllBlocksCleared()], t)
        self.apply(batch.events, t)
        self.num_batches += 1

    def _known(self) -> Container[int]:
        return self.live

    def num_blocks(self) -> int:
        return len(self.live)

    def clear(self, t: float = 0.0) -> None:
        """Forget everything (the replica went away or reset)."""
        self.apply([AllBlocksCleared()], t)


class ApproxCache(_KeyMatch):
    """The router's guess of a replica's cache (see the module docstring), by ``chain_keys``.
    Invariant: at most ``capacity_blocks`` keys; the least recently sent prefix goes first, a
    chain's last block before its first (as vLLM frees a request's blocks tail first)."""

    def __init__(self, block_size: int, capacity_blocks: int) -> None:
        self.block_size = _check_block_size(block_size)
        if not isinstance(capacity_blocks, int) or isinstance(capacity_blocks, bool) or capacity_blocks < 0:
            raise ConfigError(f"capacity_blocks must be an integer >= 0 (the replica's pool in blocks), "
                              f"got {capacity_blocks!r}")
        self.capacity_blocks = capacity_blocks
        self.lru: OrderedDict[int, None] = OrderedDict()   # oldest first
        self.num_evicted = 0

    def _known(self) -> Container[int]:
        return self.lru

    def record(self, token_ids: Sequence[int], keys: Sequence[int] | None = None) -> None:
        """The router sent ``token_ids`` here (``keys``: their chain keys, if computed): its full
        blocks are (about to be) cached."""
        lru = self.lru
        for k in reversed(chain_keys(token_ids, self.block_size) if keys is None else keys):
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
