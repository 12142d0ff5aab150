"""Figures for notebook 08 (tiers, swap, sharing): pure, study DataFrame -> go.Figure, SVG traces only:
``tier_figure`` (``host_tier.tier_study``), ``streaming_figure`` (``offload.streaming_study``),
``sharing_figure`` (``sharing.sharing_study``). Each reads only the study's documented columns and
draws what it finds (a toy-size study still gives a figure).
"""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .sizing import label_positions, styled

__all__ = ["sharing_figure", "streaming_figure", "tier_figure"]

MAX_LABELS = 12


def tier_figure(df: pd.DataFrame) -> go.Figure:
    """Bars: host-tier moves (swaps) per variant; markers: prefix hit rate split by tier."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("blocks moved between tiers", "prefix hit rate"),
                        horizontal_spacing=0.12)
    names = list(df["variant"])
    fig.add_trace(go.Bar(x=names, y=df["swaps"], name="blocks moved", marker_color="#4C78A8",
                         hovertemplate="%{x}<br>%{y} blocks<extra></extra>"), 1, 1)
    fig.add_trace(go.Bar(x=names, y=df["gpu_hit_rate"], name="GPU-tier hits", marker_color="#72B7B2",
                         offsetgroup="hits"), 1, 2)
    fig.add_trace(go.Bar(x=names, y=df["host_hit_rate"], name="host-tier hits", marker_color="#F58518",
                         offsetgroup="hits", base=df["gpu_hit_rate"].tolist()), 1, 2)  # stacked on the GPU hits
    fig.update_layout(barmode="group", height=420, title="host tier: what moves, what hits",
                      legend=dict(orientation="h", y=-0.45), margin=dict(b=160))
    fig.update_xaxes(tickangle=30)
    fig.update_yaxes(title_text="blocks", row=1, col=1)
    return fig.update_yaxes(title_text="share of prompt tokens", range=[0, 1], row=1, col=2)


def streaming_figure(df: pd.DataFrame) -> go.Figure:
    """Throughput vs TBT, both relative to the device-only run, one marker per variant and setting
    (circles: the full KV pool on the device; diamonds: a fraction of it)."""
    fig = go.Figure()
    for variant, g in df.groupby("variant", sort=False):
        fig.add_trace(go.Scatter(
            x=g["tbt_vs_device"], y=g["throughput_vs_device"], mode="markers", name=variant,
            text=[f"KV on device {k:g}, ctx {c}" for k, c in zip(g["kv_fraction"], g["context"])],
            marker=dict(size=11, symbol=["circle" if k >= 1 else "diamond" for k in g["kv_fraction"]]),
            hovertemplate=variant + "<br>%{text}<br>TBT %{x:.2f}x, throughput %{y:.2f}x"
                                                "<extra></extra>"))
    fig.add_hrect(y0=2.0, y1=3.0, fillcolor="#F58518", opacity=0.12, line_width=0,
                  annotation_text="the seed's 2-3x", annotation_position="top left")
    return styled(fig, "KV streaming from the host: throughput vs time between tokens (vs device only)", 460,
                  x="TBT / device-only TBT", y="throughput / device-only throughput", margin=None, xaxis_type="log")


def sharing_figure(df: pd.DataFrame) -> go.Figure:
    """Left: KLD vs memory saved for the k-pair configs (by order; x from 0). Right: each pair's KLD vs the
    JS distance of its two layers' attention maps (the seed's "if attention patterns are similar")."""
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12,
                        subplot_titles=("quality cost vs memory saved", "does attention similarity predict it?"))
    kp = df[df["kind"] == "k_pairs"]
    for order, g in kp.groupby("order", sort=False):  # the unshared base (KLD 0) has no place on a log axis
        g = g.sort_values("memory_saved_pct")
        x, y = list(g["memory_saved_pct"]), list(g["kld_mean"])
        fig.add_trace(go.Scatter(x=x, y=y, mode="lines+markers", name=f"pairs picked by {order}",
                                 hovertemplate="%{x:.1f}% saved, KLD %{y:.3f}<extra></extra>"), 1, 1)
    pairs = df[df["kind"] == "pair"]
    if len(pairs):
        # labels only while they can stay apart (MAX_LABELS points); more pairs name themselves on hover
        labelled = len(pairs) <= MAX_LABELS
        fig.add_trace(go.Scatter(x=pairs["js_head"], y=pairs["kld_mean"], mode="markers+text" if labelled else "markers",
                                 name="one pair", text=[str(s) for s in pairs["share_with"]],
                                 textposition=label_positions(pairs["js_head"], pairs["kld_mean"], pairs["share_with"],
                                                              log_y=True, width=380) if labelled else None,
                                 marker=dict(size=9, color="#E45756"),
                                 hovertemplate="%{text}<br>JS %{x:.3f}, KLD %{y:.3f}<extra></extra>"), 1, 2)
    fig.update_xaxes(title_text="KV memory saved (%)", rangemode="tozero", row=1, col=1)
    fig.update_xaxes(title_text="JS distance of attention maps", row=1, col=2)
    fig.update_yaxes(title_text="KLD vs unshared", type="log")  # both panels
    return styled(fig, "cross-layer KV sharing on SmolLM2-135M", 440, margin=None)
