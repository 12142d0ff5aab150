"""Figures of the pool from a snapshot: the block grid, the block tables, a contiguous cache's grid
(pure: snapshot -> `go.Figure`; each `*_data` returns the arrays a live view assigns in place).

Figures size themselves from their content (`paged.viz.sizing`; heatmap rows >= 12 px). A grid
draws at most `MAX_CELLS` cells: a larger pool is drawn whole, `blocks_per_cell` blocks per cell
coloured by the share in use, so a 30,000-block pool is one readable picture, not 8 pages of 64 x 64.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import plotly.graph_objects as go

from paged.core.snapshot import (STATE_CACHED, STATE_FREE, STATE_NAMES, STATE_RESERVED, STATE_SHARED, STATE_USED,
                                 STATE_WRITING, STATUS_NAMES, ContiguousSnapshot, KVSnapshot)
from .sizing import ROW_PX, heatmap_height, styled


STATE_COLORS = ("#e9e9ee", "#9ecae1", "#3b6fb6", "#e6550d", "#2ca25f", "#f4b6c2")
PAGED_STATES = (STATE_FREE, STATE_CACHED, STATE_USED, STATE_SHARED, STATE_WRITING)  # what a paged pool can show
CONTIGUOUS_STATES = (STATE_FREE, STATE_RESERVED, STATE_USED)                       # what a contiguous cache can show
MAX_CELLS = 64 * 32
GRID_COLS = 64
DENSE_ROW_PX = 16        # px per row of a grid with more than 16 rows
DENSITY_COLORS = ((0.0, STATE_COLORS[STATE_FREE]), (0.25, "#c6dbef"), (1.0, "#08306b"))
NAN = float("nan")


def state_colorscale(colors: Sequence[str] = STATE_COLORS) -> list[list]:
    """A stepped colourscale: code i (with zmin=-0.5, zmax=len-0.5) gets colors[i] exactly."""
    n = len(colors)
    return [x for i, c in enumerate(colors) for x in ([i / n, c], [(i + 1) / n, c])]


def state_heatmap(colors: Sequence[str] = STATE_COLORS, gap: int = 1, **trace) -> go.Heatmap:
    """A heatmap of codes 0..len(colors)-1, code i drawn in colors[i] (no colour bar), cells `gap` px apart."""
    return go.Heatmap(zmin=-0.5, zmax=len(colors) - 0.5, colorscale=state_colorscale(colors), showscale=False,
                      xgap=gap, ygap=gap, **trace)


def legend_squares(items: Sequence[tuple[str, str]]) -> list[go.Scatter]:
    """Invisible markers that give a heatmap a discrete legend: one square per (name, colour)."""
    return [go.Scatter(x=[None], y=[None], mode="markers", name=name, showlegend=True,
                       marker=dict(size=10, color=color, symbol="square")) for name, color in items]


def _legend_traces(states: Sequence[int] = PAGED_STATES) -> list[go.Scatter]:
    """The legend of the states that can occur."""
    return legend_squares([(STATE_NAMES[i], STATE_COLORS[i]) for i in states])


def bare_grid_axes(fig: go.Figure, x_range: list[float] | None = None, **where) -> go.Figure:
    """A grid's axes: no ticks, grid lines or zero line, row 0 on top (``where``: a subplot's ``row``/``col``)."""
    fig.update_xaxes(showticklabels=False, showgrid=False, zeroline=False, range=x_range, **where)
    return fig.update_yaxes(autorange="reversed", showticklabels=False, showgrid=False, zeroline=False, **where)


def blocks_per_cell(num_blocks: int) -> int:
    """Consecutive blocks one grid cell stands for: 1 up to MAX_CELLS blocks, more above."""
    return max(1, math.ceil(num_blocks / MAX_CELLS))


def grid_shape(num_blocks: int, cols: int | None = None) -> tuple[int, int]:
    """(rows, cols) in *blocks* of the grid that shows the pool: block b sits at row b // cols,
    column b % cols. Up to MAX_CELLS blocks: one cell per block, about twice as wide as tall.
    Larger pools: the whole pool on one page, each cell `blocks_per_cell` blocks of one row
    (`cols` then counts cells per row; rows * cols >= num_blocks always)."""
    k = blocks_per_cell(num_blocks)
    if k == 1:
        cols = cols or min(GRID_COLS, max(8, math.ceil(math.sqrt(2 * max(num_blocks, 1)))))
        return math.ceil(max(num_blocks, 1) / cols), cols
    cells = cols or GRID_COLS
    return math.ceil(num_blocks / (cells * k)), cells * k


def _json_grid(z: np.ndarray) -> list:
    """A 2-D float array as nested lists with None for NaN (NaN is not valid JSON on the wire)."""
    out = z.astype(object)
    out[np.isnan(z)] = None
    return out.tolist()


def _hex(k: int) -> str:
    return f"{k:08x}" if k else "-"


def _row_px(rows: int) -> int:
    return ROW_PX if rows <= 16 else DENSE_ROW_PX


def grid_data(snap: KVSnapshot, cols: int | None = None, page: int = 0, tokenizer=None,
              highlight: str | None = None) -> dict:
    """z, hover text and cell coordinates of the grid of `snap`'s pool. One block per cell: z is the state code
    (STATE_*). Pools above MAX_CELLS blocks: each cell holds `blocks_per_cell` consecutive blocks and z is the
    share of them holding KV (ref > 0), 0..1. `x` (cell centres in block columns) and `y` (rows) place the
    cells, so a click at (x, y) maps to block y * cols + int(x) either way. Keys: z, text, x, y, rows, cols
    (cells per row), first, last, hl_x, hl_y, num_pages, blocks_per_cell, dense."""
    k = blocks_per_cell(snap.num_blocks)
    rows, bcols = grid_shape(snap.num_blocks, cols)
    if k > 1:
        return _dense_grid_data(snap, rows, bcols, k, highlight)
    per = rows * bcols
    lo = page * per
    hi = min(lo + per, snap.num_blocks)
    z = np.full(per, NAN)
    z[:hi - lo] = snap.state[lo:hi]
    decode = tokenizer is not None and snap.token_ids is not None
    text = []
    rid = snap.request_ids
    for b in range(lo, hi):
        o = int(snap.owner[b])
        t = (f"block {b} · {STATE_NAMES[snap.state[b]]}<br>owner {rid[o] if o >= 0 else '-'}"
             f" · logical {int(snap.logical[b])}<br>ref {int(snap.ref_count[b])} · filled {int(snap.filled[b])}"
             f"/{snap.block_size} · hash {_hex(int(snap.hash_key[b]))} · last use {int(snap.last_use[b])}")
        if decode and snap.state[b] != 0:
            toks = snap.block_tokens(b)
            if toks:
                t += "<br>" + tokenizer.decode(list(toks)).replace("<", "&lt;").replace("\n", "⏎")[:80]
        text.append(t)
    text += [""] * (per - len(text))
    hl_x, hl_y = [], []
    if highlight is not None and highlight in rid:
        mine = snap.table(highlight)
        mine = mine[(mine >= lo) & (mine < hi)] - lo
        hl_x, hl_y = (mine % bcols).tolist(), (mine // bcols).tolist()
    return dict(z=_json_grid(z.reshape(rows, bcols)), text=np.array(text, object).reshape(rows, bcols).tolist(),
                x=list(range(bcols)), y=list(range(rows)), rows=rows, cols=bcols, first=lo, last=hi,
                hl_x=hl_x, hl_y=hl_y, num_pages=math.ceil(snap.num_blocks / per), blocks_per_cell=1, dense=False)


def _dense_grid_data(snap: KVSnapshot, rows: int, bcols: int, k: int, highlight: str | None) -> dict:
    """grid_data of a pool drawn k blocks per cell (density of blocks holding KV)."""
    n, cells = snap.num_blocks, bcols // k
    total = rows * cells
    state = np.concatenate([snap.state, np.full(total * k - n, -1, np.int8)]).reshape(total, k)
    held = ((state == STATE_USED) | (state == STATE_SHARED) | (state == STATE_WRITING)).sum(1)
    shared = (state == STATE_SHARED).sum(1)
    cached = (state == STATE_CACHED).sum(1)
    size = (state >= 0).sum(1)
    z = np.where(size > 0, held / np.maximum(size, 1), NAN)
    text = [f"blocks {c * k}–{c * k + int(size[c]) - 1}: {int(held[c])} of {int(size[c])} hold KV"
            f" ({int(shared[c])} shared) · {int(cached[c])} cached-free" if size[c] else ""
            for c in range(total)]
    hl_x, hl_y = [], []
    if highlight is not None and highlight in snap.request_ids:
        cell = np.unique(snap.table(highlight) // k)
        hl_x, hl_y = ((cell % cells) * k + (k - 1) / 2).tolist(), (cell // cells).tolist()
    return dict(z=_json_grid(z.reshape(rows, cells)), text=np.array(text, object).reshape(rows, cells).tolist(),
                x=[c * k + (k - 1) / 2 for c in range(cells)], y=list(range(rows)), rows=rows, cols=cells,
                first=0, last=n, hl_x=hl_x, hl_y=hl_y, num_pages=1, blocks_per_cell=k, dense=True)


def block_grid(snap: KVSnapshot, cols: int | None = None, page: int = 0, tokenizer=None,
               highlight: str | None = None, title: str | None = None) -> go.Figure:
    """The physical block pool: one cell per block coloured by state, or (pools above MAX_CELLS
    blocks) one cell per `blocks_per_cell` blocks coloured by the share holding KV. One go.Heatmap
    (trace 0) and the selected request's cells (trace 1), then the legend."""
    d = grid_data(snap, cols, page, tokenizer, highlight)
    k, row_px = d["blocks_per_cell"], _row_px(d["rows"])
    fig = go.Figure()
    if d["dense"]:
        fig.add_trace(go.Heatmap(z=d["z"], x=d["x"], y=d["y"], text=d["text"], hovertemplate="%{text}<extra></extra>",
                                 zmin=0, zmax=1, colorscale=[list(c) for c in DENSITY_COLORS], xgap=1, ygap=1,
                                 name="blocks", colorbar=dict(title=dict(text="share<br>holding KV", side="top"),
                                                              tickformat=".0%", len=1, thickness=14)))
    else:
        fig.add_trace(state_heatmap(z=d["z"], x=d["x"], y=d["y"], text=d["text"], name="blocks",
                                    hovertemplate="%{text}<extra></extra>"))
    fig.add_trace(go.Scatter(x=d["hl_x"], y=d["hl_y"], mode="markers", hoverinfo="skip", showlegend=False,
                             marker=dict(symbol="square-open", size=min(12, row_px - 2), color="black",
                                         line=dict(width=2)),
                             name="selected request"))
    if not d["dense"]:
        fig.add_traces(_legend_traces())
    pages = f" · page {page + 1}/{d['num_pages']} (blocks {d['first']}-{d['last'] - 1})" if d["num_pages"] > 1 else ""
    per = f" · {k} blocks per cell" if k > 1 else ""
    fig.update_layout(title=title or f"block pool at step {snap.step}: {snap.num_blocks:,} blocks of "
                                     f"{snap.block_size} tokens{per}{pages}",
                      height=heatmap_height(d["rows"], row_px=row_px, top=62, bottom=30 if d["dense"] else 60),
                      margin=dict(l=30, r=10, t=62, b=30 if d["dense"] else 60),  # room for a subtitle (counts)
                      legend=dict(orientation="h", y=0, yanchor="top", x=0), plot_bgcolor="white")
    return bare_grid_axes(fig, [-0.5 if k == 1 else -k / 2, d["cols"] * k - (0.5 if k == 1 else k / 2)])


def tables_data(snap: KVSnapshot, max_requests: int = 16, highlight: str | None = None) -> dict:
    """Rows = requests (running first), columns = logical block index, z = physical block state."""
    order = np.argsort(snap.status, kind="stable")[:max_requests]
    width = max(1, int(np.diff(snap.table_indptr)[order].max()) if len(order) else 1)
    z = np.full((max(1, len(order)), width), NAN)
    text = [[""] * width for _ in range(max(1, len(order)))]
    hover = [[""] * width for _ in range(max(1, len(order)))]
    labels = []
    for row, r in enumerate(order.tolist()):
        rid = snap.request_ids[r]
        mark = "▶ " if rid == highlight else ""
        labels.append(f"{mark}{rid} ({STATUS_NAMES[snap.status[r]]}, {int(snap.num_computed[r])} tok)")
        for j, b in enumerate(snap.table(r).tolist()):
            z[row, j] = snap.state[b]
            text[row][j] = str(b)
            hover[row][j] = (f"{rid} logical {j} → block {b}<br>ref {int(snap.ref_count[b])} · "
                             f"filled {int(snap.filled[b])}/{snap.block_size} · {STATE_NAMES[snap.state[b]]}")
    return dict(z=_json_grid(z), text=text, hover=hover, y=labels or ["(no request holds blocks)"], x=list(range(width)))


def block_tables(snap: KVSnapshot, max_requests: int = 16, highlight: str | None = None) -> go.Figure:
    """Each request's block table: logical index -> physical block id (cell text), coloured by state.
    The logical-block axis is categorical: one tick per logical block, never a half one."""
    d = tables_data(snap, max_requests, highlight)
    fig = go.Figure(state_heatmap(gap=2, z=d["z"], x=d["x"], y=d["y"], text=d["text"], texttemplate="%{text}",
                                  customdata=d["hover"], hovertemplate="%{customdata}<extra></extra>"))
    styled(fig, f"block tables at step {snap.step} (cell = physical block id)",
           heatmap_height(len(d["y"]), row_px=26, top=50, bottom=50), x="logical block", margin=(10, 10, 50, 50),
           plot_bgcolor="white")
    fig.update_xaxes(type="category")
    return fig.update_yaxes(autorange="reversed", type="category")


def contiguous_grid(snap: ContiguousSnapshot, cell_tokens: int = 16, cols: int | None = None) -> go.Figure:
    """A contiguous cache drawn like a block pool: cells of `cell_tokens` slots, reserved vs holding tokens."""
    cells = snap.cell_states(cell_tokens)[:MAX_CELLS]
    rows, cols = grid_shape(len(cells), cols)
    z = np.full(rows * cols, NAN)
    z[:len(cells)] = cells
    fig = go.Figure(state_heatmap(z=_json_grid(z.reshape(rows, cols)),
                                  hovertemplate="cell %{x},%{y}: %{z}<extra></extra>"))
    fig.add_traces(_legend_traces(CONTIGUOUS_STATES))
    pct = 100 * snap.num_filled / snap.num_reserved if snap.num_reserved else 0.0
    fig.update_layout(title=f"contiguous reservations: {snap.num_reserved:,} slots reserved, "
                      f"{snap.num_filled:,} hold tokens ({pct:.0f}%)",
                      height=heatmap_height(rows, row_px=_row_px(rows), top=50, bottom=60),
                      margin=dict(l=30, r=10, t=50, b=60), legend=dict(orientation="h", y=0, yanchor="top"),
                      plot_bgcolor="white")
    return bare_grid_axes(fig)
