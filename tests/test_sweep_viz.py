"""paged.viz.sweep: the sweep's figures, and the live view filling as points arrive."""
from __future__ import annotations

import math

import pandas as pd
import plotly.graph_objects as go
import pytest

from paged.errors import ConfigError
from paged.sweeps import pareto_front
from paged.viz import sweep as V


def table() -> pd.DataFrame:
    rows = []
    for rate in (1.0, 4.0, math.inf):
        for bs in (8, 16):
            for fmt in ("fp16", "fp8"):
                rows.append({"rate": rate, "block_size": bs, "kv_cache_dtype": fmt, "status": "ok",
                             "tp": rate if rate < 10 else 10.0 + (fmt == "fp8"), "p99": bs / 8 + (fmt == "fp16")})
    rows.append({"rate": 1.0, "block_size": 0, "kv_cache_dtype": "fp16", "status": "error", "tp": None, "p99": None})
    return pd.DataFrame(rows)


def test_heatmap_aggregates_over_the_other_parameters_and_skips_failures():
    h = V.heatmap_data(table(), "rate", "block_size", "tp", agg="max")
    assert h["x"] == ["1.0", "4.0", "inf"] and h["y"] == ["8", "16"]  # the failed block_size=0 is not an axis value
    assert h["z"] == [[1.0, 4.0, 11.0], [1.0, 4.0, 11.0]] and h["n"] == [[2, 2, 2], [2, 2, 2]]
    empty = V.heatmap_data(table().iloc[:0], "rate", "block_size", "tp", x_values=[1, 2], y_values=[8])
    assert empty["z"] == [[None, None]]  # the grid's cells are there before any point arrives
    fig = V.heatmap(table(), "rate", "block_size", "tp")
    assert isinstance(fig, go.Figure) and fig.data[0].type == "heatmap"
    with pytest.raises(ConfigError, match="no column"):
        V.heatmap(table(), "rate", "nope", "tp")
    with pytest.raises(ConfigError, match="agg"):
        V.heatmap_data(table(), "rate", "block_size", "tp", agg="sum")


def test_parallel_coordinates_encodes_categories_and_infinite_rates():
    fig = V.parallel_coordinates(table(), ["rate", "block_size", "kv_cache_dtype", "p99"], "tp")
    dims = fig.data[0].dimensions
    assert [d.label for d in dims] == ["rate", "block_size", "kv_cache_dtype", "p99"]
    assert list(dims[2].ticktext) == ["fp16", "fp8"] and set(dims[2].values) == {0, 1}
    assert max(dims[0].values) == 40.0 and len(dims[0].values) == 12  # inf -> 10 x the largest finite rate


def test_pareto_rings_exactly_the_front():
    df = table()
    fig = V.pareto(df, "p99", "tp", maximize=["tp"], minimize=["p99"], color="block_size", hover=["kv_cache_dtype"])
    front = pareto_front(df[df.status == "ok"], maximize=["tp"], minimize=["p99"])
    assert len(fig.data[1].x) == int(front.sum()) > 0 and len(fig.data[0].x) == 12
    assert list(fig.data[1].x) == sorted(fig.data[1].x)


def test_live_view_fills_as_points_arrive_at_a_bounded_frame_rate():
    df = table()
    view = V.SweepView("tp", x="rate", y="block_size", dims=["rate", "block_size", "kv_cache_dtype", "tp"],
                       grid={"rate": [1.0, 4.0, math.inf], "block_size": [8, 16]}, fps=2.0)
    assert set(view.figures) == {"heatmap", "parcoords"}

    def z():
        f = view.figures["heatmap"]
        return (f.figure if hasattr(f, "figure") else f).data[0].z

    assert all(v is None for row in z() for v in row)  # the empty grid, drawn before the first point
    for _, r in df.iterrows():
        view.add([r.to_dict()])
    assert view.points == 13 and view.failed == 1 and len(view.rows) == 13
    assert 1 <= view.frames <= 2  # 13 points in well under a second: one or two frames, not 13
    view.draw()
    assert all(v is not None for row in z() for v in row)
    fig = view.figures["heatmap"]
    title = (fig.figure if hasattr(fig, "figure") else fig).layout.title.text
    assert "13 points, 1 failed" in title
    with pytest.raises(ConfigError, match="x= and y="):
        V.SweepView("tp", kinds=["heatmap"])
    with pytest.raises(ConfigError, match="unknown figure kind"):
        V.SweepView("tp", kinds=["surface"])


def test_live_sweep_runs_a_sweep_through_the_view(tmp_path):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    import sweep_helpers as H

    seen = []
    df = V.live_sweep(H.square, {"x": [1, 2, 3], "note": ["a", "b"]}, "y", x="x", y="note", display=False,
                      store=tmp_path, progress=False, on_result=seen.append)
    assert len(df) == 6 and sorted(df["y"]) == [1, 1, 4, 4, 9, 9] and len(seen) == 6


def test_pareto_counts_get_whole_number_ticks():
    """A count on an axis (num_preemptions; float once a failed point left a NaN) ticks at whole numbers."""
    from figure_check import figure_problems
    df = table().assign(num_preemptions=[0, 1, 2, 3] * 3 + [None])
    fig = V.pareto(df, "num_preemptions", "tp", maximize=["tp"], minimize=["num_preemptions"])
    assert figure_problems(fig) == [] and fig.layout.xaxis.dtick == 1
    assert fig.layout.yaxis.dtick is None  # throughput is not a count
