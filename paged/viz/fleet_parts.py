"""Figures of the fleet's NUMA and prefill/decode studies (pure: frame -> go.Figure)."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots


def numa_figure(df: pd.DataFrame) -> go.Figure:
    """``paged.fleet.numa.numa_study``'s frame: remote-socket share and transfer time per policy."""
    fig = make_subplots(1, 2, subplot_titles=("share of host accesses to the remote socket",
                                              "host-link transfer time (s)"))
    fig.add_bar(x=df["policy"], y=df["remote_share"], name="remote share", row=1, col=1)
    fig.add_bar(x=df["policy"], y=df["transfer_s"], name="transfer s", row=1, col=2)
    return fig.update_layout(showlegend=False, title=f"NUMA placement, layout {df['layout'].iloc[0]} GPUs per socket")


def disagg_figure(df: pd.DataFrame) -> go.Figure:
    """``paged.fleet.disagg_pools.disagg_study``'s frame: SLO attainment and goodput per mode."""
    fig = make_subplots(1, 2, subplot_titles=("SLO attainment", "goodput (requests meeting both SLOs / s)"))
    for col, name in (("ttft_attain", "TTFT"), ("tpot_attain", "TPOT"), ("slo_attain", "both")):
        fig.add_bar(x=df["mode"], y=df[col], name=name, row=1, col=1)
    fig.add_bar(x=df["mode"], y=df["goodput_rps"], name="goodput", row=1, col=2, showlegend=False)
    return fig.update_layout(barmode="group", title="prefill/decode apart vs colocated, same GPUs and requests")
