"""Eviction policies for cached-free blocks (ref count 0, still holding a hashed prefix).

A policy holds exactly the cached-free blocks. `add` when a hashed block's ref count
drops to 0, `remove` when a prefix hit revives it, `pop` to choose a victim.

- `LRUPolicy`: an intrusive doubly-linked list; add/remove/pop are O(1).
- `LFUPolicy`: fewest hits first, then least recent; a heap with lazy deletion, O(log n).
- `WeightedPolicy`: score = hits x decay**(age); lowest score first. The order of two
  scores does not change as time passes (both decay by the same factor), so the key
  log(hits) + last_access x log(1/decay) is fixed and a heap works; O(log n).
- `ScorePolicy`: the seeds' score "access frequency x time decay + block size x size weight",
  lowest first (see its docstring for what "size" is for a fixed-size block); O(log n + depths).

`make_policy` takes a name or a spec with parameters: "score:decay=0.999,size_weight=-0.5".
"""
from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING, Protocol

from paged.errors import ConfigError

if TYPE_CHECKING:
    from .block import Block


class EvictionPolicy(Protocol):
    def add(self, block: "Block") -> None: ...
    def remove(self, block: "Block") -> None: ...
    def pop(self) -> "Block": ...
    def __len__(self) -> int: ...
    def __iter__(self): ...


class LRUPolicy:
    """Least recently freed first. Blocks link through their own `prev`/`next` fields."""

    __slots__ = ("_head", "_tail", "_len")

    def __init__(self) -> None:
        self._head: Block | None = None  # oldest: evicted first
        self._tail: Block | None = None
        self._len = 0

    def add(self, block: "Block") -> None:
        block.prev, block.next = self._tail, None
        if self._tail is None:
            self._head = block
        else:
            self._tail.next = block
        self._tail = block
        self._len += 1

    def remove(self, block: "Block") -> None:
        if block.prev is None:
            self._head = block.next
        else:
            block.prev.next = block.next
        if block.next is None:
            self._tail = block.prev
        else:
            block.next.prev = block.prev
        block.prev = block.next = None
        self._len -= 1

    def pop(self) -> "Block":
        block = self._head
        assert block is not None, "pop from an empty LRU"
        nxt = block.next  # remove(block) for the head, inlined (the eviction hot path)
        self._head = nxt
        if nxt is None:
            self._tail = None
        else:
            nxt.prev = None
        block.next = None
        self._len -= 1
        return block

    def __len__(self) -> int:
        return self._len

    def __iter__(self):
        node = self._head
        while node is not None:
            yield node
            node = node.next


class _HeapPolicy:
    """A heap of (key, tiebreak, block) with lazy deletion of stale entries."""

    __slots__ = ("_heap", "_members", "_counter")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Block]] = []
        self._members: dict[int, int] = {}  # block_id -> tiebreak of its live entry
        self._counter = 0

    def key(self, block: "Block") -> float:
        raise NotImplementedError

    def add(self, block: "Block") -> None:
        self._counter += 1
        self._members[block.block_id] = self._counter
        heapq.heappush(self._heap, (self.key(block), self._counter, block))
        if len(self._heap) > 2 * len(self._members) + 64:  # mostly stale entries: drop them
            self._heap = [e for e in self._heap if self._members.get(e[2].block_id) == e[1]]
            heapq.heapify(self._heap)

    def remove(self, block: "Block") -> None:
        del self._members[block.block_id]

    def pop(self) -> "Block":
        while True:
            _, tiebreak, block = heapq.heappop(self._heap)
            if self._members.get(block.block_id) == tiebreak:
                del self._members[block.block_id]
                return block

    def __len__(self) -> int:
        return len(self._members)

    def __iter__(self):
        return (e[2] for e in sorted(self._heap) if self._members.get(e[2].block_id) == e[1])


class LFUPolicy(_HeapPolicy):
    """Fewest prefix hits first; ties go to the least recently used."""

    def key(self, block: "Block") -> float:
        return block.hits + block.last_access * 1e-12  # hits dominate, recency breaks ties


class WeightedPolicy(_HeapPolicy):
    """Frequency x recency decay: score = hits * decay**(now - last_access)."""

    def __init__(self, decay: float = 0.99) -> None:
        super().__init__()
        if not 0.0 < decay < 1.0:
            raise ConfigError(f"decay must be in (0, 1), got {decay}; e.g. 0.99")
        self._log_inv_decay = -math.log(decay)

    def key(self, block: "Block") -> float:
        return math.log(block.hits + 1) + block.last_access * self._log_inv_decay


class ScorePolicy:
    """The seeds' score, lowest evicted first:

        score = freq_weight x (hits + 1) x decay**(now - last_access) + size_weight x depth

    ``hits + 1`` is the access frequency (the computation that filled the block, plus each
    prefix hit), ``now - last_access`` the age on the pool's clock (one tick per allocation,
    hit or free), ``decay`` in (0, 1).

    "Block size" for a fixed-size block: every block the policy holds is full (only full blocks
    are hashed), so its filled-token count is the same for all and could not rank anything.
    We take ``depth``, the block's position in its prefix chain (0 = first block), i.e. the
    prefix length a hit through it reuses, in blocks. ``size_weight > 0`` (the seeds' sign:
    big is worth keeping) keeps long prefixes' deep blocks; ``size_weight < 0`` evicts deep
    blocks first, the leaves of the prefix tree, so a cached child rarely outlives its
    parent (a child without its parent can never be hit). Both are measured in
    ``paged.studies.host_tier``.

    The first term decays with time and the second does not, so the order of two blocks can
    change as time passes: one heap per depth (within a depth the order is fixed, as in
    ``WeightedPolicy``), and ``pop`` compares the tops of the depths at ``now`` (the latest
    ``last_access`` seen). O(log n + number of depths) per pop, O(log n) per add.
    """

    __slots__ = ("freq_weight", "decay", "size_weight", "_log_inv_decay", "_groups", "_members",
                 "_counter", "_now")

    def __init__(self, freq_weight: float = 1.0, decay: float = 0.999, size_weight: float = -0.5) -> None:
        if not 0.0 < decay < 1.0:
            raise ConfigError(f"decay must be in (0, 1), got {decay}; e.g. 0.999")
        if not freq_weight > 0 or math.isinf(freq_weight):  # 0 would leave each depth's heap order meaningless
            raise ConfigError(f"freq_weight must be a finite number > 0, got {freq_weight}; "
                              "a larger size_weight weighs depth more")
        if math.isnan(size_weight) or math.isinf(size_weight):
            raise ConfigError(f"size_weight must be a finite number, got {size_weight}")
        self.freq_weight, self.decay, self.size_weight = float(freq_weight), float(decay), float(size_weight)
        self._log_inv_decay = -math.log(decay)
        self._groups: dict[int, list[tuple[float, int, Block]]] = {}   # depth -> heap
        self._members: dict[int, int] = {}                              # block_id -> live tiebreak
        self._counter = 0
        self._now = 0

    def score(self, block: "Block") -> float:
        age = self._now - block.last_access
        return (self.freq_weight * (block.hits + 1) * math.exp(-self._log_inv_decay * max(age, 0))
                + self.size_weight * block.depth)

    def add(self, block: "Block") -> None:
        self._counter += 1
        self._members[block.block_id] = self._counter
        self._now = max(self._now, block.last_access)
        heap = self._groups.setdefault(block.depth, [])
        heapq.heappush(heap, (math.log(block.hits + 1) + block.last_access * self._log_inv_decay,
                              self._counter, block))
        if len(heap) > 2 * len(self._members) + 64:
            self._groups[block.depth] = [e for e in heap if self._members.get(e[2].block_id) == e[1]]
            heapq.heapify(self._groups[block.depth])

    def remove(self, block: "Block") -> None:
        del self._members[block.block_id]

    def _top(self, depth: int) -> "Block | None":
        heap = self._groups[depth]
        while heap and self._members.get(heap[0][2].block_id) != heap[0][1]:
            heapq.heappop(heap)
        if not heap:
            del self._groups[depth]
            return None
        return heap[0][2]

    def pop(self) -> "Block":
        best, best_key = None, None
        for depth in list(self._groups):
            b = self._top(depth)
            if b is not None:
                key = (self.score(b), b.last_access)
                if best_key is None or key < best_key:
                    best, best_key = b, key
        assert best is not None, "pop from an empty ScorePolicy"
        heapq.heappop(self._groups[best.depth])
        del self._members[best.block_id]
        return best

    def __len__(self) -> int:
        return len(self._members)

    def __iter__(self):
        live = [e[2] for h in self._groups.values() for e in h if self._members.get(e[2].block_id) == e[1]]
        return iter(sorted(live, key=lambda b: (self.score(b), b.last_access)))


POLICIES = {"lru": LRUPolicy, "lfu": LFUPolicy, "weighted": WeightedPolicy, "score": ScorePolicy}


def make_policy(name: str | EvictionPolicy) -> EvictionPolicy:
    """'lru' (default), 'lfu', 'weighted' or 'score', optionally with parameters after a colon
    ("weighted:decay=0.95", "score:decay=0.999,size_weight=-0.5,freq_weight=1"); or an object
    implementing EvictionPolicy (used as is: one object per pool)."""
    if not isinstance(name, str):
        return name
    kind, _, params = name.partition(":")
    kind = kind.strip()
    if kind not in POLICIES:
        raise ConfigError(f"unknown eviction policy {name!r}; use one of {sorted(POLICIES)}")
    kw: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in params.split(","))):
        key, eq, value = part.partition("=")
        try:
            kw[key.strip()] = float(value)
        except ValueError:
            eq = ""
        if not eq:
            raise ConfigError(f"eviction policy {name!r}: parameters are name=number pairs separated by "
                              "commas, e.g. 'score:decay=0.999,size_weight=-0.5'")
    try:
        return POLICIES[kind](**kw)
    except TypeError:
        raise ConfigError(f"eviction policy {name!r}: unknown parameter(s) {sorted(kw)} for {kind!r}") from None
