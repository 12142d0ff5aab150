"""Record and replay: a run's records in one .npz file, and a Chrome-trace / Perfetto timeline.

    run.keep_snapshots(stride=1)         # before stepping, to replay the block grid too
    replay.save(run, "run.npz"); rec = replay.load("run.npz"); replay.to_chrome_trace(rec, "run.trace.json")

The file holds plain arrays and one JSON metadata string (no pickles): step columns, events (kinds
and request ids as indices into string tables), request rows and kept snapshots' arrays.
Deterministic: `load(save(x))` gives equal rows, events and snapshots.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from paged.core.events import Event
from paged.core.snapshot import KVSnapshot
from paged.errors import ConfigError
from paged.runs import REQUEST_COLUMNS, STEP_COLUMNS, RecordFrames

FORMAT = "paged-run/1"
_SNAP_META = ("step", "block_size", "request_ids", "num_cpu_blocks", "num_cpu_used", "cpu_blocks_of")  # JSON
_SNAP_ARRAYS = [f.name for f in dataclasses.fields(KVSnapshot) if f.name not in (*_SNAP_META, "cached_tokens")]


class Recording(RecordFrames):
    """A saved run, read back: the same record attributes as a run, and no executor."""

    noun = "recording"

    def __init__(self, rows: list[dict], events: list[Event], requests: list[dict],
                 snapshots: dict[int, KVSnapshot], meta: dict[str, Any]) -> None:
        self.rows, self.events, self._requests, self.snapshots, self.meta = rows, events, requests, snapshots, meta
        self.label, self.backend = meta.get("label", "recording"), meta.get("backend", "")
        self.done = True
        self.tokenizer = None

    def request_rows(self) -> list[dict]:
        return list(self._requests)

    @property
    def snapshot_steps(self) -> list[int]:
        return sorted(self.snapshots)

    def snapshot(self, step: int | None = None) -> KVSnapshot:
        """The last kept snapshot at or before `step` (default: the last one); a `step` before the
        first kept snapshot gets the first one (a replay slider starts there)."""
        return self.snapshot_at(max(self.snapshots, default=0) if step is None else step)


def _json_default(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return None if math.isnan(x) else float(x)
    return str(x)


def save(run, path: str | Path, extra: dict[str, np.ndarray] | None = None) -> Path:
    """Write `run`'s (or a Recording's) rows, events, request rows and kept snapshots, and the `extra`
    named arrays, to `path` (.npz; its folder is created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = dict(extra or {})
    for c in STEP_COLUMNS:
        arrays[f"step/{c}"] = np.array([r[c] for r in run.rows], dtype=float if c.endswith(("_s", "_perc", "usage"))
                                       else np.int64)
    kinds = sorted({e[1] for e in run.events})
    rids = sorted({e[2] for e in run.events if e[2] is not None})
    kind_ix, rid_ix = {k: i for i, k in enumerate(kinds)}, {r: i for i, r in enumerate(rids)}
    ev = run.events
    arrays["event/step"] = np.array([e[0] for e in ev], np.int64)
    arrays["event/kind"] = np.array([kind_ix[e[1]] for e in ev], np.int32)
    arrays["event/request"] = np.array([-1 if e[2] is None else rid_ix[e[2]] for e in ev], np.int32)
    arrays["event/block"] = np.array([-1 if e[3] is None else e[3] for e in ev], np.int64)
    arrays["event/value"] = np.array([0 if e[4] is None else e[4] for e in ev], np.int64)
    arrays["event/has_value"] = np.array([e[4] is not None for e in ev], bool)
    snaps = {}
    for k, s in getattr(run, "snapshots", {}).items():
        arrays.update({f"snap/{k}/{name}": a for name in _SNAP_ARRAYS if (a := getattr(s, name)) is not None})
        snaps[str(k)] = {**{name: getattr(s, name) for name in _SNAP_META},
                         "cached_tokens": {str(b): list(t) for b, t in s.cached_tokens.items()}}
    meta = dict(format=FORMAT, label=run.label, backend=run.backend, kinds=kinds, request_ids=rids,
                requests=run.request_rows(), snapshots=snaps)
    arrays["meta"] = np.array(json.dumps(meta, default=_json_default))
    with open(path, "wb") as f:
        np.savez_compressed(f, **arrays)
    return path


def load(path: str | Path) -> Recording:
    """Read a file written by `save` (no pickles are loaded)."""
    with np.load(Path(path), allow_pickle=False) as z:
        meta = json.loads(str(z["meta"]))
        if meta.get("format") != FORMAT:
            raise ConfigError(f"{path}: not a paged run recording (format {meta.get('format')!r}, want {FORMAT!r})")
        cols = {c: z[f"step/{c}"] for c in STEP_COLUMNS}
        rows = [{c: cols[c][i].item() for c in STEP_COLUMNS} for i in range(len(cols["step"]))]
        kinds, rids = meta["kinds"], meta["request_ids"]
        st, kd, rq, bl, va, hv = (z[f"event/{k}"] for k in ("step", "kind", "request", "block", "value", "has_value"))
        events = [Event(int(st[i]), kinds[kd[i]], None if rq[i] < 0 else rids[rq[i]], None if bl[i] < 0 else int(bl[i]),
                        int(va[i]) if hv[i] else None) for i in range(len(st))]
        snaps = {}
        for k, m in meta["snapshots"].items():
            kw = {name: (z[f"snap/{k}/{name}"] if f"snap/{k}/{name}" in z else None) for name in _SNAP_ARRAYS}
            snaps[int(k)] = KVSnapshot(**{name: m[name] for name in _SNAP_META}, **kw,
                                       cached_tokens={int(b): tuple(t) for b, t in m["cached_tokens"].items()})
    reqs = [{c: (np.nan if r.get(c) is None else r.get(c)) for c in REQUEST_COLUMNS} for r in meta["requests"]]
    return Recording(rows, events, reqs, snaps, meta)


def chrome_trace(run) -> dict:
    """A Chrome-trace dict (`traceEvents`, microseconds): pid 1 the executor's steps (with
    prefill/decode token args) and KV usage counters; pid 2 one thread per request with its
    queued / prefill / decode phases and instant markers for preemptions and swaps."""
    us = 1e6
    ev: list[dict] = [dict(ph="M", pid=1, name="process_name", args=dict(name=f"{run.label}: steps")),
                      dict(ph="M", pid=2, name="process_name", args=dict(name="requests")),
                      dict(ph="M", pid=1, tid=0, name="thread_name", args=dict(name="step"))]
    t_of = {}
    for r in run.rows:
        t_of[int(r["step"])] = r["time_s"]
        kind = "mixed" if r["num_prefill_tokens"] and r["num_decode_tokens"] else (
            "prefill" if r["num_prefill_tokens"] else "decode")
        ev.append(dict(ph="X", pid=1, tid=0, name=f"step {int(r['step'])} ({kind})", cat="step",
                       ts=r["time_s"] * us, dur=max(r["step_time_s"] * us, 0.001),
                       args={c: r[c] for c in ("num_prefill_tokens", "num_decode_tokens", "num_seqs",
                                               "num_preempted", "num_block_copies")}))
        ev.append(dict(ph="C", pid=1, name="kv cache", ts=r["time_s"] * us,
                       args=dict(block_usage_pct=100 * r["kv_cache_usage_perc"],
                                 token_usage_pct=100 * r["kv_cache_usage_perc"] * r["token_usage"])))
    tid: dict[str, int] = {}
    for i, q in enumerate(run.request_rows()):
        rid = str(q["request_id"])
        tid[rid] = i + 1
        ev.append(dict(ph="M", pid=2, tid=i + 1, name="thread_name", args=dict(name=rid)))
        marks = [("queued", q["arrival_time_s"], q["first_scheduled_s"]),
                 ("prefill", q["first_scheduled_s"], q["first_token_s"]), ("decode", q["first_token_s"], q["finish_s"])]
        for name, a, b in marks:
            if a is None or b is None or a != a or b != b or b < a:
                continue
            ev.append(dict(ph="X", pid=2, tid=i + 1, name=name, cat="request", ts=a * us, dur=max((b - a) * us, 0.001),
                           args=dict(request_id=rid, num_prompt_tokens=q["num_prompt_tokens"],
                                     num_output_tokens=q["num_output_tokens"])))
    for e in run.events:
        if e[1] not in ("preempt", "swap_out", "swap_in") or e[2] is None or e[0] not in t_of:
            continue
        base = e[2].split("#")[0]
        name = ("preempt (swap)" if e[4] else "preempt (recompute)") if e[1] == "preempt" else e[1]
        ev.append(dict(ph="i", s="t", pid=2, tid=tid.get(base, 0), name=name, cat="memory", ts=t_of[e[0]] * us,
                       args=dict(request_id=e[2], value=e[4])))
    return dict(traceEvents=ev, displayTimeUnit="ms", otherData=dict(backend=run.backend, format=FORMAT))


def to_chrome_trace(run, path: str | Path) -> Path:
    """Write `chrome_trace(run)` as JSON to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(run), default=_json_default, allow_nan=False))
    return path
