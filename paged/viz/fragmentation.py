"""Figures of the fragmentation study (``paged.studies.fragmentation``): its frames and simulator
results -> ``go.Figure``. Column names are ``paged.telemetry.STEP_COLUMNS``."""

from __future__ import annotations

from typing import Mapping

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from paged.studies.fragmentation import label

from .sizing import count_axis, styled

HELD, RESERVED = "#2a9d8f", "#e76f51"


def token_share_figure(table: pd.DataFrame) -> go.Figure:
    """Grouped bars: share of reserved KV memory holding tokens, this simulator vs the vLLM paper."""
    fig = go.Figure([
        go.Bar(x=table["allocator"], y=100 * table["token_share_of_pool"], name="this simulator (share of the pool)",
               marker_color="#264653", text=[f"{v:.1%}" for v in table["token_share_of_pool"]], textposition="outside"),
        go.Bar(x=table["allocator"], y=100 * table["paper_token_share"], name="vLLM paper (Fig. 2)",
               marker_color="#a8dadc", text=[f"{v:.1%}" for v in table["paper_token_share"]], textposition="outside"),
    ])
    return styled(fig, "Share of KV memory holding tokens while requests wait", 380, y="% of the KV pool",
                  legend_y=-0.2, margin=(60, 20, 50, 60), barmode="group", yaxis_range=[0, 110])


def held_and_reserved(steps: pd.DataFrame, capacity_tokens: int) -> pd.DataFrame:
    """Per step: ``time_s``, ``reserved`` slots (requests' reservations or blocks) and ``held`` (slots with tokens)."""
    reserved = np.asarray(steps["kv_cache_usage_perc"], float) * capacity_tokens
    held = reserved * np.asarray(steps["token_usage"], float)
    return pd.DataFrame({"time_s": np.asarray(steps["time_s"], float), "reserved": reserved, "held": held,
                         "num_running": np.asarray(steps["num_running"])})


def reserved_vs_held_figure(results: Mapping[str, object], max_points: int = 400) -> go.Figure:
    """One panel per allocator: slots reserved (orange) and slots holding tokens (green) over simulated time."""
    keys = list(results)
    fig = make_subplots(rows=len(keys), cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=[label(k, results[k].summary["block_size"]) for k in keys])
    for i, k in enumerate(keys, start=1):
        r = results[k]
        d = held_and_reserved(r.steps, int(r.summary["kv_capacity_tokens"]))
        if len(d) > max_points:  # keep the figure light: every n-th step
            d = d.iloc[:: int(np.ceil(len(d) / max_points))]
        fig.add_trace(go.Scatter(x=d["time_s"], y=d["reserved"] / 1e3, name="reserved", legendgroup="r",
                                 showlegend=i == 1, line=dict(color=RESERVED), fill="tozeroy"), row=i, col=1)
        fig.add_trace(go.Scatter(x=d["time_s"], y=d["held"] / 1e3, name="holding tokens", legendgroup="h",
                                 showlegend=i == 1, line=dict(color=HELD), fill="tozeroy"), row=i, col=1)
        fig.update_yaxes(title_text="k slots", range=[0, r.summary["kv_capacity_tokens"] / 1e3 * 1.05], row=i, col=1)
    fig.update_xaxes(title_text="simulated time (s)", row=len(keys), col=1)
    return styled(fig, "Reserved KV slots vs slots holding tokens, same trace and memory", 170 * len(keys) + 110,
                  margin=(60, 20, 80, 50), legend=dict(orientation="h", y=1.08, x=0.6))


def block_size_figure(sweep: pd.DataFrame) -> go.Figure:
    """Internal fragmentation (bars, left) and saturation throughput (line, right) against block size."""
    x = [str(b) for b in sweep["block_size"]]
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(go.Bar(x=x, y=100 * sweep["internal_fragmentation"], name="internal fragmentation (%)",
                         marker_color=RESERVED, text=[f"{v:.1%}" for v in sweep["internal_fragmentation"]],
                         textposition="outside"), secondary_y=False)
    fig.add_trace(go.Scatter(x=x, y=sweep["throughput_req_s"], name="throughput (req/s)", mode="lines+markers",
                             line=dict(color="#264653")), secondary_y=True)
    top = float(100 * sweep["internal_fragmentation"].max())
    fig.update_yaxes(title_text="% of reserved slots empty", range=[0, max(top * 1.3, 5)], secondary_y=False)
    fig.update_yaxes(title_text="requests / s (simulated)", rangemode="tozero", secondary_y=True)
    return styled(fig, "Block size: bigger blocks waste more of the last block", 380, x="block size (tokens)",
                  legend_y=-0.25, margin=(60, 60, 50, 50))


def engine_usage_figure(steps: pd.DataFrame) -> go.Figure:
    """Per step of the real engine: % of reserved slots holding tokens, each block size vs contiguous max_len."""
    fig = go.Figure()
    palette = ["#264653", "#2a9d8f", "#8ab17d", "#e9c46a"]
    for i, (b, st) in enumerate(steps.groupby("block_size")):
        st = st[st["reserved"] > 0]
        fig.add_trace(go.Scatter(x=st["step"], y=100 * st["held"] / st["reserved"], name=f"paged, blocks of {b}",
                                 mode="lines", line=dict(color=palette[i % len(palette)])))
    st = steps[(steps["block_size"] == steps["block_size"].min()) & (steps["contiguous_reserved"] > 0)]
    fig.add_trace(go.Scatter(x=st["step"], y=100 * st["held"] / st["contiguous_reserved"], mode="lines",
                             name="contiguous, max_len each (same requests)", line=dict(color=RESERVED, dash="dash")))
    styled(fig, "SmolLM2 on this machine: share of reserved KV slots holding tokens, per step", 360, x="engine step",
           y="% holding tokens", legend_y=-0.25, yaxis_range=[0, 105])
    return fig.update_xaxes(**count_axis(float(steps["step"].max()) if len(steps) else None))


__all__ = ["block_size_figure", "engine_usage_figure", "held_and_reserved", "reserved_vs_held_figure",
           "token_share_figure"]
