"""The order of requests: the waiting queue and the preemption victim policies.

``WaitingQueue``: FCFS (a deque, arrival order) or priority (a heap on ``priority_rank`` then
``arrival_seq``, both set by the scheduler at admission); preempted requests re-enter at the front
(FCFS) or by rank (priority). A victim policy picks which running request a full pool preempts.
"""
from __future__ import annotations

import heapq
from collections import deque
from typing import Callable, Iterator, Sequence

from .request import Request

__all__ = ["VictimPolicy", "WaitingQueue", "lowest_priority_first", "newest_first"]

VictimPolicy = Callable[[Sequence[Request], int], int]
"""Chooses a preemption victim: an index j >= start into the running list."""


def newest_first(running: Sequence[Request], start: int) -> int:
    """FCFS victim: the most recently admitted request (O(candidates), only on preemption)."""
    return max(range(start, len(running)), key=lambda i: running[i].arrival_seq)


def lowest_priority_first(running: Sequence[Request], start: int) -> int:
    """Priority victim: the worst rank (priority, aged), newest among equals."""
    return max(range(start, len(running)), key=lambda i: (running[i].priority_rank, running[i].arrival_seq))


class WaitingQueue:
    """FCFS deque or priority heap; preempted requests re-enter at the front."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[int, int, Request]] = []

    def push(self, r: Request, front: bool = False) -> None:
        if self.policy == "priority":
            heapq.heappush(self._heap, (r.priority_rank, r.arrival_seq, r))
        elif front:
            self._fifo.appendleft(r)
        else:
            self._fifo.append(r)

    def peek(self) -> Request:
        return self._heap[0][2] if self.policy == "priority" else self._fifo[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2] if self.policy == "priority" else self._fifo.popleft()

    def remove(self, r: Request) -> None:
        if self.policy == "priority":
            self._heap = [e for e in self._heap if e[2] is not r]
            heapq.heapify(self._heap)
        else:
            self._fifo.remove(r)

    def __len__(self) -> int:
        return len(self._heap) if self.policy == "priority" else len(self._fifo)

    def __iter__(self) -> Iterator[Request]:
        return (e[2] for e in sorted(self._heap, key=lambda e: e[:2])) if self.policy == "priority" \
            else iter(self._fifo)
