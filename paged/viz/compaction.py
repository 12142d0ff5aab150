"""Block compaction on the block grid: ``compaction_grids`` draws a ``CompactionDemo``'s two
snapshots with ``grid_data``'s layout and hover text, each live block coloured by its owner (first
holder), so a contiguous table is one unbroken stripe; free light grey, cached-free light blue.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from paged.core.snapshot import STATE_CACHED, KVSnapshot
from .figures import grid_data
from .pool_figures import bare_grid_axes, legend_squares, state_heatmap
from .sizing import styled

if TYPE_CHECKING:
    from paged.studies.compaction import CompactionDemo

__all__ = ["compaction_grids"]

OWNER_COLORS = ("#3b6fb6", "#e6550d", "#2ca25f", "#756bb1", "#d62728", "#8c564b", "#e377c2", "#17becf",
                "#bcbd22", "#7f7f7f", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd")
FREE_COLOR, CACHED_COLOR = "#eeeeee", "#c6dbef"


def _owner_z(snap: KVSnapshot, d: dict) -> np.ndarray:
    """Colour codes of one grid page: 0 free, 1 cached-free, 2 + owner index (mod palette) for live."""
    lo, hi, rows, cols = d["first"], d["last"], d["rows"], d["cols"]
    z = np.full(rows * cols, np.nan)
    state, owner = snap.state[lo:hi], snap.owner[lo:hi]
    codes = np.where(owner >= 0, 2 + owner % len(OWNER_COLORS), 0).astype(float)
    codes[(owner < 0) & (state == STATE_CACHED)] = 1
    z[:hi - lo] = codes
    return z.reshape(rows, cols)


def compaction_grids(demo: CompactionDemo, cols: int | None = None, page: int = 0) -> go.Figure:
    """Before/after block-pool grids of one pass (one page each), cells coloured by owner."""
    p = demo.plan
    titles = (f"before: fragmentation {p.fragmentation_before:.2f}, {p.runs_before} runs",
              f"after {p.num_copies} copies: fragmentation {p.fragmentation_after:.2f}, {p.runs_after} runs "
              f"({p.num_skipped} skipped)")
    fig = make_subplots(rows=2, cols=1, subplot_titles=titles, vertical_spacing=0.08)
    for row, snap in enumerate((demo.before, demo.after), start=1):
        d = grid_data(snap, cols, page)
        fig.add_trace(state_heatmap((FREE_COLOR, CACHED_COLOR, *OWNER_COLORS), z=_owner_z(snap, d).tolist(),
                                    text=d["text"], hovertemplate="%{text}<extra></extra>",
                                    name="before" if row == 1 else "after"), row=row, col=1)
        bare_grid_axes(fig, [-0.5, d["cols"] - 0.5], row=row, col=1)
    fig.add_traces(legend_squares((("free", FREE_COLOR), ("cached-free", CACHED_COLOR),
                                   ("live: colour = owner", OWNER_COLORS[0]))))
    return styled(fig, f"block compaction: {demo.before.num_blocks} blocks of {demo.before.block_size} tokens, "
                  f"{p.num_requests} running requests", max(420, 2 * (22 * d["rows"] + 60) + 80), legend_y=-0.05,
                  margin=(30, 10, 70, 30), plot_bgcolor="white")
