"""Figures of the prefix-caching study (``paged.studies.prefix_caching``): its tables and step
frames -> ``go.Figure``."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from .sizing import count_axis


def caching_figure(table: pd.DataFrame) -> go.Figure:
    """Prompt tokens computed vs served from the cache, per setting."""
    computed = table["prefill_tokens_computed"]
    fig = go.Figure([
        go.Bar(x=table["setting"], y=computed, name="prefill tokens computed", marker_color="#264653",
               text=[f"{c:,}" for c in computed], textposition="inside"),
        go.Bar(x=table["setting"], y=table["hit_tokens"], name="served from the prefix cache", marker_color="#2a9d8f",
               text=[f"{r:.0%} hit" for r in table["hit_rate"]], textposition="outside"),
    ])
    fig.update_layout(barmode="stack", title="Prompt tokens: computed vs reused", yaxis_title="tokens", height=360,
                      margin=dict(l=60, r=20, t=50, b=40))
    return fig


def hit_rate_over_steps(frames: dict[str, pd.DataFrame]) -> go.Figure:
    """Cumulative hit rate (hits / queries, tokens) per step, one line per run."""
    fig = go.Figure()
    for label, st in frames.items():
        q = np.maximum(np.asarray(st["prefix_cache_queries"], float), 1)
        fig.add_trace(go.Scatter(x=st["step"], y=100 * np.asarray(st["prefix_cache_hits"], float) / q, name=label,
                                 mode="lines+markers"))
    fig.update_layout(title="Prefix-cache hit rate so far (tokens)", xaxis_title="step", yaxis_title="% of prompt tokens",
                      yaxis_range=[0, 100], height=340, margin=dict(l=60, r=20, t=50, b=40))
    fig.update_xaxes(**count_axis(max([float(st["step"].max()) for st in frames.values() if len(st)] or [0.0])))
    return fig


def eviction_figure(sweep: pd.DataFrame) -> go.Figure:
    """Hit rate against pool size; the dashed line is the size of all system prompts together."""
    fig = go.Figure(go.Scatter(x=sweep["pool_tokens"], y=100 * sweep["hit_rate"], mode="lines+markers",
                               name="hit rate", line=dict(color="#2a9d8f")))
    total = float(sweep["prefix_tokens_total"].iloc[0])
    fig.add_vline(x=total, line_dash="dash", line_color="grey", annotation_text="all system prompts",
                  annotation_position="top left")
    fig.update_layout(title="LRU eviction: a smaller pool forgets shared prefixes", xaxis_type="log",
                      xaxis_title="KV pool (tokens)", yaxis_title="prefix-cache hit rate (% of prompt tokens)",
                      yaxis_range=[0, 100], height=360, margin=dict(l=60, r=20, t=50, b=50))
    return fig


__all__ = ["caching_figure", "eviction_figure", "hit_rate_over_steps"]
