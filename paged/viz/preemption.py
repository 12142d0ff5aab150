"""Figures of the preemption study (``paged.studies.preemption``): its step frames and cost table -> ``go.Figure``."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from .sizing import count_axis, styled

MODE_COLOURS = {"reference": "#8d99ae", "recompute": "#e76f51", "swap": "#264653"}


def modes_figure(frames: dict[str, pd.DataFrame]) -> go.Figure:
    """Blocks in use per step for each run, with a marker wherever a request was preempted."""
    fig = go.Figure()
    for label, st in frames.items():
        c = MODE_COLOURS.get(label, "#2a9d8f")
        fig.add_trace(go.Scatter(x=st["step"], y=st["num_used_blocks"], name=f"{label}: blocks in use",
                                 mode="lines", line=dict(color=c)))
        p = st[st["num_preempted"] > 0]
        if len(p):
            fig.add_trace(go.Scatter(x=p["step"], y=p["num_used_blocks"], mode="markers", name=f"{label}: preemption",
                                     marker=dict(symbol="x", size=10, color=c)))
    styled(fig, "Blocks in use per step; x = a request preempted", 360, x="engine step", y="blocks", legend_y=-0.25)
    top = max([float(st["step"].max()) for st in frames.values() if len(st)] or [0.0])
    blocks = max([float(st["num_used_blocks"].max()) for st in frames.values() if len(st)] or [0.0])
    fig.update_xaxes(**count_axis(top))
    return fig.update_yaxes(**count_axis(blocks))


def cost_figure(costs: pd.DataFrame) -> go.Figure:
    """Seconds to bring back one request: recompute (prefill) vs swap (PCIe out + in) vs reading it from HBM."""
    x = [f"{t:,} tokens" for t in costs["tokens"]]
    fig = go.Figure([
        go.Bar(x=x, y=1e3 * costs["recompute_s"], name="recompute (prefill again)", marker_color=MODE_COLOURS["recompute"]),
        go.Bar(x=x, y=1e3 * costs["swap_out_and_in_s"], name="swap out + in over PCIe", marker_color=MODE_COLOURS["swap"]),
        go.Bar(x=x, y=1e3 * costs["hbm_read_s"], name="one read from HBM", marker_color="#a8dadc"),
    ])
    a = costs.attrs
    return styled(fig, f"{a.get('model', '')} on {a.get('tensor_parallel', 1)}× {a.get('gpu', '')}: the cost of one "
                  "preempted request", 380, y="milliseconds (log)", legend_y=-0.2, margin=(60, 20, 50, 40),
                  barmode="group", yaxis_type="log")


__all__ = ["MODE_COLOURS", "cost_figure", "modes_figure"]
