"""Views of a fleet (``paged.fleet``): pure figures over snapshots and routing records, and a live view.

``pools_figure(snaps)``: each replica's pool as a small grid of blocks (free, cached-free, in use);
``routing_figure(decisions)``: every decision, request by request: the replica chosen and the
prefix blocks its view matched there; ``policies_figure(df)``: hit rate and TTFT per policy (a
``paged.fleet.study`` frame); ``FleetView(fleet)``: both live figures redrawn after each request a
``LiveFleet`` sends, with a sentence saying what the router just did; ``fleet_story``: the run in
sentences from its numbers.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from paged.core.snapshot import STATE_CACHED, STATE_FREE

__all__ = ["pools_figure", "routing_figure", "policies_figure", "fleet_story", "FleetView"]

STATES = ("free", "cached-free", "in use")
COLORS = ("#e8e8e8", "#72b7b2", "#f58518")


def _grid(snap, cols: int) -> np.ndarray:
    code = np.where(snap.state == STATE_FREE, 0, np.where(snap.state == STATE_CACHED, 1, 2)).astype(float)
    rows = math.ceil(len(code) / cols)
    out = np.full(rows * cols, np.nan)
    out[:len(code)] = code
    return out.reshape(rows, cols)


def pools_figure(snaps: Mapping[str, object], cols: int = 8, title: str = "each replica's KV pool") -> go.Figure:
    """One grid per replica (``snaps``: name -> ``KVSnapshot``), block 0 top left."""
    names = list(snaps)
    fig = make_subplots(rows=1, cols=len(names), subplot_titles=names, horizontal_spacing=0.06)
    scale = [[0, COLORS[0]], [0.33, COLORS[0]], [0.34, COLORS[1]], [0.66, COLORS[1]], [0.67, COLORS[2]], [1, COLORS[2]]]
    rows = 1
    for k, name in enumerate(names):
        z = _grid(snaps[name], cols)
        rows = max(rows, z.shape[0])
        text = [[STATES[int(v)] if v == v else "" for v in row] for row in z]
        fig.add_trace(go.Heatmap(z=z, zmin=0, zmax=2, colorscale=scale, showscale=False, text=text, xgap=2, ygap=2,
                                 hovertemplate="block %{x} of row %{y}: %{text}<extra>" + name + "</extra>"), 1, k + 1)
    for k, (state, color) in enumerate(zip(STATES, COLORS)):   # a legend for the colours
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=state,
                                 marker=dict(size=12, color=color, symbol="square")), 1, 1)
    fig.update_yaxes(autorange="reversed", showticklabels=False)
    fig.update_xaxes(showticklabels=False)
    return fig.update_layout(title=title, height=max(260, 160 + 36 * rows), legend=dict(orientation="h", y=-0.1),
                             margin=dict(t=80, b=60))


def routing_figure(decisions: pd.DataFrame, title: str = "the router's decisions") -> go.Figure:
    """One marker per decision (``Dispatcher.frame()``): x the request's order, y the replica it
    went to, colour and label the prefix blocks the policy's view matched there."""
    d = decisions.reset_index(drop=True)
    names = list(dict.fromkeys(d["replica_name"])) if len(d) else []
    fig = go.Figure(go.Scatter(
        x=np.arange(1, len(d) + 1), y=d["replica_name"], mode="markers+text",
        text=[str(max(int(m), 0)) for m in d["overlap_blocks"]], textposition="top center", cliponaxis=False,
        marker=dict(size=14, color=d["overlap_blocks"].clip(lower=0), colorscale="Viridis", cmin=0,
                    cmax=max(1, int(d["overlap_blocks"].max())) if len(d) else 1,
                    colorbar=dict(title="matched<br>blocks", len=0.9)),
        customdata=np.stack([d["policy"], d["prompt_tokens"]], axis=1) if len(d) else None,
        hovertemplate="request %{x} -> %{y}<br>%{text} prefix blocks matched<br>%{customdata[0]}, "
                      "%{customdata[1]} prompt tokens<extra></extra>"))
    fig.update_yaxes(title="replica", type="category", categoryorder="array", categoryarray=sorted(names))
    fig.update_xaxes(title="request (in the order sent)", dtick=1 if len(d) <= 20 else None)
    return fig.update_layout(title=title, height=300, margin=dict(t=70))


def policies_figure(df: pd.DataFrame, title: str = "routing policies on the same requests") -> go.Figure:
    """Left: prefix hit rate per policy; right: TTFT p50 and p99 (s), one bar each."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("prefix hit rate", "time to first token (s)"),
                        horizontal_spacing=0.14)
    label = df["label"] if "label" in df else df["policy"]
    fig.add_trace(go.Bar(x=label, y=df["hit_rate"], name="hit rate", marker_color="#4C78A8",
                         text=[f"{v:.3f}" for v in df["hit_rate"]], textposition="outside"), 1, 1)
    fig.add_trace(go.Bar(x=label, y=df["ttft_p50_s"], name="TTFT p50", marker_color="#72b7b2"), 1, 2)
    fig.add_trace(go.Bar(x=label, y=df["ttft_p99_s"], name="TTFT p99", marker_color="#e45756"), 1, 2)
    fig.update_yaxes(title_text="hit rate", row=1, col=1)
    fig.update_yaxes(title_text="seconds", row=1, col=2)
    # the legend sits below the tick labels, which plotly turns 45 degrees when six names do not fit
    return fig.update_layout(title=title, height=460, barmode="group", legend=dict(orientation="h", y=-0.42),
                             margin=dict(b=140))


def fleet_story(decisions: pd.DataFrame, hit_rates: Mapping[str, float]) -> str:
    """The run in sentences: how often each policy's choice already held the prompt's prefix, and
    the measured hit rates side by side (``hit_rates``: policy -> the replicas' own count)."""
    out = []
    for policy, g in decisions.groupby("policy", sort=False):
        warm = int((g["overlap_blocks"] > 0).sum())
        spread = g["replica_name"].value_counts()
        seen = f"{warm} of {len(g)} requests went to a replica whose cache already held part of the prompt" \
            if (g["overlap_blocks"] >= 0).all() else f"{len(g)} requests routed without looking at any cache"
        out.append(f"**{policy}**: {seen}; the busiest replica took {int(spread.max())} of {len(g)}.")
    if len(hit_rates) >= 2:
        ranked = sorted(hit_rates.items(), key=lambda kv: kv[1])
        (a, ra), (b, rb) = ranked[0], ranked[-1]
        ratio = f"{rb / ra:.1f}x" if ra > 0 else "from zero to"
        out.append(f"Measured by the replicas themselves: {b} reused {rb:.0%} of the prompt tokens, "
                   f"{a} {ra:.0%} ({ratio} {'as many' if ra > 0 else f'{rb:.0%}'}).")
    return "\n\n".join(out)


class FleetView:
    """The live view of a ``LiveFleet`` whose replicas are ``EngineReplica``s: ``send_all(prompts)``
    sends them one by one and redraws the pools and the decisions after each (two ``LivePlot``s
    and a status line)."""

    def __init__(self, fleet, cols: int = 8) -> None:
        import ipywidgets as W
        from .liveplot import LivePlot
        self.fleet, self.cols = fleet, cols
        self.pools = LivePlot(pools_figure(self._snaps(), cols))
        self.routing = LivePlot(routing_figure(fleet.dispatcher.frame()))
        self.status = W.HTML("<b>router</b>: waiting for the first request")
        self.box = W.VBox([self.status, self.pools, self.routing])

    def _snaps(self) -> dict:
        return {h.name: h.llm.kv_manager.snapshot() for h in self.fleet.handles}

    def redraw(self) -> None:
        d = self.fleet.dispatcher.frame()
        self.pools.replace_figure(pools_figure(self._snaps(), self.cols))
        self.routing.replace_figure(routing_figure(d))
        if len(d):
            last, res = d.iloc[-1], self.fleet.results[-1]
            self.status.value = (f"<b>{last['policy']}</b> sent request {len(d)} ({int(last['prompt_tokens'])} "
                                 f"tokens) to <b>{last['replica_name']}</b>: {max(int(last['overlap_blocks']), 0)} "
                                 f"prefix blocks matched in its view; it reported {res[4]} cached tokens")

    def send_all(self, prompts: Sequence[Sequence[int]], max_tokens: int = 4) -> None:
        for p in prompts:
            self.fleet.send(p, max_tokens)
            self.redraw()
        self.fleet.settle()

    def _ipython_display_(self) -> None:
        from IPython.display import display
        display(self.box)
