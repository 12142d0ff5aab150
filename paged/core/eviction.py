"""Eviction policies for cached-free blocks (ref count 0, still holding a hashed prefix).

A policy holds exactly the cached-free blocks. `add` when a hashed block's ref count
drops to 0, `remove` when a prefix hit revives it, `pop` to choose a victim.

- `LRUPolicy`: an intrusive doubly-linked list; add/remove/pop are O(1).
- `LFUPolicy`: fewest hits first, then least recent; a heap with lazy deletion, O(log n).
- `WeightedPolicy`: score = hits x decay**(age); lowest score first. The order of two
  scores does not change as time passes (both decay by the same factor), so the key
  log(hits) + last_access x log(1/decay) is fixed and a heap works; O(log n).
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
        self.remove(block)
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
        if len(self._heap) > 2 * len(self._members) + 64:
            self._compact()

    def remove(self, block: "Block") -> None:
        del self._members[block.block_id]

    def pop(self) -> "Block":
        while True:
            _, tiebreak, block = heapq.heappop(self._heap)
            if self._members.get(block.block_id) == tiebreak:
                del self._members[block.block_id]
                return block

    def _compact(self) -> None:
        self._heap = [e for e in self._heap if self._members.get(e[2].block_id) == e[1]]
        heapq.heapify(self._heap)

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


def make_policy(name: str | EvictionPolicy) -> EvictionPolicy:
    """'lru' (default), 'lfu' or 'weighted'; or an object implementing EvictionPolicy."""
    if not isinstance(name, str):
        return name
    policies = {"lru": LRUPolicy, "lfu": LFUPolicy, "weighted": WeightedPolicy}
    if name not in policies:
        raise ConfigError(f"unknown eviction policy {name!r}; use one of {sorted(policies)}")
    return policies[name]()
