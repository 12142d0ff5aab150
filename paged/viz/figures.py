"""Pure figure builders: snapshot / DataFrame -> plotly `go.Figure` (no widgets, no state).

Each `*_data` function returns the trace arrays a live view assigns in place; the builder of
the same name wraps them in a figure. All traces are SVG (no WebGL: browsers cap contexts).
Block grids draw at most `MAX_CELLS` cells; larger pools are drawn one page at a time.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from paged.core.snapshot import STATE_NAMES, STATUS_NAMES, ContiguousSnapshot, KVSnapshot

STATE_COLORS = ("#e9e9ee", "#9ecae1", "#3b6fb6", "#e6550d", "#2ca25f", "#f4b6c2")
MAX_CELLS = 64 * 64
NAN = float("nan")


def state_colorscale(colors: Sequence[str] = STATE_COLORS) -> list[list]:
    """A stepped colourscale: code i (with zmin=-0.5, zmax=len-0.5) gets colors[i] exactly."""
    n = len(colors)
    scale = []
    for i, c in enumerate(colors):
        scale += [[i / n, c], [(i + 1) / n, c]]
    return scale


def _legend_traces() -> list[go.Scatter]:
    """Invisible markers that give the heatmap a discrete legend (one per state)."""
    return [go.Scatter(x=[None], y=[None], mode="markers", name=name, showlegend=True,
                       marker=dict(size=10, color=STATE_COLORS[i], symbol="square"))
            for i, name in enumerate(STATE_NAMES)]


def grid_shape(num_blocks: int, cols: int | None = None) -> tuple[int, int]:
    """(rows, cols) of one page: about twice as wide as tall, at most 64 x 64."""
    n = min(num_blocks, MAX_CELLS)
    cols = cols or min(64, max(8, math.ceil(math.sqrt(2 * n))))
    return math.ceil(n / cols), cols


def _json_grid(z: np.ndarray) -> list:
    """A 2-D float array as nested lists with None for NaN (NaN is not valid JSON on the wire)."""
    out = z.astype(object)
    out[np.isnan(z)] = None
    return out.tolist()


def _hex(k: int) -> str:
    return f"{k:08x}" if k else "-"


def grid_data(snap: KVSnapshot, cols: int | None = None, page: int = 0, tokenizer=None,
              highlight: str | None = None) -> dict:
    """z (state codes), hover text and cell coordinates of the blocks of one page."""
    rows, cols = grid_shape(snap.num_blocks, cols)
    per = rows * cols
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
        hl_x, hl_y = (mine % cols).tolist(), (mine // cols).tolist()
    return dict(z=_json_grid(z.reshape(rows, cols)), text=np.array(text, object).reshape(rows, cols).tolist(),
                rows=rows, cols=cols, first=lo, last=hi, hl_x=hl_x, hl_y=hl_y,
                num_pages=math.ceil(snap.num_blocks / per))


def block_grid(snap: KVSnapshot, cols: int | None = None, page: int = 0, tokenizer=None,
               highlight: str | None = None, title: str | None = None) -> go.Figure:
    """The physical block pool: one cell per block, coloured by state (one go.Heatmap)."""
    d = grid_data(snap, cols, page, tokenizer, highlight)
    fig = go.Figure()
    fig.add_trace(go.Heatmap(z=d["z"], text=d["text"], hovertemplate="%{text}<extra></extra>",
                             zmin=-0.5, zmax=len(STATE_COLORS) - 0.5, colorscale=state_colorscale(),
                             showscale=False, xgap=1, ygap=1, name="blocks"))
    fig.add_trace(go.Scatter(x=d["hl_x"], y=d["hl_y"], mode="markers", hoverinfo="skip", showlegend=False,
                             marker=dict(symbol="square-open", size=12, color="black", line=dict(width=2)),
                             name="selected request"))
    for t in _legend_traces():
        fig.add_trace(t)
    pages = f" · page {page + 1}/{d['num_pages']} (blocks {d['first']}-{d['last'] - 1})" if d["num_pages"] > 1 else ""
    fig.update_layout(title=title or f"block pool at step {snap.step}: {snap.num_blocks} blocks of {snap.block_size} tokens{pages}",
                      height=max(260, 22 * d["rows"] + 120), margin=dict(l=30, r=10, t=50, b=30),
                      legend=dict(orientation="h", y=-0.08), plot_bgcolor="white")
    fig.update_xaxes(showticklabels=False, showgrid=False, zeroline=False, range=[-0.5, d["cols"] - 0.5])
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
    """Each request's block table: logical index -> physical block id (cell text), coloured by state."""
    d = tables_data(snap, max_requests, highlight)
    fig = go.Figure(go.Heatmap(z=d["z"], x=d["x"], y=d["y"], text=d["text"], texttemplate="%{text}",
                               customdata=d["hover"], hovertemplate="%{customdata}<extra></extra>",
                               zmin=-0.5, zmax=len(STATE_COLORS) - 0.5, colorscale=state_colorscale(),
                               showscale=False, xgap=2, ygap=2))
    fig.update_layout(title=f"block tables at step {snap.step} (cell = physical block id)",
                      height=max(220, 26 * len(d["y"]) + 100), margin=dict(l=10, r=10, t=50, b=40),
                      xaxis_title="logical block", plot_bgcolor="white")
    fig.update_yaxes(autorange="reversed")
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
    for t in _legend_traces():
        fig.add_trace(t)
    pct = 100 * snap.num_filled / snap.num_reserved if snap.num_reserved else 0.0
    fig.update_layout(title=title or f"contiguous reservations: {snap.num_reserved} slots reserved, "
                      f"{snap.num_filled} hold tokens ({pct:.0f}%)", height=max(260, 22 * rows + 120),
                      margin=dict(l=30, r=10, t=50, b=30), legend=dict(orientation="h", y=-0.08), plot_bgcolor="white")
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
    fig.update_layout(title="memory: blocks reserved vs tokens held", xaxis_title="step",
                      yaxis_title="% of the KV pool", yaxis_range=[0, 105], height=320,
                      margin=dict(l=50, r=10, t=50, b=40))
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


def step_timeline(steps, title: str = "steps: prefill and decode tokens, step time") -> go.Figure:
    """Stacked prefill/decode tokens per step (bars), step time (line, right axis), preemption
    (red x) and swap (purple triangle) markers."""
    s = timeline_series(steps)
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(go.Bar(x=s["x"], y=s["prefill"], name="prefill tokens", marker_color="#f4a259"), secondary_y=False)
    fig.add_trace(go.Bar(x=s["x"], y=s["decode"], name="decode tokens", marker_color="#3b6fb6"), secondary_y=False)
    fig.add_trace(go.Scatter(x=s["x"], y=s["ms"], name="step time (ms)", mode="lines",
                             line=dict(color="black", width=1.5)), secondary_y=True)
    fig.add_trace(go.Scatter(x=s["pre_x"], y=s["pre_y"], name="preemption", mode="markers",
                             marker=dict(symbol="x", color="red", size=9)), secondary_y=True)
    fig.add_trace(go.Scatter(x=s["swap_x"], y=s["swap_y"], name="swap", mode="markers",
                             marker=dict(symbol="triangle-down", color="purple", size=9)), secondary_y=True)
    fig.update_layout(barmode="stack", title=title, height=340, margin=dict(l=50, r=50, t=50, b=40),
                      legend=dict(orientation="h", y=-0.2), bargap=0.05)
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text="tokens in the step", secondary_y=False)
    fig.update_yaxes(title_text="step time (ms)", secondary_y=True, rangemode="tozero")
    return fig


def latency_distributions(runs: Mapping[str, tuple], unit: str = "ms") -> go.Figure:
    """TTFT and TBT histograms. `runs`: label -> (requests frame with ttft_s, TBT samples in s)."""
    k = 1e3 if unit == "ms" else 1.0
    fig = make_subplots(rows=1, cols=2, subplot_titles=("time to first token", "time between tokens"))
    palette = ("#3b6fb6", "#e6550d", "#2ca25f", "#756bb1")
    for i, (label, (req, tbt)) in enumerate(runs.items()):
        c = palette[i % len(palette)]
        ttft = k * np.asarray(req["ttft_s"], float) if len(req) else np.zeros(0)
        # one bin group per panel: overlaid runs share their bins, so their heights compare
        fig.add_trace(go.Histogram(x=ttft, name=f"{label} TTFT", marker_color=c, opacity=0.6, nbinsx=30,
                                   legendgroup=label, bingroup="ttft"), row=1, col=1)
        fig.add_trace(go.Histogram(x=k * np.asarray(tbt, float), name=f"{label} TBT", marker_color=c, opacity=0.6,
                                   nbinsx=40, legendgroup=label, bingroup="tbt"), row=1, col=2)
    fig.update_layout(barmode="overlay", height=320, margin=dict(l=50, r=10, t=50, b=40))
    fig.update_xaxes(title_text=unit)
    fig.update_yaxes(title_text="count", col=1)
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
    fig.update_yaxes(title_text="blocks", secondary_y=True, rangemode="tozero")
    fig.update_xaxes(title_text="step")
    return fig


def block_lifetimes(events) -> go.Figure:
    """Histograms of block lifetimes (allocation -> free) and reuse gaps (free -> next allocation), in steps."""
    from paged import telemetry
    life = telemetry.block_lifetimes(events)
    gaps = telemetry.reuse_distances(events)
    fig = make_subplots(rows=1, cols=2, subplot_titles=("lifetime (steps)", "reuse gap (steps)"))
    fig.add_trace(go.Histogram(x=life["lifetime_steps"].dropna().astype(float), name="lifetime",
                               marker_color="#3b6fb6"), row=1, col=1)
    fig.add_trace(go.Histogram(x=gaps.astype(float), name="reuse gap", marker_color="#e6550d"), row=1, col=2)
    fig.update_layout(height=300, showlegend=False, margin=dict(l=50, r=10, t=50, b=40))
    return fig
