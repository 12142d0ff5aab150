"""Pure figure builders: snapshot / DataFrame -> plotly `go.Figure` (no widgets, no state).

Each `*_data` / `*_series` function returns the trace arrays a live view assigns in place; the
builder of the same name wraps them in a figure. All traces are SVG (no WebGL: browsers cap
contexts). Every figure sizes itself from its content (`paged.viz.sizing`; `tests/figure_check.py`
verifies it): integer ticks on axes that count, ECDFs where latency distributions are compared.
The pool's own figures (block grid, block tables) live in `paged.viz.pool_figures` and are
re-exported here, so `figures.block_grid(...)` and the rest keep working.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .pool_figures import (CONTIGUOUS_STATES, DENSE_ROW_PX, DENSITY_COLORS, GRID_COLS, MAX_CELLS,  # noqa: F401
                           PAGED_STATES, STATE_COLORS, STATE_NAMES, block_grid, block_tables, blocks_per_cell,
                           contiguous_grid, grid_data, grid_shape, state_colorscale, tables_data)
from .sizing import count_axis, styled


def usage_series(steps) -> dict:
    """x = step; block usage and token share of the pool (%), from STEP_COLUMNS."""
    x = np.asarray(steps["step"], float)
    blocks = 100 * np.asarray(steps["kv_cache_usage_perc"], float)
    return dict(x=x, blocks=blocks, tokens=blocks * np.asarray(steps["token_usage"], float))


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
    styled(fig, "memory: blocks reserved vs tokens held", 320, y="% of the KV pool", margin=(50, 10, 50, 40),
           yaxis_range=[0, 105], legend=dict(orientation="h", y=1.0, yanchor="bottom", x=1, xanchor="right"))
    return fig.update_xaxes(title_text="step", **count_axis())


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


def step_timeline(steps, title: str = "steps: prefill and decode tokens, step time") -> go.Figure:
    """Stacked prefill/decode tokens per step (bars), step time (line, right axis), preemption
    (red x) and swap (purple triangle) markers (`compare_step_timelines`: several on one scale)."""
    s = timeline_series(steps)
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    for tr, sec in _timeline_traces(s):
        fig.add_trace(tr, secondary_y=sec)
    styled(fig, title, 340, legend_y=-0.2, margin=(60, 60, 50, 40), barmode="stack", bargap=0.05)
    fig.update_xaxes(title_text="step", **count_axis())
    fig.update_yaxes(title_text="tokens in the step", secondary_y=False, **count_axis())
    return fig.update_yaxes(title_text="step time (ms)", secondary_y=True, rangemode="tozero")


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
    return styled(fig, title, panel_px * len(labels) + 150, margin=(60, 60, 70, 50), barmode="stack", bargap=0.05,
                  legend=dict(orientation="h", y=-0.08, yanchor="top"))


def ecdf(values) -> tuple[np.ndarray, np.ndarray]:
    """Sorted finite values and the share of samples at or below each (an empirical CDF)."""
    v = np.sort(np.asarray(values, float)[np.isfinite(np.asarray(values, float))])
    return v, (np.arange(1, len(v) + 1) / len(v)) if len(v) else np.zeros(0)


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
    styled(fig, "prefix cache", 320, legend_y=-0.2, margin=(50, 50, 50, 40))
    fig.update_yaxes(title_text="hit rate %", range=[0, 100], secondary_y=False)
    fig.update_yaxes(title_text="blocks", secondary_y=True, **count_axis())
    return fig.update_xaxes(title_text="step", **count_axis())


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
    return fig.update_layout(height=300, showlegend=False, margin=dict(l=60, r=10, t=50, b=50))
