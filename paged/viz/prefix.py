"""Figures of the prefix-caching study (``paged.studies.prefix_caching``): its tables -> ``go.Figure``."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from .sizing import styled


def caching_figure(table: pd.DataFrame) -> go.Figure:
    """Prompt tokens computed vs served from the cache, per setting."""
    computed = table["prefill_tokens_computed"]
    fig = go.Figure([
        go.Bar(x=table["setting"], y=computed, name="prefill tokens computed", marker_color="#264653",
               text=[f"{c:,}" for c in computed], textposition="inside"),
        go.Bar(x=table["setting"], y=table["hit_tokens"], name="served from the prefix cache", marker_color="#2a9d8f",
               text=[f"{r:.0%} hit" for r in table["hit_rate"]], textposition="outside"),
    ])
    return styled(fig, "Prompt tokens: computed vs reused", 360, y="tokens", margin=(60, 20, 50, 40), barmode="stack")


def eviction_figure(sweep: pd.DataFrame) -> go.Figure:
    """Hit rate against pool size; the dashed line is the size of all system prompts together."""
    fig = go.Figure(go.Scatter(x=sweep["pool_tokens"], y=100 * sweep["hit_rate"], mode="lines+markers",
                               name="hit rate", line=dict(color="#2a9d8f")))
    fig.add_vline(x=float(sweep["prefix_tokens_total"].iloc[0]), line_dash="dash", line_color="grey",
                  annotation_text="all system prompts", annotation_position="top left")
    return styled(fig, "LRU eviction: a smaller pool forgets shared prefixes", 360, x="KV pool (tokens)",
                  y="prefix-cache hit rate (% of prompt tokens)", xaxis_type="log", yaxis_range=[0, 100])


__all__ = ["caching_figure", "eviction_figure"]
