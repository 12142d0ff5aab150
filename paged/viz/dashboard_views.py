"""The figures of a dashboard's views ("grid", "tables", "usage", "timeline", "latency", "prefix"):
built once (``build_views``), then rewritten in place at each frame (``update_series`` for the time
series, ``redraw_pool`` for the grid and tables from a snapshot).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import plotly.graph_objects as go

from . import figures as F
from .buffers import counts_text

__all__ = ["VIEWS", "build_views", "update_series"]

VIEWS = ("grid", "tables", "usage", "timeline", "latency", "prefix")


def table_rows(run, max_requests: int) -> int:
    """Rows of the live block-tables frame: ``max_requests``, or fewer when the run has fewer requests."""
    known = getattr(run, "workload", None)  # the engine's requests or the simulator's trace
    n = 0 if known is None else len(known)
    return max(1, min(max_requests, n)) if n else max_requests


def fix_table_rows(fig, rows: int) -> None:
    """A fixed frame for a live block-tables figure: rows keep their height as requests come and go."""
    fig.update_layout(height=26 * rows + 100)
    fig.update_yaxes(autorange=False, range=[rows - 0.5, -0.5])


def redraw_pool(figs: dict, snap, grid_title: str, tables_title: str, *, cols: int | None = None, page: int = 0,
                decoder=None, selected: str | None = None, max_requests: int = 12) -> None:
    """Rewrite the "grid" and "tables" figures in ``figs`` (those present) from ``snap``, one batch_update each."""
    if "grid" in figs:
        g = F.grid_data(snap, cols, page, decoder, selected)
        with figs["grid"].batch_update():
            figs["grid"].data[0].z, figs["grid"].data[0].text = g["z"], g["text"]
            figs["grid"].data[1].x, figs["grid"].data[1].y = g["hl_x"], g["hl_y"]
            # the counts as a subtitle: on one line they ran past the figure's edge and under the modebar
            figs["grid"].layout.title.text = grid_title
            figs["grid"].layout.title.subtitle.text = counts_text(snap)
    if "tables" in figs:
        t = F.tables_data(snap, max_requests, selected)
        with figs["tables"].batch_update():
            tr = figs["tables"].data[0]
            tr.z, tr.text, tr.customdata, tr.y, tr.x = t["z"], t["text"], t["hover"], t["y"], t["x"]
            figs["tables"].layout.title.text = tables_title


def build_views(views: Sequence[str], run, snap, steps, *, cols: int | None, page: int, decoder, selected,
                max_requests: int) -> dict[str, go.Figure]:
    """One figure per view, from the run's snapshot and step rows so far."""
    out: dict[str, go.Figure] = {}
    for v in views:
        if v == "grid":
            out[v] = F.block_grid(snap, cols, page, decoder, selected)
        elif v == "tables":
            rows = table_rows(run, max_requests)
            out[v] = F.block_tables(snap, rows, selected)
            fix_table_rows(out[v], rows)
        elif v == "usage":
            out[v] = F.usage_over_time(steps)
        elif v == "timeline":
            out[v] = F.step_timeline(steps)
        elif v == "latency":
            out[v] = F.latency_distributions({run.label: (run.requests_frame(), run.tbt_samples())})
        elif v == "prefix":
            out[v] = F.prefix_cache(steps)
    return out


def update_series(figs: dict, d: dict[str, np.ndarray], run) -> None:
    """Rewrite the time-series views from ``d`` (a ring buffer's frame), one batch_update each."""
    if "usage" in figs:
        s = F.usage_series(d)
        with figs["usage"].batch_update():
            figs["usage"].data[0].x, figs["usage"].data[0].y = s["x"], s["blocks"]
            figs["usage"].data[1].x, figs["usage"].data[1].y = s["x"], s["tokens"]
    if "timeline" in figs:
        s = F.timeline_series(d)
        with figs["timeline"].batch_update():
            tr = figs["timeline"].data
            tr[0].x, tr[0].y, tr[1].x, tr[1].y = s["x"], s["prefill"], s["x"], s["decode"]
            tr[2].x, tr[2].y = s["x"], s["ms"]
            tr[3].x, tr[3].y, tr[4].x, tr[4].y = s["pre_x"], s["pre_y"], s["swap_x"], s["swap_y"]
    if "prefix" in figs:
        q, h = d["prefix_cache_queries"], d["prefix_cache_hits"]
        with figs["prefix"].batch_update():
            figs["prefix"].data[0].x = d["step"]
            figs["prefix"].data[0].y = np.divide(100 * h, q, out=np.zeros_like(h), where=q > 0)
            figs["prefix"].data[1].x, figs["prefix"].data[1].y = d["step"], d["num_cached_free_blocks"]
    if "latency" in figs:
        req, tbt = run.requests_frame(), run.tbt_samples()
        with figs["latency"].batch_update():
            figs["latency"].data[0].x = 1e3 * req["ttft_s"].to_numpy(float) if len(req) else []
            figs["latency"].data[1].x = 1e3 * np.asarray(tbt, float)
