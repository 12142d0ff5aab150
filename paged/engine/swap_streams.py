"""Stream objects of :class:`paged.engine.swap.SwapExecutor`: CUDA side streams with events, or
no-ops on CPU (copies there are synchronous, so every "event" has fired when it is recorded).
Tests pass their own object with the same methods to check the order of waits and records."""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch


class NullStreams:
    """CPU (and sync-mode) streams: copies are synchronous, events are None and already done."""

    kind = "null"

    def side(self, which: str):
        return nullcontext()

    def side_waits_main(self, which: str) -> None:
        pass

    def side_waits(self, which: str, event: Any) -> None:
        pass

    def record(self, which: str) -> Any:
        return None

    def main_waits(self, event: Any) -> None:
        pass

    def keep(self, t: torch.Tensor, which: str) -> None:
        """Keep ``t`` (made on the main stream) alive until ``which``'s queued work used it."""

    def synchronize(self) -> None:
        pass


class CudaStreams:
    """One CUDA stream per direction (``"out"``: device->host, ``"in"``: host->device)."""

    kind = "cuda"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.streams = {w: torch.cuda.Stream(device=device) for w in ("out", "in")}

    def side(self, which: str):
        return torch.cuda.stream(self.streams[which])

    def side_waits_main(self, which: str) -> None:
        self.streams[which].wait_stream(torch.cuda.current_stream(self.device))

    def side_waits(self, which: str, event: Any) -> None:
        if event is not None:
            self.streams[which].wait_event(event)

    def record(self, which: str) -> Any:
        ev = torch.cuda.Event()
        ev.record(self.streams[which])
        return ev

    def main_waits(self, event: Any) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def keep(self, t: torch.Tensor, which: str) -> None:
        t.record_stream(self.streams[which])  # the allocator must not hand it to the main stream early

    def synchronize(self) -> None:
        for s in self.streams.values():
            s.synchronize()
