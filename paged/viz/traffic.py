"""Figures of real traffic (``paged.studies.mooncake``, ``paged.studies.cache_replay``): traces
and their reuse tables -> ``go.Figure``. Pure: frames in, figures out."""
from __future__ import annotations

from typing import Mapping

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .figures import ecdf
from .sizing import count_axis, styled

__all__ = ["lengths_figure", "arrivals_figure", "reuse_figure", "capacity_figure"]

COLORS = ("#264653", "#e76f51", "#2a9d8f", "#e9c46a", "#8d99ae")


def lengths_figure(traces: Mapping[str, pd.DataFrame]) -> go.Figure:
    """Share of requests with at most x prompt (left) and output (right) tokens, per trace (log x)."""
    fig = make_subplots(1, 2, subplot_titles=("prompt tokens", "output tokens"), horizontal_spacing=0.1)
    for i, (name, tr) in enumerate(traces.items()):
        for col, column in ((1, "prompt_tokens"), (2, "output_tokens")):
            x, y = ecdf(tr[column].to_numpy())
            fig.add_trace(go.Scatter(x=x, y=100 * y, mode="lines", name=name, legendgroup=name, showlegend=col == 1,
                                     line=dict(color=COLORS[i % len(COLORS)])), 1, col)
    fig.update_xaxes(type="log", title_text="tokens per request (log)")
    fig.update_yaxes(title_text="% of requests with at most x", range=[0, 100], col=1)
    fig.update_yaxes(range=[0, 100], col=2)
    return styled(fig, "How long real requests are", 380, margin=(60, 20, 70, 50))


def arrivals_figure(traces: Mapping[str, pd.DataFrame], bin_s: float = 60.0) -> go.Figure:
    """Requests arriving per ``bin_s`` seconds over each trace's hour."""
    fig = go.Figure()
    top = 0.0
    for i, (name, tr) in enumerate(traces.items()):
        t = tr["arrival_time"].to_numpy(dtype=float)
        edges = np.arange(0.0, float(t.max()) + bin_s, bin_s)
        counts, _ = np.histogram(t, bins=edges) if len(edges) > 1 else (np.array([len(t)]), None)
        top = max(top, float(counts.max()))
        fig.add_trace(go.Scatter(x=edges[: len(counts)] / 60, y=counts, mode="lines", name=name,
                                 line=dict(color=COLORS[i % len(COLORS)], shape="hv")))
    styled(fig, f"Arrivals: requests per {bin_s:g} s", 340, x="time since the first request (min)",
           y=f"requests per {bin_s:g} s")
    return fig.update_yaxes(**count_axis(top))


def reuse_figure(depths: Mapping[str, pd.DataFrame]) -> go.Figure:
    """Share of requests whose reused prefix (leading blocks an earlier request had) is at most x
    of their prompt; the legend gives each trace's token-weighted reuse."""
    fig = go.Figure()
    for i, (name, d) in enumerate(depths.items()):
        x, y = ecdf(100 * d["reused_share"].to_numpy())
        total = d["reused_tokens"].sum() / d["prompt_tokens"].sum()
        fig.add_trace(go.Scatter(x=x, y=100 * y, mode="lines", name=f"{name} ({total:.0%} of all prompt tokens)",
                                 line=dict(color=COLORS[i % len(COLORS)], shape="hv")))
    return styled(fig, "Reuse depth: how much of each prompt an earlier request already sent", 360,
                  x="reused prefix (% of the prompt)", y="% of requests with at most x", xaxis_range=[0, 100],
                  yaxis_range=[0, 100], legend=dict(x=0.02, y=0.98, bgcolor="rgba(255,255,255,0.7)"))


def capacity_figure(curve: pd.DataFrame, marks: Mapping[str, float] | None = None) -> go.Figure:
    """Hit rate against cache capacity (log x), one line per trace, its unlimited maximum dashed;
    ``marks``: labelled capacities (a node's HBM, its DRAM, a fleet's DRAM) as vertical lines."""
    fig = go.Figure()
    for i, (name, c) in enumerate(curve.groupby("trace", sort=False)):
        color = COLORS[i % len(COLORS)]
        lim = c[~c["unlimited"]].sort_values("capacity_tokens")
        fig.add_trace(go.Scatter(x=lim["capacity_tokens"], y=100 * lim["hit_rate"], mode="lines+markers", name=name,
                                 line=dict(color=color),
                                 customdata=100 * lim["fraction_of_max"],
                                 hovertemplate="%{x:,.0f} tokens: %{y:.1f}% hit (%{customdata:.0f}% of max)"))
        top = 100 * float(c["max_hit_rate"].iloc[0])
        fig.add_hline(y=top, line_dash="dot", line_color=color, annotation_text=f"{name} maximum {top:.0f}%",
                      annotation_position=("top left", "bottom right", "top right", "bottom left")[i % 4],
                      annotation_font_color=color)
    for j, (label, x) in enumerate((marks or {}).items()):
        fig.add_vline(x=x, line_dash="dash", line_color="grey")
        fig.add_annotation(x=np.log10(x), y=1.0 - 0.09 * j, yref="paper", text=label, showarrow=False,
                           xanchor="left", font=dict(size=11, color="grey"), bgcolor="rgba(255,255,255,0.8)")
    return styled(fig, "Prefix-cache hit rate against cache capacity (LRU, cache-only replay)", 420,
                  x="cache capacity (tokens, log)", y="hit rate (% of prompt tokens)", xaxis_type="log",
                  yaxis_range=[0, 100], legend=dict(x=0.75, y=0.05))
