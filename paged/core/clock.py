"""The step loop's clocks: ``EngineClock`` measures engine work, ``SimulatedClock`` adds modelled time.

Both answer ``start()`` (a step begins: its start), ``stop(duration_s)`` (it ends: its end) and
``now()``; the loop (``paged.core.loop``) reads only these three.

``EngineClock``: seconds of engine work, not of wall time. Every time an ``LLMEngine`` records (a request's arrival, first token and finish; a step's start)
is read from its ``EngineClock``, which advances only while ``step()`` runs. Time a caller spends
between steps -- a paused dashboard, a slowed-down replay, a debugger, a notebook cell that does
something else -- is not engine time and never enters TTFT, TBT or e2e. A request added between
steps arrives at the end of the last step; one that waits because the engine is busy waits inside
steps, so queueing is counted. Driven back to back (``LLM.generate``, a serving loop) the clock
and the wall clock agree.

Invariant: ``now()`` never decreases; between steps it stands still.
"""
from __future__ import annotations

import time

__all__ = ["EngineClock", "SimulatedClock"]


class EngineClock:
    """``with clock.running(): ...`` around a step; ``now()`` anywhere."""

    __slots__ = ("_done", "_since")

    def __init__(self) -> None:
        self._done = 0.0             # engine seconds of the steps that ended
        self._since: float | None = None  # perf_counter at the start of the step running now

    def now(self) -> float:
        since = self._since
        return self._done if since is None else self._done + (time.perf_counter() - since)

    def start(self) -> float:
        """The step begins; returns its start on the engine clock."""
        self._since = time.perf_counter()
        return self._done

    def stop(self, duration_s: float | None = None) -> float:
        """The step ends; returns its end on the engine clock (measured: ``duration_s`` unused)."""
        if self._since is not None:
            self._done += time.perf_counter() - self._since
            self._since = None
        return self._done


class SimulatedClock:
    """Modelled time: a step lasts the ``duration_s`` its executor modelled; between steps the
    simulator moves the clock to the next arrival (``advance_to``). Invariant: never decreases."""

    __slots__ = ("t",)

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def now(self) -> float:
        return self.t

    def start(self) -> float:
        return self.t

    def stop(self, duration_s: float | None = None) -> float:
        if duration_s:
            self.t += duration_s
        return self.t

    def advance_to(self, t: float) -> None:
        """Jump to ``t`` (>= ``now()``: the next arrival while nothing runs)."""
        self.t = t
