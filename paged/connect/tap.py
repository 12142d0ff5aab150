"""Listen to a running engine's (or simulator's) cache events as they are emitted.

``install(engine, listener)`` puts a ``TapRecorder`` in place of the recorder the engine, its KV
manager, block pool, host tier and scheduler share; every ``emit`` also calls ``listener(step,
kind, request_id, block_id, value)`` synchronously, while the pool still holds the state the event
is about (an ``evict`` comes before the block loses its hash); ``install(engine, listener, kinds)``
calls it for those event kinds only (a simulated replica listens to its cache kinds alone). Recording
is unchanged.

Invariant: after ``install`` every holder of the old recorder holds the tap (checked), so no event
bypasses the listeners; installing twice adds a listener to the same tap.
"""
from __future__ import annotations

from typing import AbstractSet, Any, Callable

from paged.core import events as ev

Listener = Callable[[int, str, Any, Any, Any], None]


class TapRecorder(ev.Recorder):
    """A Recorder that also calls listeners on every emit of their kinds (see the module docstring).
    ``kinds``: the union of the listeners' kinds (None: some listener hears every kind)."""

    __slots__ = ("listeners", "keep", "kinds")

    def __init__(self, base: ev.Recorder) -> None:
        super().__init__()
        self.events = base.events  # the same list: earlier references keep seeing new events
        self.step = base.step
        self.keep = not isinstance(base, ev.NullRecorder)
        self.listeners: list[tuple[Listener, AbstractSet[str] | None]] = []   # (listener, its kinds)
        self.kinds: AbstractSet[str] | None = frozenset()
        self.hears = base.hears

    def emit(self, kind: str, request_id: str | None = None, block_id: int | None = None,
             value: int | None = None) -> None:
        if self.keep:
            self.events.append((self.step, kind, request_id, block_id, value))
        if self.kinds is not None and kind not in self.kinds:
            return
        for f, kinds in self.listeners:
            if kinds is None or kind in kinds:
                f(self.step, kind, request_id, block_id, value)

    def listen(self, listener: Listener, kinds: AbstractSet[str] | None = None) -> None:
        """Call ``listener`` on every emit of ``kinds`` (None: of every kind); once per listener."""
        if all(f != listener for f, _ in self.listeners):
            self.listeners.append((listener, None if kinds is None else frozenset(kinds)))
            self._union()

    def discard(self, listener: Listener) -> None:
        """Stop calling ``listener`` (nothing happens if it is not one)."""
        self.listeners = [(f, k) for f, k in self.listeners if f != listener]
        self._union()

    def _union(self) -> None:
        sets = [k for _, k in self.listeners]
        self.kinds = None if None in sets else frozenset().union(*sets)
        self.hears = ev.EVERY_KIND if self.keep or self.kinds is None else self.kinds


def install(engine: Any, listener: Listener, kinds: AbstractSet[str] | None = None) -> TapRecorder:
    """Add ``listener`` to ``engine``'s event stream (an ``LLMEngine`` or ``Simulator``: anything
    with ``recorder``, ``kv`` and ``scheduler``), for the event ``kinds`` only (None: all); returns the tap."""
    old = engine.recorder
    tap = old if isinstance(old, TapRecorder) else TapRecorder(old)
    kv = engine.kv
    for h in [h for h in (engine, kv, kv.pool, getattr(kv, "host", None), engine.scheduler) if h is not None]:
        if getattr(h, "recorder", None) is not old and getattr(h, "recorder", None) is not tap:
            raise RuntimeError(f"{type(h).__name__} holds another recorder than the engine's; cannot tap it")
        h.recorder = tap
    tap.listen(listener, kinds)
    return tap


def remove(engine: Any, listener: Listener) -> None:
    """Stop calling ``listener`` (the tap stays in place)."""
    tap = engine.recorder
    if isinstance(tap, TapRecorder):
        tap.discard(listener)
