"""Figures of today's KV layouts (``paged.studies.layouts``): a request's KV against its length per
model, and the hybrid pool against every layer full on one trace."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from paged.studies.layouts import MODERN_MODELS, content_bytes, layout_name

from .sizing import styled

__all__ = ["request_bytes_figure", "hybrid_vs_full_figure", "hybrid_vs_full_prose"]

_COLOURS = ("#264653", "#8ab17d", "#2a9d8f", "#e76f51", "#f4a261", "#7b6d8d", "#e9c46a")


def request_bytes_figure(models: Sequence[str] = MODERN_MODELS, max_tokens: int = 131072, kv_format: str = "bf16",
                         tensor_parallel: int = 1) -> go.Figure:
    """KV of one request (per GPU, GB) against its tokens, one line per model, log-log: full
    attention grows linearly, a sliding layer stops at its window, a state layer is flat."""
    t = np.unique(np.geomspace(64, max_tokens, 60).round().astype(np.int64))
    fig = go.Figure()
    for i, name in enumerate(models):
        y = content_bytes(name, t, kv_format, tensor_parallel) / 1e9
        fig.add_trace(go.Scatter(x=t, y=y, mode="lines", name=f"{name} ({layout_name(name)})",
                                 line=dict(color=_COLOURS[i % len(_COLOURS)], width=2),
                                 hovertemplate="%{x:,} tokens: %{y:.3f} GB<extra>" + name + "</extra>"))
    tp = f", tensor parallel {tensor_parallel}" if tensor_parallel > 1 else ""
    return styled(fig, f"KV of one request per GPU ({kv_format}{tp})", 460, x="tokens in the request", y="KV cache (GB)",
                  xaxis_type="log", yaxis_type="log", legend=dict(orientation="h", y=-0.22, font=dict(size=11)))


def hybrid_vs_full_figure(df: pd.DataFrame) -> go.Figure:
    """``hybrid_vs_full``'s two runs side by side: mean and peak running requests, and throughput,
    each bar labelled with its ratio to every layer full."""
    metrics = (("mean_running", "mean running requests"), ("max_running", "peak running requests"),
               ("throughput_tok_s", "output tokens / s"))
    fig = go.Figure()
    for j, (_, row) in enumerate(df.iterrows()):
        ys = [row[c] / df[c].iloc[1] for c, _ in metrics]
        fig.add_trace(go.Bar(x=[label for _, label in metrics], y=ys, name=row["variant"],
                             marker_color=_COLOURS[3] if j == 0 else _COLOURS[0],
                             text=[f"{row[c]:,.1f}" for c, _ in metrics], textposition="outside"))
    return styled(fig, "Same KV memory, same trace: the hybrid pool over every layer full", 380,
                  y="relative to every layer full", margin=(60, 20, 50, 40), barmode="group",
                  yaxis_range=[0, 1.25 * max(df[c].max() / df[c].iloc[1] for c, _ in metrics)])


def hybrid_vs_full_prose(df: pd.DataFrame):
    """``hybrid_vs_full``'s result in one paragraph (Markdown): concurrency, throughput and the
    prefix cache, each with its direction as measured in this run."""
    from paged.viz.prose import md, times

    h, f = df.iloc[0], df.iloc[1]
    hits = ("kept" if abs(h["prefix_cache_hit_rate"] - f["prefix_cache_hit_rate"]) < 0.02 else
            "fell" if h["prefix_cache_hit_rate"] < f["prefix_cache_hit_rate"] else "rose")
    return md(f"In this run the hybrid pool held **{h['num_kv_pages']:,} pages** where every layer full held "
              f"{f['num_kv_pages']:,} in the same memory, ran **{times(h['mean_running_vs_full'])}** as many requests "
              f"at once on average (peak {h['max_running']:.0f} vs {f['max_running']:.0f}) and reached "
              f"{times(h['throughput_tok_s_vs_full'])} its output tokens per second. The prefix-cache hit "
              f"rate {hits}: {h['prefix_cache_hit_rate']:.1%} vs {f['prefix_cache_hit_rate']:.1%}, with "
              f"{h['num_preemptions']:,} preemptions vs {f['num_preemptions']:,}.")
