"""Notebook 08's figures (paged.viz.tiers) on small hand-made study frames with the studies' columns."""
from __future__ import annotations

import math

import pandas as pd

from paged.viz import tiers


def test_tier_figure_bars_per_variant() -> None:
    df = pd.DataFrame({"variant": ["recompute", "host tier, LRU"], "swaps": [0, 120],
                       "gpu_hit_rate": [0.46, 0.43], "host_hit_rate": [0.0, 0.03]})
    fig = tiers.tier_figure(df)
    assert [t.type for t in fig.data] == ["bar", "bar", "bar"]
    assert list(fig.data[0].y) == [0, 120] and list(fig.data[2].base) == [0.46, 0.43]  # host hits stacked on GPU


def test_streaming_figure_one_trace_per_variant() -> None:
    df = pd.DataFrame({"variant": ["device only", "stream overlap int4", "device only", "stream overlap int4"],
                       "kv_fraction": [1.0, 1.0, 0.25, 0.25], "context": [1024] * 4,
                       "tbt_vs_device": [1.0, 1.08, 1.0, 1.09], "throughput_vs_device": [1.0, 1.47, 1.0, 2.93]})
    fig = tiers.streaming_figure(df)
    assert [t.name for t in fig.data] == ["device only", "stream overlap int4"]
    assert list(fig.data[1].y) == [1.47, 2.93] and fig.layout.xaxis.type == "log"


def test_sharing_figure_k_pairs_lines_and_pairs_scatter() -> None:
    df = pd.DataFrame({"kind": ["base", "pair", "pair", "k_pairs", "k_pairs"],
                       "order": [math.nan, math.nan, math.nan, "cost", "similarity"], "k": [0, 1, 1, 2, 2],
                       "share_with": [None, "{1: 0}", "{10: 9}", "{1: 0, 10: 9}", "{1: 0, 10: 9}"],
                       "memory_saved_pct": [0.0, 3.3, 3.3, 6.7, 6.7], "kld_mean": [0.0, 2.9, 0.07, 0.34, 0.34],
                       "js_head": [math.nan, 0.56, 0.54, math.nan, math.nan]})
    fig = tiers.sharing_figure(df)
    lines = [t for t in fig.data if t.mode == "lines+markers"]
    assert len(lines) == 2 and list(lines[0].x) == [6.7] and list(lines[0].y) == [0.34]
    scatter = [t for t in fig.data if t.mode == "markers+text"][0]
    assert list(scatter.x) == [0.56, 0.54] and list(scatter.text) == ["{1: 0}", "{10: 9}"]
