"""Small pieces the live views share: a ring buffer of step rows, a memoized decoder, a frame pacer, checks."""
from __future__ import annotations

import contextlib
import time
from typing import Iterator, Sequence

import numpy as np

from paged.core.snapshot import STATE_NAMES

SERIES = ("step", "step_time_s", "num_prefill_tokens", "num_decode_tokens", "num_preempted",
          "num_swapped_out_blocks", "num_swapped_in_blocks", "kv_cache_usage_perc", "token_usage",
          "prefix_cache_queries", "prefix_cache_hits", "num_cached_free_blocks")


def widgets_available() -> str | None:
    """None if the live views' widgets (ipywidgets, anywidget) work here, else the reason they do not. Creates
    no widget: a throw-away plotly FigureWidget made here once opened a comm whose 5 MB front-end module held up
    every widget after it on a Voilà page (the dashboard never showed)."""
    try:
        import anywidget  # noqa: F401  the live plots (paged.viz.liveplot) are anywidgets
        import ipywidgets  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure means: fall back to static figures
        return f"{type(e).__name__}: {e}"
    return None


class RingBuffer:
    """The last `capacity` step rows, one numpy array per column; `frame()` is chronological."""

    def __init__(self, capacity: int = 512, columns: Sequence[str] = SERIES) -> None:
        self.capacity = capacity
        self.data = {c: np.zeros(capacity) for c in columns}
        self.n = 0

    def push(self, row: dict) -> None:
        for c, a in self.data.items():
            a[self.n % self.capacity] = row[c]
        self.n += 1

    def frame(self) -> dict[str, np.ndarray]:
        """Copies, oldest first (at most `capacity` rows)."""
        if self.n <= self.capacity:
            return {c: a[:self.n].copy() for c, a in self.data.items()}
        i = self.n % self.capacity
        return {c: np.concatenate([a[i:], a[:i]]) for c, a in self.data.items()}

    def clear(self) -> None:
        self.n = 0


class FramePacer:
    """When a live view draws: a frame is due once 1/`fps` s and (1/`draw_share` - 1) x the last
    frame's cost have both passed since it ended, so drawing takes about `draw_share` of the wall
    time, at most `fps` frames a second. ``with pacer.timed(): draw()`` measures a frame."""

    def __init__(self, fps: float, draw_share: float = 0.1) -> None:
        self.fps, self.draw_share = fps, draw_share
        self.draw_seconds = 0.0  # total time spent drawing frames
        self._last = self._cost = 0.0

    def due(self) -> bool:
        gap = max(1.0 / self.fps, self._cost * (1.0 / self.draw_share - 1.0))
        return time.perf_counter() - self._last >= gap

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._last = time.perf_counter()
            self._cost = self._last - t0
            self.draw_seconds += self._cost


class CachedDecoder:
    """`tokenizer.decode` memoized on the token tuple: a frame decodes every block it shows, and
    most blocks hold the same tokens as one frame earlier."""

    def __init__(self, tokenizer, capacity: int = 8192) -> None:
        self.tokenizer, self.capacity, self.cache = tokenizer, capacity, {}

    def decode(self, ids) -> str:
        key = tuple(ids)
        text = self.cache.get(key)
        if text is None:
            if len(self.cache) >= self.capacity:
                self.cache.clear()
            text = self.cache[key] = self.tokenizer.decode(list(key))
        return text


def counts_text(snap) -> str:
    """'free 13 · in use 4 · ...' for a title (states present only)."""
    c = np.bincount(snap.state, minlength=len(STATE_NAMES))
    return " · ".join(f"{n} {int(c[i])}" for i, n in enumerate(STATE_NAMES) if c[i] and i < 5)
