"""SwapSpace: the CPU block pool's accounting (ids only; the K/V bytes live with the executor).

Two users share one pool of ``num_blocks`` CPU block ids: preemption by swap (a swapped-out
request's blocks, in table order, with the slots each held) and the host tier
(``paged.core.host_tier``), which takes and returns ids of the same ``free`` list.

Invariants (``check``): a CPU id is free or held by exactly one swapped-out request (or, with a
host tier, by one of its entries or released this step: ``HostTier.check`` counts those).
"""
from __future__ import annotations

from typing import Sequence

from paged.errors import BlockStateError, ConfigError, UnknownRequestError

__all__ = ["SwapSpace"]


class SwapSpace:
    """CPU block ids: a free stack and the blocks each swapped-out request holds."""

    __slots__ = ("num_blocks", "free", "_held", "holds")

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise ConfigError(f"num_cpu_blocks must be an integer >= 0, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # taken from the end; shared with the host tier
        self._held: dict[str, list[tuple[int, int]]] = {}           # request id -> [(cpu block, num_filled)]
        self.holds = self._held.__contains__  # holds(request_id): whether it is swapped out (a C call: hot)

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free)

    def request_ids(self) -> list[str]:
        """Swapped-out requests, in the order they were swapped out."""
        return list(self._held)

    def blocks_of(self, request_id: str) -> list[int]:
        """The CPU block ids ``request_id`` holds, in table order."""
        return [cpu for cpu, _ in self._saved(request_id)]

    def num_blocks_of(self, request_id: str) -> int:
        return len(self._saved(request_id))

    # ---- moves ---------------------------------------------------------------------------
    def store(self, request_id: str, num_filled: Sequence[int]) -> list[int]:
        """Take one free CPU block per entry of ``num_filled`` (a table's fills, in order) for
        ``request_id``; returns their ids. The caller checked ``num_free`` first."""
        if len(num_filled) > len(self.free):
            raise BlockStateError(f"swap of {len(num_filled)} blocks with {len(self.free)} CPU blocks free; "
                              "check num_free first")
        saved = self._held[request_id] = [(self.free.pop(), n) for n in num_filled]
        return [cpu for cpu, _ in saved]

    def take(self, request_id: str) -> list[tuple[int, int]]:
        """Forget ``request_id``'s blocks (it is swapped back in) and return its (cpu block,
        num_filled) pairs in table order; the ids are NOT freed (the caller releases them once
        the copies that read them are applied)."""
        self._saved(request_id)  # UnknownRequestError when not swapped out
        return self._held.pop(request_id)

    def give_back(self, cpu_blocks: Sequence[int]) -> None:
        """Return CPU blocks taken by ``take`` to the free stack."""
        self.free.extend(cpu_blocks)

    def release(self, request_id: str) -> None:
        """Free every CPU block of ``request_id`` (it finished or was aborted while swapped out)."""
        self.free.extend(cpu for cpu, _ in reversed(self.take(request_id)))

    def _saved(self, request_id: str) -> list[tuple[int, int]]:
        try:
            return self._held[request_id]
        except KeyError:
            raise UnknownRequestError(f"request {request_id!r} is not swapped out") from None

    # ---- checks --------------------------------------------------------------------------
    def held_blocks(self) -> list[int]:
        """Every CPU block id a swapped-out request holds (O(blocks); for checks)."""
        return [cpu for saved in self._held.values() for cpu, _ in saved]

    def check(self) -> None:
        """Assert the invariants without a host tier (O(blocks); for tests)."""
        held = self.held_blocks()
        assert len(set(held)) == len(held)
        assert len(held) + len(self.free) == self.num_blocks
        assert not set(held) & set(self.free)
