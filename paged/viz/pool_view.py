"""Figures for the pooled KV tier (``paged.fleet.pool_study``): pure, study DataFrame -> go.Figure.

``pool_figure``: a ``capacity_sweep`` frame — hit rate (local and remote parts) and prefill
GPU-seconds against the cache per node, one line per mode (and routing, where several ran).
"""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

__all__ = ["pool_figure"]

COLORS = {"local": "#4C78A8", "pooled": "#F58518"}


def pool_figure(df: pd.DataFrame) -> go.Figure:
    """Left: hit rate vs tokens per node (dotted: the pooled tier's local part); right: prefill
    GPU-seconds. Draws whatever (mode, routing) groups the frame holds."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("prefix hit rate", "prefill GPU-seconds"),
                        horizontal_spacing=0.12)
    for (mode, routing), g in df.sort_values("tokens_per_node").groupby(["mode", "routing"], sort=False):
        name, color = f"{mode} ({routing})", COLORS.get(mode, "#54A24B")
        dash = None if routing == "cache_aware" else "dash"
        x = g["tokens_per_node"] / 1e6
        fig.add_trace(go.Scatter(x=x, y=g["hit_rate"], name=name, mode="lines+markers",
                                 line=dict(color=color, dash=dash),
                                 hovertemplate="%{x}M tokens/node<br>hit rate %{y:.3f}<extra>" + name + "</extra>"), 1, 1)
        if mode == "pooled":
            fig.add_trace(go.Scatter(x=x, y=g["local_hit_rate"], name=f"{name}: local part", mode="lines",
                                     line=dict(color=color, dash="dot")), 1, 1)
        fig.add_trace(go.Scatter(x=x, y=g["prefill_gpu_s"], name=name, mode="lines+markers", showlegend=False,
                                 line=dict(color=color, dash=dash)), 1, 2)
    fig.update_xaxes(title_text="cache per node (M tokens)", type="log")
    nodes = int(df["nodes"].iloc[0]) if len(df) else 0
    return fig.update_layout(height=420, title=f"{nodes} nodes: per-node caches vs one pooled tier",
                             legend=dict(orientation="h", y=-0.3), margin=dict(b=120))
