"""Save, load and export a live source's records, like any run.

    save(src, "server.npz"); rec = load("server.npz"); rec.forest_at(12.5)   # the forest 12.5 s in
    chrome_trace(src_or_rec, "server.trace.json")   # counters + KV-event markers for ui.perfetto.dev

The file is ``paged.replay``'s ``.npz`` (``paged.replay.load`` reads it as a plain Recording) plus
JSON arrays ``connect/wire`` (every applied batch: arrival time, sequence, server time stamp,
events) and ``connect/server`` (per-scrape rows). Replaying the wire log gives the same forest
(``load(save(src)).forest`` equals ``src.forest`` node for node: tests/test_connect_source.py).
"""
from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from paged import replay
from paged.errors import ConfigError

from .forest import PrefixForest
from .wire import MEDIUM_GPU, event_from_json

FORMAT = "paged-connect/1"


class ServerRecording(replay.Recording):
    """A saved live source: a ``paged.replay.Recording`` plus ``wire``, ``server_rows`` and the forest."""

    def __init__(self, base: replay.Recording, wire: list[dict], server_rows: list[dict], meta: dict) -> None:
        super().__init__(base.rows, base.events, base.request_rows(), base.snapshots, base.meta)
        self.wire, self.server_rows, self.connect_meta = wire, server_rows, meta
        self.medium = meta.get("medium", MEDIUM_GPU)
        self.forest = self.forest_at(None)

    def forest_at(self, t: float | None) -> PrefixForest:
        """The prefix forest rebuilt from the wire log up to time ``t`` (None: all of it)."""
        f = PrefixForest(self.medium)
        for b in self.wire:
            if t is not None and b["t"] > t:
                break
            if b.get("restart") and f.live:
                f.clear(b["t"])
            for e in b["events"]:
                f.apply(event_from_json(e), b["t"])
        return f

    def server_frame(self):
        import pandas as pd
        from .source import SERVER_COLUMNS
        return pd.DataFrame(self.server_rows, columns=list(SERVER_COLUMNS))


def _clean(x: Any) -> Any:
    return None if isinstance(x, float) and math.isnan(x) else x


def save(source: Any, path: str | Path) -> Path:
    """Write a ``ServerSource`` (or ``ServerRecording``) to ``path`` (.npz)."""
    with getattr(source, "lock", None) or contextlib.nullcontext():
        wire = json.dumps(source.wire)
        server = json.dumps([{k: _clean(v) for k, v in r.items()} for r in source.server_rows])
        meta = json.dumps({"format": FORMAT, "medium": getattr(source, "medium", MEDIUM_GPU),
                           "cache_config": getattr(source, "cache_config", {}),
                           "status": {k: v for k, v in getattr(source, "status", {}).items()
                                      if isinstance(v, (int, float, str, bool, dict, type(None)))}
                           if not isinstance(source, ServerRecording) else source.connect_meta.get("status", {})})
        # rows, events, request rows, and the KV-event log beside them
        return replay.save(source, path, extra={"connect/wire": np.array(wire), "connect/server": np.array(server),
                                                "connect/meta": np.array(meta)})


def load(path: str | Path) -> ServerRecording:
    """Read a file written by ``save`` (no pickles are loaded)."""
    base = replay.load(path)
    with np.load(Path(path), allow_pickle=False) as z:
        if "connect/meta" not in z.files:
            raise ConfigError(f"{path}: a paged run recording, but not of a live source (no KV-event log); "
                              "read it with paged.replay.load")
        meta = json.loads(str(z["connect/meta"]))
        wire = json.loads(str(z["connect/wire"]))
        server = json.loads(str(z["connect/server"]))
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{path}: format {meta.get('format')!r}, want {FORMAT!r}")
    server = [{k: (math.nan if v is None else v) for k, v in r.items()} for r in server]
    return ServerRecording(base, wire, server, meta)


def chrome_trace(source: Any, path: str | Path | None = None) -> dict:
    """A Chrome-trace dict for ui.perfetto.dev: counter tracks (KV usage %, hit rate %, running,
    waiting, live cached blocks) per scrape, and one instant marker per KV-event batch (args:
    stored / removed / cleared counts, sequence). Written to ``path`` when given."""
    us = 1e6
    label = getattr(source, "label", "vllm")
    ev: list[dict] = [dict(ph="M", pid=1, name="process_name", args=dict(name=f"{label}: server")),
                      dict(ph="M", pid=1, tid=1, name="thread_name", args=dict(name="kv events"))]
    for r in source.server_rows:
        t = r["time_s"] * us
        hr = r.get("hit_rate")
        ev.append(dict(ph="C", pid=1, name="kv cache", ts=t,
                       args=dict(usage_pct=100 * r["kv_cache_usage_perc"], live_blocks=r["live_blocks"])))
        ev.append(dict(ph="C", pid=1, name="requests", ts=t,
                       args=dict(running=r["num_running"], waiting=r["num_waiting"])))
        if _clean(hr) is not None:
            ev.append(dict(ph="C", pid=1, name="prefix hit rate", ts=t, args=dict(hit_rate_pct=100 * hr)))
    for b in source.wire:
        kinds = [e.get("type") for e in b["events"]]
        stored = sum(len(e.get("block_hashes", ())) for e in b["events"] if e.get("type") == "BlockStored")
        removed = sum(len(e.get("block_hashes", ())) for e in b["events"] if e.get("type") == "BlockRemoved")
        name = "cleared" if "AllBlocksCleared" in kinds else ("evict" if removed else "store")
        ev.append(dict(ph="i", s="t", pid=1, tid=1, name=name, cat="kv", ts=b["t"] * us,
                       args=dict(seq=b["seq"], stored=stored, removed=removed, restart=bool(b.get("restart")))))
    trace = dict(traceEvents=ev, displayTimeUnit="ms", otherData=dict(backend="vllm", format=FORMAT))
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(trace, allow_nan=False))
    return trace
