"""The benchmarks' one timing harness: clocks, interleaved rounds, best/median summaries, tables.

Why these clocks, on a shared machine with 2 busy cores:

- ``thread_s``/``thread_ns`` (``time.thread_time``): CPU time of this thread only. Time the OS
  gives to other processes does not count (a wall clock would), so it is the default for work
  that runs on the calling thread (``OMP_NUM_THREADS=1``). Reading it costs ~0.7 µs: read it
  once per timed run of many operations, never per operation.
- ``process_s`` (``time.process_time``): CPU time of every thread of this process, for systems
  that run their own threads (transformers' continuous batching).
- ``wall_s`` (``time.perf_counter``): what a user waits; for device work (with a ``sync``) and
  for the ratio of two things that share the same noise.

Why interleaved rounds: systems compared side by side take turns within every round
(:func:`interleave`, :func:`best_of`), so a neighbour's burst slows all of them alike; a ratio is
taken per round and its median and range reported (:func:`spread`), and a sweep over sizes
(:class:`Rows`) keeps every round's value so a table can show the best and the median.

Resident state (:class:`ResidentGC`): state a benchmark builds once and then times against is
built with the cyclic collector paused and then frozen (``gc.freeze()``, as a long-running
server does after start-up), and timed paths run with the collector on; modes "on"/"off" keep
the collector on/off everywhere.
"""
from __future__ import annotations

import csv
import gc
import math
import statistics
import time
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator, Mapping, Sequence, TypeVar

__all__ = ["thread_s", "thread_ns", "process_s", "wall_s", "cpu_and_wall", "timed", "best_of", "interleave",
           "rotated", "spread", "per_unit", "label", "fmt", "Row", "Rows", "format_sweep", "write_csv",
           "ResidentGC"]

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

thread_s = time.thread_time
thread_ns = time.thread_time_ns
process_s = time.process_time
wall_s = time.perf_counter


def cpu_and_wall() -> tuple[float, float]:
    """(this thread's CPU seconds, wall seconds) now: subtract two readings for both durations."""
    return time.thread_time(), time.perf_counter()


def timed(fn: Callable[[], T], clock: Callable[[], float] = thread_s) -> tuple[float, T]:
    """(seconds of ``clock`` spent in one call of ``fn``, what it returned)."""
    t0 = clock()
    out = fn()
    return clock() - t0, out


def best_of(fns: Sequence[Callable[[], Any]], rounds: int, *, warmup: int = 0,
            clock: Callable[[], float] = thread_s, sync: Callable[[], None] | None = None
            ) -> tuple[list[float], list[Any]]:
    """Best (smallest) seconds of one call of each of ``fns`` over ``rounds`` rounds, and each
    fn's last result. The fns take turns within every round, after ``warmup`` untimed calls
    each (allocator and thread-pool set-up); ``sync`` (e.g. a CUDA synchronize) runs before and
    after each timed call."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    best = [math.inf] * len(fns)
    last: list[Any] = [None] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            if sync is not None:
                sync()
            t0 = clock()
            last[i] = fn()
            if sync is not None:
                sync()
            best[i] = min(best[i], clock() - t0)
    return best, last


def rotated(items: Sequence[T], r: int) -> list[T]:
    """``items`` starting at position ``r`` (mod len): round r's order in a rotating schedule."""
    k = r % len(items)
    return list(items[k:]) + list(items[:k])


def interleave(systems: Mapping[K, Callable[[], T]], rounds: int, *, order: str = "alternate") -> dict[K, list[T]]:
    """Call every system once per round and keep what each returns, one value per round.

    ``order="alternate"``: forward on even rounds, reversed on odd ones (two systems: each goes
    first half the time); ``"rotate"``: round r starts at the r-th system."""
    if order not in ("alternate", "rotate"):
        raise ValueError(f"order must be 'alternate' or 'rotate', got {order!r}")
    keys = list(systems)
    got: dict[K, list[T]] = {k: [] for k in keys}
    for r in range(rounds):
        seq = (keys if r % 2 == 0 else keys[::-1]) if order == "alternate" else rotated(keys, r)
        for k in seq:
            got[k].append(systems[k]())
    return got


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max): a per-round ratio's value and its noise."""
    return statistics.median(values), min(values), max(values)


def per_unit(samples: Sequence[tuple[float, int]], min_units: int) -> list[float]:
    """(time, units) per call -> time per unit of each run of at least ``min_units`` units (a
    short tail is dropped unless it is all there is): per-unit costs without reading a clock
    per unit."""
    out: list[float] = []
    t = b = 0
    for dt, n in samples:
        t, b = t + dt, b + n
        if b >= min_units:
            out.append(t / b)
            t = b = 0
    if not out and b:
        out.append(t / b)
    return out


def label(n: int) -> str:
    """1000 -> '1k', 1000000 -> '1M', other numbers as they are."""
    if n >= 1_000_000 and n % 1_000_000 == 0:
        return f"{n // 1_000_000}M"
    return f"{n // 1000}k" if n >= 1000 and n % 1000 == 0 else str(n)


def fmt(v: float) -> str:
    """A table cell: thousands separators from 100 up, 3 significant digits below."""
    return f"{v:,.0f}" if v >= 100 else f"{v:.2f}" if v < 10 else f"{v:.1f}"


@dataclass
class Row:
    """One measured case of a sweep: per column (a size), one value per round."""

    section: str
    case: str
    unit: str
    samples: dict[int, list[float]] = field(default_factory=dict)
    note: str = ""

    def add(self, size: int, value: float) -> None:
        self.samples.setdefault(size, []).append(value)

    def median(self, size: int) -> float:
        return statistics.median(self.samples[size])

    def min(self, size: int) -> float:
        return min(self.samples[size])


class Rows(dict):
    """Ordered (section, case) -> Row, plus notes printed under the table."""

    def __init__(self) -> None:
        super().__init__()
        self.notes: list[str] = []

    def get_row(self, section: str, case: str, unit: str, note: str = "") -> Row:
        key = (section, case)
        if key not in self:
            self[key] = Row(section, case, unit, note=note)
        return self[key]


def format_sweep(rows: Rows, columns: Callable[[str], Sequence[int]], header: Callable[[str], str]) -> list[str]:
    """Per section: best-of-rounds values per column, then the ratio last/first column of the
    best and of the median rounds (~1.0: flat in the swept size). ``columns(section)`` gives a
    section's columns, ``header(section)`` its title."""
    lines: list[str] = []
    w = max(len(r.case) for r in rows.values()) + 2
    for sec in dict.fromkeys(r.section for r in rows.values()):
        cols = list(columns(sec))
        ratio = f"{label(cols[-1])}/{label(cols[0])}"
        lines.append("")
        lines.append(f"{header(sec):<{w}}" + "".join(f"{label(c):>9}" for c in cols) + f"{ratio:>9}{'(median)':>10}")
        lines.append("-" * (w + 9 * len(cols) + 19))
        for row in (r for r in rows.values() if r.section == sec):
            best = [row.min(c) if c in row.samples else math.nan for c in cols]
            med = [row.median(c) if c in row.samples else math.nan for c in cols]
            r_best = best[-1] / best[0] if best[0] > 0 else math.nan
            r_med = med[-1] / med[0] if med[0] > 0 else math.nan
            lines.append(f"{row.case:<{w}}" + "".join(f"{fmt(v):>9}" for v in best) + f"{r_best:>9.2f}{r_med:>10.2f}")
    return lines


def write_csv(rows: Rows, path: str) -> None:
    """Every measurement: section, case, unit, size, median and min over rounds, rounds."""
    with open(path, "w", newline="") as f:
        wr = csv.writer(f)
        wr.writerow(["section", "case", "unit", "size", "median", "min", "rounds"])
        for row in rows.values():
            for size in row.samples:
                wr.writerow([row.section, row.case, row.unit, size, f"{row.median(size):.4g}",
                             f"{row.min(size):.4g}", len(row.samples[size])])


class ResidentGC:
    """The cyclic collector around resident state (see the module docstring): ``mode`` is
    "freeze" (build paused, then ``gc.freeze()``), "on" or "off"."""

    MODES = ("freeze", "on", "off")

    def __init__(self, mode: str = "freeze") -> None:
        if mode not in self.MODES:
            raise ValueError(f"gc_mode must be one of {self.MODES}, got {mode!r}")
        self.mode = mode

    @contextmanager
    def building(self) -> Iterator[None]:
        """Build resident state inside this block."""
        try:
            with _collector_paused(self.mode != "on"):
                yield
        finally:
            if self.mode == "freeze":
                gc.collect()
                gc.freeze()

    @staticmethod
    def teardown(states: dict) -> None:
        """Drop resident state and give it back to the collector."""
        states.clear()
        gc.unfreeze()
        gc.collect()

    def session(self) -> AbstractContextManager[None]:
        """The whole benchmark: with mode "off" the collector stays off throughout."""
        return _collector_paused(self.mode == "off")


@contextmanager
def _collector_paused(pause: bool) -> Iterator[None]:
    """The cyclic collector off inside the block when ``pause``; as it was afterwards."""
    was = gc.isenabled()
    if pause:
        gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def spread_widths(bits: int | float, h: int, d: int, seed: int = 0):
    """A non-uniform split-format width table ``[h, d]`` (0..8 bits per channel, some zeros) whose
    mean is ``bits`` (a fractional mean starts from ``uniform_widths``' even spread): what the split
    kernels' benchmark and tests store (shared so both read the same)."""
    import torch

    from kernels.split_codec import uniform_widths
    g = torch.Generator().manual_seed(seed)
    w = uniform_widths(h, d, bits).clone()
    for row in range(h):
        for _ in range(d):
            i, j = torch.randint(0, d, (2,), generator=g).tolist()
            if w[row, i] > 0 and w[row, j] < 8 and i != j:
                w[row, i] -= 1
                w[row, j] += 1
    return w
