"""Pure figure builders: snapshot / DataFrame -> plotly `go.Figure` (no widgets, no state).

Each `*_data` function returns the trace arrays a live view assigns in place; the builder of
the same name wraps them in a figure. All traces are SVG (no WebGL: browsers cap contexts).
Every figure sizes itself from its content (`paged.viz.sizing`; `paged.viz.check` verifies it):
heatmap rows at least 12 px, integer ticks on axes that count, ECDFs where latency
distributions are compared. A block grid draws at most `MAX_CELLS` cells: a larger pool is
drawn whole with `blocks_per_cell` consecutive blocks per cell, coloured by the share of them
in use (a density), so a 30,000-block pool is one readable picture, not 8 pages of 64 x 64.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from paged.core.snapshot import (STATE_CACHED, STATE_FREE, STATE_NAMES, STATE_RESERVED, STATE_SHARED, STATE_USED,
                                 STATE_WRITING, STATUS_NAMES, ContiguousSnapshot, KVSnapshot)
from .sizing import ROW_PX, count_axis, heatmap_height

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
    scale = []
    for i, c in enumerate(colors):
        scale += [[i / n, c], [(i + 1) / n, c]]
    return scale


def _legend_traces(states: Sequence[int] = PAGED_STATES) -> list[go.Scatter]:
    """Invisible markers that give the heatmap a discrete legend: one per state that can occur."""
    return [go.Scatter(x=[None], y=[None], mode="markers", name=STATE_NAMES[i], showlegend=True,
                       marker=dict(size=10, color=STATE_COLORS[i], symbol="square"))
            for i in states]


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
    """z, hover text and cell coordinates of the grid of `snap`'s pool.

    One block per cell: z is the state code (STATE_*). Pools above MAX_CELLS blocks: each cell
    holds `blocks_per_cell` consecutive blocks and z is the share of them holding KV (ref > 0),
    0..1. `x` (cell centres in block columns) and `y` (rows) place the cells, so a click at
    (x, y) maps to block y * cols + int(x) either way. Keys: z, text, x, y, rows, cols (cells
    per row), first, last, hl_x, hl_y, num_pages, blocks_per_cell, dense."""
    k = blocks_per_cell(snap.num_blocks)
    rows, bcols = grid_shape(snap.num_blocks, cols)
    if k > 1:
        return _dense_grid_data(snap, rows, bcols, k, highlight)
    per = rows * bcols
    lo = page * per
    hi = min(lo + per, snap.num_blocks)
    ids = np.arange(lo, hi)
    z = np.full(per, NAN)
    z[:hi - lo] = snap.state[lo:hi]
    decode = tokenizer is not None and snap.token_ids is not None
    text = []
    rid = snap.request_ids
    for b in ids.tolist():
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
    pad = total * k - n
    state = np.concatenate([snap.state, np.full(pad, -1, np.int8)]).reshape(total, k)
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
        fig.add_trace(go.Heatmap(z=d["z"], x=d["x"], y=d["y"], text=d["text"], hovertemplate="%{text}<extra></extra>",
                                 zmin=-0.5, zmax=len(STATE_COLORS) - 0.5, colorscale=state_colorscale(),
                                 showscale=False, xgap=1, ygap=1, name="blocks"))
    fig.add_trace(go.Scatter(x=d["hl_x"], y=d["hl_y"], mode="markers", hoverinfo="skip", showlegend=False,
                             marker=dict(symbol="square-open", size=min(12, row_px - 2), color="black",
                                         line=dict(width=2)),
                             name="selected request"))
    if not d["dense"]:
        for t in _legend_traces():
            fig.add_trace(t)
    pages = f" · page {page + 1}/{d['num_pages']} (blocks {d['first']}-{d['last'] - 1})" if d["num_pages"] > 1 else ""
    per = f" · {k} blocks per cell" if k > 1 else ""
    fig.update_layout(title=title or f"block pool at step {snap.step}: {snap.num_blocks:,} blocks of "
                                     f"{snap.block_size} tokens{per}{pages}",
                      height=heatmap_height(d["rows"], row_px=row_px, top=50, bottom=30 if d["dense"] else 60),
                      margin=dict(l=30, r=10, t=50, b=30 if d["dense"] else 60),
                      legend=dict(orientation="h", y=0, yanchor="top", x=0), plot_bgcolor="white")
    fig.update_xaxes(showticklabels=False, showgrid=False, zeroline=False,
                     range=[-0.5 if k == 1 else -k / 2, d["cols"] * k - (0.5 if k == 1 else k / 2)])
    fig.update_yaxes(autorange="reversed", showticklabels=False, showgrid=False, zeroline=False)
    return fig


def tables_data(snap: KVSnapshot, max_requests: int = 16, highlight: str | None = None) -> dict:
    """Rows = requests (running first), columns = logical block index, z = physical block state."""
    order = np.argsort(snap.status, kind="stable")[:max_requests]
    lens = np.diff(snap.table_indptr)
    width = max(1, int(lens[order].max()) if len(order) else 1)
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
    if not labels:
        labels = ["(no request holds blocks)"]
    return dict(z=_json_grid(z), text=text, hover=hover, y=labels, x=list(range(width)))


def block_tables(snap: KVSnapshot, max_requests: int = 16, highlight: str | None = None) -> go.Figure:
    """Each request's block table: logical index -> physical block id (cell text), coloured by state.
    The logical-block axis is categorical: one tick per logical block, never a half one."""
    d = tables_data(snap, max_requests, highlight)
    fig = go.Figure(go.Heatmap(z=d["z"], x=d["x"], y=d["y"], text=d["text"], texttemplate="%{text}",
                               customdata=d["hover"], hovertemplate="%{customdata}<extra></extra>",
                               zmin=-0.5, zmax=len(STATE_COLORS) - 0.5, colorscale=state_colorscale(),
                               showscale=False, xgap=2, ygap=2))
    fig.update_layout(title=f"block tables at step {snap.step} (cell = physical block id)",
                      height=heatmap_height(len(d["y"]), row_px=26, top=50, bottom=50),
                      margin=dict(l=10, r=10, t=50, b=50), xaxis_title="logical block", plot_bgcolor="white")
    fig.update_xaxes(type="category")
    fig.update_yaxes(autorange="reversed", type="category")
    return fig


def contiguous_grid(snap: ContiguousSnapshot, cell_tokens: int = 16, cols: int | None = None,
                    title: str | None = None) -> go.Figure:
    """A contiguous cache drawn like a block pool: cells of `cell_tokens` slots, reserved vs holding tokens."""
    cells = snap.cell_states(cell_tokens)[:MAX_CELLS]
    rows, cols = grid_shape(len(cells), cols)
    z = np.full(rows * cols, NAN)
    z[:len(cells)] = cells
    fig = go.Figure(go.Heatmap(z=_json_grid(z.reshape(rows, cols)), zmin=-0.5, zmax=len(STATE_COLORS) - 0.5,
                               colorscale=state_colorscale(), showscale=False, xgap=1, ygap=1,
                               hovertemplate="cell %{x},%{y}: %{z}<extra></extra>"))
    for t in _legend_traces(CONTIGUOUS_STATES):
        fig.add_trace(t)
    pct = 100 * snap.num_filled / snap.num_reserved if snap.num_reserved else 0.0
    fig.update_layout(title=title or f"contiguous reservations: {snap.num_reserved:,} slots reserved, "
                      f"{snap.num_filled:,} hold tokens ({pct:.0f}%)",
                      height=heatmap_height(rows, row_px=_row_px(rows), top=50, bottom=60),
                      margin=dict(l=30, r=10, t=50, b=60), legend=dict(orientation="h", y=0, yanchor="top"),
                      plot_bgcolor="white")
    fig.update_xaxes(showticklabels=False, showgrid=False, zeroline=False)
    fig.update_yaxes(autorange="reversed", showticklabels=False, showgrid=False, zeroline=False)
    return fig


def usage_series(steps) -> dict:
    """x = step; block usage and token share of the pool (%), from STEP_COLUMNS."""
    x = np.asarray(steps["step"], float)
    blocks = 100 * np.asarray(steps["kv_cache_usage_perc"], float)
    tokens = blocks * np.asarray(steps["token_usage"], float)
    return dict(x=x, blocks=blocks, tokens=tokens)


def usage_over_time(steps, contiguous=None, labels: tuple[str, str] = ("paged", "contiguous")) -> go.Figure:
    """Blocks in use vs slots holding tokens (% of the pool) per step; the gap is internal
    fragmentation. `contiguous`: the same columns from a contiguous run of the same trace."""
    fig = go.Figure()
    s = usage_series(steps)
    fig.add_trace(go.Scatter(x=s["x"], y=s["blocks"], name=f"{labels[0]}: blocks in use", line=dict(color="#3b6fb6")))
    fig.add_trace(go.Scatter(x=s["x"], y=s["tokens"], name=f"{labels[0]}: slots holding tokens",
                             line=dict(color="#2ca25f"), fill="tonexty"))
    if contiguous is not None and len(contiguous):
        c = usage_series(contiguous)
        fig.add_trace(go.Scatter(x=c["x"], y=c["blocks"], name=f"{labels[1]}: reserved",
                                 line=dict(color="#e6550d", dash="dash")))
        fig.add_trace(go.Scatter(x=c["x"], y=c["tokens"], name=f"{labels[1]}: holding tokens",
                                 line=dict(color="#a63603", dash="dot")))
    fig.update_layout(title="memory: blocks reserved vs tokens held", yaxis_title="% of the KV pool",
                      yaxis_range=[0, 105], height=320, margin=dict(l=50, r=10, t=50, b=40),
                      legend=dict(orientation="h", y=1.0, yanchor="bottom", x=1, xanchor="right"))
    fig.update_xaxes(title_text="step", **count_axis())
    return fig


def timeline_series(steps) -> dict:
    x = np.asarray(steps["step"], float)
    pre = np.asarray(steps["num_prefill_tokens"], float)
    dec = np.asarray(steps["num_decode_tokens"], float)
    ms = 1e3 * np.asarray(steps["step_time_s"], float)
    pm = np.asarray(steps["num_preempted"], float) > 0
    sw = (np.asarray(steps["num_swapped_out_blocks"], float) + np.asarray(steps["num_swapped_in_blocks"], float)) > 0
    top = float(ms.max()) if len(ms) else 1.0
    return dict(x=x, prefill=pre, decode=dec, ms=ms, pre_x=x[pm], pre_y=np.full(pm.sum(), top * 1.05),
                swap_x=x[sw], swap_y=np.full(sw.sum(), top * 1.12))


def _timeline_traces(s: dict, showlegend: bool = True) -> list[tuple[go.BaseTraceType, bool]]:
    """(trace, on the secondary axis) of one step timeline."""
    return [
        (go.Bar(x=s["x"], y=s["prefill"], name="prefill tokens", marker_color="#f4a259", legendgroup="prefill",
                showlegend=showlegend), False),
        (go.Bar(x=s["x"], y=s["decode"], name="decode tokens", marker_color="#3b6fb6", legendgroup="decode",
                showlegend=showlegend), False),
        (go.Scatter(x=s["x"], y=s["ms"], name="step time (ms)", mode="lines", line=dict(color="black", width=1.5),
                    legendgroup="ms", showlegend=showlegend), True),
        (go.Scatter(x=s["pre_x"], y=s["pre_y"], name="preemption", mode="markers", legendgroup="pre",
                    marker=dict(symbol="x", color="red", size=9), showlegend=showlegend), True),
        (go.Scatter(x=s["swap_x"], y=s["swap_y"], name="swap", mode="markers", legendgroup="swap",
                    marker=dict(symbol="triangle-down", color="purple", size=9), showlegend=showlegend), True),
    ]


def step_timeline(steps, title: str = "steps: prefill and decode tokens, step time",
                  token_max: float | None = None, ms_max: float | None = None) -> go.Figure:
    """Stacked prefill/decode tokens per step (bars), step time (line, right axis), preemption
    (red x) and swap (purple triangle) markers. `token_max` / `ms_max` fix the two y ranges (to
    compare timelines on one scale; `compare_step_timelines` does it for you)."""
    s = timeline_series(steps)
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    for tr, sec in _timeline_traces(s):
        fig.add_trace(tr, secondary_y=sec)
    fig.update_layout(barmode="stack", title=title, height=340, margin=dict(l=60, r=60, t=50, b=40),
                      legend=dict(orientation="h", y=-0.2), bargap=0.05)
    fig.update_xaxes(title_text="step", **count_axis())
    fig.update_yaxes(title_text="tokens in the step", secondary_y=False, **count_axis())
    fig.update_yaxes(title_text="step time (ms)", secondary_y=True, rangemode="tozero")
    if token_max is not None:
        fig.update_yaxes(range=[0, 1.05 * token_max], autorange=False, secondary_y=False)
    if ms_max is not None:
        fig.update_yaxes(range=[0, 1.15 * ms_max], autorange=False, secondary_y=True)
    return fig


def compare_step_timelines(frames: Mapping[str, object], title: str = "step timelines on one scale",
                           panel_px: int = 260) -> go.Figure:
    """Step timelines of several runs stacked, every panel on the same token and step-time scales
    (so a taller bar is a bigger step whichever panel it is in). `frames`: label -> steps frame."""
    labels = list(frames)
    series = [timeline_series(frames[k]) for k in labels]
    tok = max([float((s["prefill"] + s["decode"]).max()) if len(s["x"]) else 1.0 for s in series] + [1.0])
    ms = max([float(s["ms"].max()) if len(s["x"]) else 1.0 for s in series] + [1e-9])
    fig = make_subplots(rows=len(labels), cols=1, subplot_titles=labels, vertical_spacing=0.12 / max(1, len(labels) - 1)
                        if len(labels) > 1 else 0.0, specs=[[{"secondary_y": True}]] * len(labels))
    for i, s in enumerate(series, start=1):
        s = dict(s, pre_y=np.full(len(s["pre_x"]), ms * 1.05), swap_y=np.full(len(s["swap_x"]), ms * 1.12))
        for tr, sec in _timeline_traces(s, showlegend=i == 1):
            fig.add_trace(tr, row=i, col=1, secondary_y=sec)
        fig.update_yaxes(title_text="tokens in the step", range=[0, 1.05 * tok], autorange=False,
                         row=i, col=1, secondary_y=False, **count_axis(tok))
        fig.update_yaxes(title_text="step time (ms)", range=[0, 1.15 * ms], autorange=False, row=i, col=1,
                         secondary_y=True)
        fig.update_xaxes(row=i, col=1, **count_axis(float(s["x"].max()) if len(s["x"]) else None))
    fig.update_xaxes(title_text="step", row=len(labels), col=1)
    fig.update_layout(barmode="stack", title=title, height=panel_px * len(labels) + 150, bargap=0.05,
                      margin=dict(l=60, r=60, t=70, b=50), legend=dict(orientation="h", y=-0.08, yanchor="top"))
    return fig


def ecdf(values) -> tuple[np.ndarray, np.ndarray]:
    """Sorted finite values and the share of samples at or below each (an empirical CDF)."""
    v = np.sort(np.asarray(values, float)[np.isfinite(np.asarray(values, float))])
    return v, (np.arange(1, len(v) + 1) / len(v)) if len(v) else np.zeros(0)


def latency_series(req, tbt, unit: str = "ms") -> dict:
    """ECDF points of TTFT and TBT (in `unit`): ttft_x, ttft_y, tbt_x, tbt_y."""
    k = 1e3 if unit == "ms" else 1.0
    tx, ty = ecdf(k * np.asarray(req["ttft_s"], float) if len(req) else np.zeros(0))
    bx, by = ecdf(k * np.asarray(tbt, float))
    return dict(ttft_x=tx, ttft_y=ty, tbt_x=bx, tbt_y=by)


def _has_tail(values: Sequence[np.ndarray]) -> bool:
    """True when the largest sample is over 10x the median (a linear axis hides the tail or the body)."""
    v = np.concatenate([np.asarray(a, float) for a in values]) if values else np.zeros(0)
    v = v[np.isfinite(v) & (v > 0)]
    return len(v) > 1 and v.max() > 10 * np.median(v)


def latency_distributions(runs: Mapping[str, tuple], unit: str = "ms", kind: str | None = None) -> go.Figure:
    """TTFT and TBT distributions. `runs`: label -> (requests frame with ttft_s, TBT samples in s).

    `kind="ecdf"` (the default for two or more runs): one empirical CDF per run, on a log axis
    when the samples span more than 10x, so overlapping runs and long tails both stay visible.
    `kind="histogram"` (the default for one run, as the live view draws): a count histogram per
    panel (traces 0 and 1 are the TTFT and TBT samples)."""
    kind = kind or ("ecdf" if len(runs) > 1 else "histogram")
    k = 1e3 if unit == "ms" else 1.0
    fig = make_subplots(rows=1, cols=2, subplot_titles=("time to first token", "time between tokens"),
                        horizontal_spacing=0.1)
    palette = ("#3b6fb6", "#e6550d", "#2ca25f", "#756bb1")
    ttfts, tbts = [], []
    for i, (label, (req, tbt)) in enumerate(runs.items()):
        c = palette[i % len(palette)]
        ttft = k * np.asarray(req["ttft_s"], float) if len(req) else np.zeros(0)
        tb = k * np.asarray(tbt, float)
        ttfts.append(ttft)
        tbts.append(tb)
        if kind == "histogram":
            fig.add_trace(go.Histogram(x=ttft, name=f"{label} TTFT", marker_color=c, nbinsx=30, legendgroup=label),
                          row=1, col=1)
            fig.add_trace(go.Histogram(x=tb, name=f"{label} TBT", marker_color=c, nbinsx=40, legendgroup=label,
                                       showlegend=False), row=1, col=2)
        else:
            for col, vals in ((1, ttft), (2, tb)):
                x, y = ecdf(vals)
                fig.add_trace(go.Scatter(x=x, y=y, mode="lines", line_shape="hv", name=label, legendgroup=label,
                                         showlegend=col == 1, line=dict(color=c, width=2),
                                         hovertemplate=f"{label}<br>%{{y:.0%}} ≤ %{{x:.3g}} {unit}<extra></extra>"),
                              row=1, col=col)
    fig.update_layout(height=340, margin=dict(l=60, r=10, t=50, b=50),
                      legend=dict(orientation="h", y=1.08, yanchor="bottom", x=1, xanchor="right"))
    for col, vals in ((1, ttfts), (2, tbts)):
        log = kind == "ecdf" and _has_tail(vals)
        fig.update_xaxes(title_text=f"{unit}{' (log)' if log else ''}", type="log" if log else "linear", row=1, col=col)
    if kind == "histogram":
        fig.update_yaxes(title_text="count", col=1, **count_axis())
        fig.update_yaxes(col=2, **count_axis())
    else:
        fig.update_yaxes(title_text="share of samples ≤ x", tickformat=".0%", range=[0, 1.02], col=1)
        fig.update_yaxes(tickformat=".0%", range=[0, 1.02], col=2)
    return fig


def latency_summary(runs: Mapping[str, tuple]):
    """A small table: per run TTFT p50/p99 and TBT p50/p99/max (ms)."""
    import pandas as pd
    out = []
    for label, (req, tbt) in runs.items():
        ttft = 1e3 * np.asarray(req["ttft_s"], float) if len(req) else np.zeros(1)
        tb = 1e3 * np.asarray(tbt, float) if len(tbt) else np.zeros(1)
        out.append(dict(run=label, ttft_p50_ms=np.nanpercentile(ttft, 50), ttft_p99_ms=np.nanpercentile(ttft, 99),
                        tbt_p50_ms=np.percentile(tb, 50), tbt_p99_ms=np.percentile(tb, 99), tbt_max_ms=tb.max()))
    return pd.DataFrame(out).set_index("run").round(1)


def prefix_cache(steps, events=None) -> go.Figure:
    """Cumulative prefix-cache hit rate (tokens) per step and evictions per step (from events)."""
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    x = np.asarray(steps["step"], float)
    q = np.asarray(steps["prefix_cache_queries"], float)
    h = np.asarray(steps["prefix_cache_hits"], float)
    rate = np.divide(100 * h, q, out=np.zeros_like(h), where=q > 0)
    fig.add_trace(go.Scatter(x=x, y=rate, name="hit rate (% of prompt tokens)", line=dict(color="#2ca25f")))
    fig.add_trace(go.Scatter(x=x, y=np.asarray(steps["num_cached_free_blocks"], float), name="cached-free blocks",
                             line=dict(color="#9ecae1", dash="dot")), secondary_y=True)
    if events is not None and len(events):
        ev_steps = np.asarray(events.loc[events["kind"] == "evict", "step"], int)
        if len(ev_steps):
            u, c = np.unique(ev_steps, return_counts=True)
            fig.add_trace(go.Bar(x=u, y=c, name="evictions", marker_color="#e6550d", opacity=0.7), secondary_y=True)
    fig.update_layout(title="prefix cache", height=320, margin=dict(l=50, r=50, t=50, b=40),
                      legend=dict(orientation="h", y=-0.2))
    fig.update_yaxes(title_text="hit rate %", range=[0, 100], secondary_y=False)
    fig.update_yaxes(title_text="blocks", secondary_y=True, **count_axis())
    fig.update_xaxes(title_text="step", **count_axis())
    return fig


def block_lifetimes(events) -> go.Figure:
    """Histograms of block lifetimes (allocation -> free) and reuse gaps (free -> next allocation), in steps."""
    from paged import telemetry
    life = telemetry.block_lifetimes(events)["lifetime_steps"].dropna().to_numpy(float)
    gaps = np.asarray(telemetry.reuse_distances(events), float)
    fig = make_subplots(rows=1, cols=2, subplot_titles=("lifetime (steps)", "reuse gap (steps)"))
    for col, (vals, name, color) in enumerate(((life, "lifetime", "#3b6fb6"), (gaps, "reuse gap", "#e6550d")), 1):
        top = int(vals.max()) if len(vals) else 0
        # one bin per step while that is at most 40 bins: integer bin edges, integer counts
        bins = dict(start=-0.5, end=top + 0.5, size=max(1, math.ceil((top + 1) / 40)))
        fig.add_trace(go.Histogram(x=vals, name=name, marker_color=color, xbins=bins), row=1, col=col)
        counts = np.histogram(vals, bins=np.arange(-0.5, top + bins["size"] + 0.5, bins["size"]))[0] if len(vals) else [0]
        fig.update_yaxes(title_text="blocks" if col == 1 else None, row=1, col=col, **count_axis(max(counts)))
        fig.update_xaxes(title_text="steps", row=1, col=col, **count_axis(top))
    fig.update_layout(height=300, showlegend=False, margin=dict(l=60, r=10, t=50, b=50))
    return fig
