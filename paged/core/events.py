"""Event records: every state change of the cache manager and scheduler is one row.

A `Recorder` appends plain tuples (cheap: no object per event); `paged.telemetry`
turns them into pandas DataFrames. `NullRecorder` drops everything, for benchmarks.
"""
from __future__ import annotations

from typing import AbstractSet, NamedTuple

# Event kinds (the `kind` column).
ALLOCATE = "allocate"      # a block was taken from the free queue for a request
FREE = "free"              # a block's ref count reached 0 (value: 1 if it stays cached)
PREFIX_HIT = "prefix_hit"  # a request reused a cached block (value: tokens in the block)
EVICT = "evict"            # a cached-free block lost its hash to be reused
CACHE_BLOCK = "cache_block"  # a full block was registered in the prefix index
FORK = "fork"              # a request now shares all blocks of another (value: blocks shared)
COW = "cow"                # a shared block was copied before a write (block_id: dst, value: src)
SWAP_OUT = "swap_out"      # value: blocks moved to the CPU pool
SWAP_IN = "swap_in"        # value: blocks moved back to the GPU pool
PREEMPT = "preempt"        # value: 0 = recompute, 1 = swap
ADMIT = "admit"            # a waiting request was scheduled for the first time (or resumed)
FINISH = "finish"          # value: output tokens
ABORT = "abort"
STEP = "step"              # value: tokens scheduled in the step
ALLOC_LATENCY = "alloc_latency"  # value: nanoseconds spent in one allocate_slots call
RESET = "reset"
TIER_OUT = "tier_out"      # a cached-free block's content moved to the host tier (block_id: GPU, value: CPU block)
TIER_IN = "tier_in"        # a host-tier hit brought content back (block_id: new GPU block, value: CPU block)
HOST_EVICT = "host_evict"  # a host-tier entry was dropped for room (value: its CPU block)
COMPACT = "compact"          # block compaction moved a live block (block_id: dst, value: src)

PREEMPT_RECOMPUTE = 0
PREEMPT_SWAP = 1


class Event(NamedTuple):
    step: int
    kind: str
    request_id: str | None
    block_id: int | None
    value: int | None


class _EveryKind:
    """A container holding every event kind (what a recording ``Recorder`` hears)."""

    def __contains__(self, kind: object) -> bool:
        return True


EVERY_KIND = _EveryKind()


class Recorder:
    """Keeps events in order. `step` is set by the scheduler at the start of each step.
    ``hears``: the kinds whose ``emit`` does anything; a hot emitter may test ``kind in
    recorder.hears`` and skip the call (and the work of its arguments) otherwise."""

    __slots__ = ("events", "step", "hears")

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.step = 0
        self.hears: AbstractSet[str] | _EveryKind = EVERY_KIND

    def emit(self, kind: str, request_id: str | None = None,
             block_id: int | None = None, value: int | None = None) -> None:
        self.events.append((self.step, kind, request_id, block_id, value))

    def __len__(self) -> int:
        return len(self.events)

    def since(self, index: int) -> list[Event]:
        """Events recorded at or after position `index` (e.g. one step's events)."""
        return [Event(*e) for e in self.events[index:]]

    def clear(self) -> None:
        self.events.clear()


class NullRecorder(Recorder):
    """A recorder that keeps nothing (it hears no kind)."""

    def __init__(self) -> None:
        super().__init__()
        self.hears = frozenset()

    def emit(self, kind: str, request_id: str | None = None,
             block_id: int | None = None, value: int | None = None) -> None:
        return None
