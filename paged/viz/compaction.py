"""Block compaction on the block grid: the pool before and after one pass, coloured by owner.

``compaction_snapshots`` runs a small workload under the scheduler (no model: block tables only)
until its running requests are fragmented, snapshots the pool, runs one pass and snapshots it
again. ``compaction_grids`` draws both snapshots with the block-grid layout and hover text of
``paged.viz.figures.grid_data``: each live block is coloured by the request that owns it (first
holder), so a contiguous table is one unbroken stripe; free blocks are light grey, cached-free
blocks light blue. ``runs_frame`` lists each request's own-block runs before and after.

Invariants: the "after" snapshot holds the same requests, tokens and ref counts as "before" (only
block ids change); a request's runs after the pass are 1 unless the pass skipped it.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from paged.core.compaction import CompactionPlan, count_runs, own_blocks
from paged.core.kv_manager import KVCacheManager
from paged.core.request import Request
from paged.core.scheduler import Scheduler, SchedulerConfig
from paged.core.snapshot import STATE_CACHED, STATE_FREE, KVSnapshot
from .figures import grid_data

__all__ = ["CompactionDemo", "compaction_snapshots", "compaction_grids", "runs_frame"]

OWNER_COLORS = ("#3b6fb6", "#e6550d", "#2ca25f", "#756bb1", "#d62728", "#8c564b", "#e377c2", "#17becf",
                "#bcbd22", "#7f7f7f", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd")
FREE_COLOR, CACHED_COLOR = "#eeeeee", "#c6dbef"


@dataclass
class CompactionDemo:
    """Two snapshots around one pass, the pass's plan, and the running order it used."""

    before: KVSnapshot
    after: KVSnapshot
    plan: CompactionPlan
    order: list[str] = field(default_factory=list)


def compaction_snapshots(num_blocks: int = 192, block_size: int = 4, num_requests: int = 10, *,
                         steps: int = 40, drop_cached: bool = False, seed: int = 0) -> CompactionDemo:
    """Run ``num_requests`` requests (half share a system prompt) for ``steps`` steps with
    compaction off, then one pass (see module docstring). Deterministic for a seed."""
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks, block_size)
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=num_requests))
    system = [rng.randrange(100) for _ in range(3 * block_size)]
    for i in range(num_requests):
        prompt = (system if i % 2 else []) + [rng.randrange(100) for _ in range(rng.randint(2, 6 * block_size))]
        sched.add_request(Request(f"r{i}", prompt, max_tokens=rng.randint(steps // 2, 4 * steps)))
    for _ in range(steps):
        if not sched.has_unfinished_requests():
            break
        plan = sched.schedule()
        sched.update(plan, {c.request_id: rng.randrange(100) for c in plan.scheduled if c.samples})
        sched.take_finished()
    order = [r.request_id for r in sched.running]
    before = kv.snapshot(sched.requests)
    kv.compact(order, drop_cached=drop_cached)
    after = kv.snapshot(sched.requests)
    return CompactionDemo(before, after, kv.last_compaction, order)


def _owner_z(snap: KVSnapshot, d: dict) -> np.ndarray:
    """Colour codes of one grid page: 0 free, 1 cached-free, 2 + owner index (mod palette) for live."""
    lo, hi, rows, cols = d["first"], d["last"], d["rows"], d["cols"]
    z = np.full(rows * cols, np.nan)
    state, owner = snap.state[lo:hi], snap.owner[lo:hi]
    codes = np.where(owner >= 0, 2 + owner % len(OWNER_COLORS), 0).astype(float)
    codes[(owner < 0) & (state == STATE_CACHED)] = 1
    codes[(owner < 0) & (state == STATE_FREE)] = 0
    z[:hi - lo] = codes
    return z.reshape(rows, cols)


def _colorscale() -> list[list]:
    colors = (FREE_COLOR, CACHED_COLOR, *OWNER_COLORS)
    n = len(colors)
    return [x for i, c in enumerate(colors) for x in ([i / n, c], [(i + 1) / n, c])]


def compaction_grids(demo: CompactionDemo, cols: int | None = None, page: int = 0) -> go.Figure:
    """Before/after block-pool grids of one pass (one page each), cells coloured by owner."""
    p = demo.plan
    titles = (f"before: fragmentation {p.fragmentation_before:.2f}, {p.runs_before} runs",
              f"after {p.num_copies} copies: fragmentation {p.fragmentation_after:.2f}, {p.runs_after} runs "
              f"({p.num_skipped} skipped)")
    fig = make_subplots(rows=2, cols=1, subplot_titles=titles, vertical_spacing=0.08)
    n = len(OWNER_COLORS) + 2
    for row, snap in enumerate((demo.before, demo.after), start=1):
        d = grid_data(snap, cols, page)
        fig.add_trace(go.Heatmap(z=_owner_z(snap, d).tolist(), text=d["text"],
                                 hovertemplate="%{text}<extra></extra>", zmin=-0.5, zmax=n - 0.5,
                                 colorscale=_colorscale(), showscale=False, xgap=1, ygap=1,
                                 name="before" if row == 1 else "after"), row=row, col=1)
        fig.update_xaxes(showticklabels=False, showgrid=False, zeroline=False, range=[-0.5, d["cols"] - 0.5],
                         row=row, col=1)
        fig.update_yaxes(autorange="reversed", showticklabels=False, showgrid=False, zeroline=False, row=row, col=1)
    for name, color in (("free", FREE_COLOR), ("cached-free", CACHED_COLOR), ("live: colour = owner", OWNER_COLORS[0])):
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=name,
                                 marker=dict(size=10, color=color, symbol="square")))
    rows = grid_data(demo.before, cols, page)["rows"]
    fig.update_layout(title=f"block compaction: {demo.before.num_blocks} blocks of {demo.before.block_size} tokens, "
                            f"{p.num_requests} running requests",
                      height=max(420, 2 * (22 * rows + 60) + 80), margin=dict(l=30, r=10, t=70, b=30),
                      legend=dict(orientation="h", y=-0.05), plot_bgcolor="white")
    return fig


def runs_frame(demo: CompactionDemo):
    """One row per running request: own blocks and their runs before and after the pass."""
    import pandas as pd

    def own(snap: KVSnapshot) -> dict[str, list[int]]:
        tables = [(rid, snap.table(rid).tolist()) for rid in demo.order]
        return dict(own_blocks(tables))

    b, a = own(demo.before), own(demo.after)
    return pd.DataFrame([dict(request_id=r, own_blocks=len(b[r]), runs_before=count_runs(b[r]),
                              runs_after=count_runs(a[r])) for r in demo.order])
