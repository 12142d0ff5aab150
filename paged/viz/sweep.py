"""Figures of a sweep (``paged.sweep``'s table; "ok" rows only) and a live view that fills them::

    heatmap(df, x="rate", y="block_size", z="throughput_tok_s", agg="max")   # best over the other axes
    parallel_coordinates(df, dims=["rate", "block_size", "kv_cache_dtype"], color="tbt_p99_s")
    pareto(df, x="tbt_p99_s", y="throughput_tok_s", minimize=["tbt_p99_s"], maximize=["throughput_tok_s"])
    view = SweepView("throughput_tok_s", x="rate", y="block_size", grid=grid); view
    df = paged.sweep("simulate", grid, on_result=view.add); view.draw()      # or live_sweep(...) in one call

The live view keeps ``paged.viz.live``'s conventions: ``LivePlot``s displayed one by one, one
``batch_update()`` per frame, at most ``fps`` frames a second and about ``draw_share`` of the wall
time drawing; static figures, with a note, where widgets are unavailable.
"""
from __future__ import annotations

import html
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from paged.errors import ConfigError

from .buffers import FramePacer, widgets_available
from .sizing import count_axis, styled

__all__ = ["heatmap", "heatmap_data", "parallel_coordinates", "pareto", "SweepView", "live_sweep", "KINDS"]

KINDS = ("heatmap", "parcoords")
_AGG = ("mean", "max", "min", "median", "first")


def _ok(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["status"] == "ok"] if "status" in df.columns else df


def _need(df: pd.DataFrame, cols: Sequence[str]) -> None:
    missing = [c for c in cols if c not in df.columns]
    if missing and len(df):
        raise ConfigError(f"no column(s) {missing} in the sweep table; it has {list(df.columns)}")


def _axis_values(df: pd.DataFrame, col: str, given: Sequence[Any] | None) -> list[Any]:
    vals = list(given) if given is not None else list(pd.unique(df[col])) if col in df.columns else []
    try:
        return sorted(vals)
    except TypeError:
        return vals


def heatmap_data(df: pd.DataFrame, x: str, y: str, z: str, agg: str = "mean", x_values: Sequence[Any] | None = None,
                 y_values: Sequence[Any] | None = None) -> dict[str, Any]:
    """Trace arrays of ``heatmap``: ``z[i][j]`` = ``agg`` of ``z`` over the ok rows with
    ``y == y_values[i]`` and ``x == x_values[j]`` (None where none has arrived), their counts."""
    if agg not in _AGG:
        raise ConfigError(f"agg must be one of {_AGG}, got {agg!r}")
    d = _ok(df)
    _need(d, [x, y, z])
    xs, ys = _axis_values(d, x, x_values), _axis_values(d, y, y_values)
    zz = np.full((len(ys), len(xs)), np.nan)
    nn = np.zeros((len(ys), len(xs)), dtype=int)
    if len(d):
        g = d.groupby([y, x], sort=False)[z]
        vals, counts = g.agg(agg), g.size()
        xi, yi = {v: j for j, v in enumerate(xs)}, {v: i for i, v in enumerate(ys)}
        for (yv, xv), v in vals.items():
            if yv in yi and xv in xi:
                zz[yi[yv], xi[xv]] = v
                nn[yi[yv], xi[xv]] = counts[(yv, xv)]
    return {"x": [str(v) for v in xs], "y": [str(v) for v in ys],
            "z": [[None if np.isnan(v) else float(v) for v in row] for row in zz], "n": nn.tolist()}


def heatmap(df: pd.DataFrame, x: str, y: str, z: str, agg: str = "mean", x_values: Sequence[Any] | None = None,
            y_values: Sequence[Any] | None = None, title: str | None = None) -> go.Figure:
    """``z`` over the ``x`` x ``y`` grid (categorical axes; ``agg`` over the other swept parameters)."""
    h = heatmap_data(df, x, y, z, agg, x_values, y_values)
    fig = go.Figure(go.Heatmap(x=h["x"], y=h["y"], z=h["z"], customdata=h["n"], colorscale="Viridis",
                               colorbar=dict(title=z), hoverongaps=False,
                               hovertemplate=f"{x}=%{{x}}<br>{y}=%{{y}}<br>{agg} {z}=%{{z:.4g}}"
                                             "<br>%{customdata} points<extra></extra>"))
    return styled(fig, title or f"{z} ({agg} over the other parameters)", 420, x=x, y=y, margin=None,
                  xaxis_type="category", yaxis_type="category")


def _dimension(s: pd.Series, label: str) -> dict[str, Any]:
    """A parcoords dimension: numbers as they are, anything else as ticks at 0..k-1."""
    if pd.api.types.is_bool_dtype(s) or not pd.api.types.is_numeric_dtype(s):
        cats = _axis_values(pd.DataFrame({label: s.astype(str)}), label, None)
        code = {c: i for i, c in enumerate(cats)}
        return dict(label=label, values=[code[v] for v in s.astype(str)], tickvals=list(range(len(cats))),
                    ticktext=cats, range=[-0.5, max(len(cats) - 0.5, 0.5)])
    vals = s.to_numpy(dtype=float)
    finite = vals[np.isfinite(vals)]
    big = float(np.max(np.abs(finite))) * 10 if len(finite) else 1.0
    vals = np.where(np.isinf(vals), np.sign(vals) * big, vals)  # rate=inf drawn at the top of its axis
    return dict(label=label, values=vals.tolist())


def parallel_coordinates(df: pd.DataFrame, dims: Sequence[str], color: str, title: str | None = None) -> go.Figure:
    """One line per ok point across ``dims`` (parameters and results), coloured by ``color``."""
    d = _ok(df)
    _need(d, [*dims, color])
    c = d[color].to_numpy(dtype=float) if len(d) else np.empty(0)
    fig = go.Figure(go.Parcoords(dimensions=[_dimension(d[k], k) for k in dims] if len(d) else
                                 [dict(label=k, values=[]) for k in dims],
                                 line=dict(color=c.tolist(), colorscale="Viridis", showscale=True,
                                           colorbar=dict(title=color))))
    return fig.update_layout(title=title or f"{len(d)} points, coloured by {color}", height=420)


def _is_count(s: pd.Series) -> bool:
    """A column of counts: integers, or a ``num_...`` column (float once a failed point left a NaN in it)."""
    return (pd.api.types.is_numeric_dtype(s) and not pd.api.types.is_bool_dtype(s)
            and (pd.api.types.is_integer_dtype(s) or str(s.name).startswith("num_")))


def pareto(df: pd.DataFrame, x: str, y: str, *, maximize: Sequence[str] = (), minimize: Sequence[str] = (),
           color: str | None = None, hover: Sequence[str] = (), title: str | None = None) -> go.Figure:
    """Every ok point (``y`` against ``x``), the Pareto-optimal ones over ``maximize``/``minimize``
    (which may include objectives not on the axes, e.g. memory) ringed and counted in the legend;
    joined by a line when the two axes are the only objectives."""
    from paged.sweeps.pareto import pareto_front

    d = _ok(df).reset_index(drop=True)
    _need(d, [x, y, *(c for c in (color,) if c)])
    front = pareto_front(d, maximize=maximize, minimize=minimize) if len(d) else pd.Series([], dtype=bool)
    cols = list(dict.fromkeys([*hover, *maximize, *minimize]))
    text = ["<br>".join(f"{k}={d.at[i, k]}" for k in cols if k in d.columns) for i in range(len(d))]
    marker: dict[str, Any] = dict(size=7, opacity=0.55)
    if color:
        marker.update(color=d[color].to_numpy(dtype=float).tolist(), colorscale="Viridis", showscale=True,
                      colorbar=dict(title=color))
    fig = go.Figure(go.Scatter(x=d[x], y=d[y], mode="markers", name="points", marker=marker, text=text,
                               hovertemplate=f"{x}=%{{x:.4g}}<br>{y}=%{{y:.4g}}<br>%{{text}}<extra></extra>"))
    f = d[front.to_numpy()].sort_values(x)
    # a line through the front only when the axes are its two objectives (with a third it zig-zags)
    on_axes = set(maximize) | set(minimize) == {x, y}
    fig.add_scatter(x=f[x], y=f[y], mode="markers+lines" if on_axes else "markers", name=f"Pareto front ({len(f)})",
                    text=[text[i] for i in f.index],
                    marker=dict(size=11, symbol="circle-open", line=dict(width=2), color="crimson"),
                    line=dict(dash="dot", color="crimson"),
                    hovertemplate=f"{x}=%{{x:.4g}}<br>{y}=%{{y:.4g}}<br>%{{text}}<extra>front</extra>")
    objectives = ", ".join([f"max {m}" for m in maximize] + [f"min {m}" for m in minimize])
    styled(fig, title or f"Pareto front ({objectives})", 450, x=x, y=y, margin=None,
           legend=dict(orientation="h", x=0, y=1.0, yanchor="bottom"))  # clear of the colour bar
    for col, update in ((x, fig.update_xaxes), (y, fig.update_yaxes)):
        if _is_count(d[col]):  # num_preemptions and the like: whole-number ticks
            update(**count_axis(float(d[col].max()) if len(d) else None))
    return fig


class SweepView:
    """Figures that fill as a sweep's points arrive (``paged.sweep(..., on_result=view.add)``). ``metric``: the
    result column coloured; ``x``/``y``: the heatmap's axes (``agg`` over the other parameters); ``dims``: the
    parallel-coordinates axes (default: ``x``, ``y``, ``metric``); ``grid``: the sweep's dict-of-lists grid, so
    the heatmap shows every cell from the start. Invariant: ``rows`` holds every row added, whether or not a
    frame was drawn."""

    def __init__(self, metric: str, *, x: str | None = None, y: str | None = None,
                 dims: Sequence[str] | None = None, kinds: Sequence[str] | None = None, agg: str = "mean",
                 grid: Mapping[str, Any] | None = None, fps: float = 4.0, title: str | None = None) -> None:
        kinds = tuple(kinds) if kinds is not None else (("heatmap",) if x and y else ()) + ("parcoords",)
        bad = [k for k in kinds if k not in KINDS]
        if bad or not kinds:
            raise ConfigError(f"unknown figure kind(s) {bad}; choose from {KINDS}")
        if "heatmap" in kinds and not (x and y):
            raise ConfigError("the heatmap needs x= and y= (two swept parameters)")
        if agg not in _AGG:
            raise ConfigError(f"agg must be one of {_AGG}, got {agg!r}")
        self.metric, self.x, self.y, self.agg, self.kinds, self.title = metric, x, y, agg, kinds, title
        self.dims = list(dims) if dims is not None else [c for c in (x, y) if c] + [metric]
        self.pacer = FramePacer(fps)
        grid = grid if isinstance(grid, Mapping) else {}
        self._values = {k: (list(v) if isinstance(v, (list, tuple, range)) else [v]) for k, v in grid.items()}
        self.rows: list[dict[str, Any]] = []
        self.points = self.failed = self.frames = 0
        self.no_widgets = widgets_available()
        self.anchor: Any = None
        self.figures: dict[str, Any] = self._static()
        if self.no_widgets is None:
            from .liveplot import LivePlot
            from .panels import ScrollAnchor
            self.anchor = ScrollAnchor()  # the first point brings the view into the window (Run All)
            self.figures = {k: LivePlot(f) for k, f in self.figures.items()}

    def frame(self) -> pd.DataFrame:
        """The rows so far as a DataFrame (all statuses)."""
        return pd.DataFrame(self.rows)

    def _static(self) -> dict[str, go.Figure]:
        df = self.frame()
        if not len(df):
            df = pd.DataFrame(columns=[*dict.fromkeys([*self.dims, self.metric, *(c for c in (self.x, self.y) if c)]),
                                       "status"])
        out = {}
        title = (f"{self.title or self.metric}: {self.points} points"
                 + (f", {self.failed} failed" if self.failed else ""))
        if "heatmap" in self.kinds:
            out["heatmap"] = heatmap(df, self.x, self.y, self.metric, self.agg, self._values.get(self.x),
                                     self._values.get(self.y), title=title)
        if "parcoords" in self.kinds:
            out["parcoords"] = parallel_coordinates(df, self.dims, self.metric, title=title)
        return out

    def add(self, rows: list[dict[str, Any]]) -> None:
        """Take one point's rows (the ``on_result`` of ``paged.sweep``); draw if a frame is due."""
        self.rows.extend(rows)
        self.points += 1
        if self.points == 1 and self.anchor is not None:
            self.anchor.scroll += 1
        if rows and rows[0].get("status", "ok") != "ok":
            self.failed += 1
        if self.pacer.due():
            self.draw()

    def draw(self) -> None:
        """Redraw every figure from the rows so far (one ``batch_update`` each)."""
        with self.pacer.timed():
            if self.no_widgets is None:
                for k, fig in self._static().items():
                    self.figures[k].replace_figure(fig)
            else:
                self.figures = self._static()
        self.frames += 1

    def _ipython_display_(self) -> None:
        from IPython.display import HTML, display
        if self.no_widgets is not None:
            display(HTML(f"<p><b>Static figures</b>: live widgets are unavailable here "
                         f"({html.escape(self.no_widgets)}); they show the points so far.</p>"))
        if self.anchor is not None:
            display(self.anchor)
        for f in self.figures.values():  # one by one, never inside a Box (plotly #4998)
            display(f)


def live_sweep(study: Any, grid: Any, metric: str, *, x: str | None = None, y: str | None = None,
               dims: Sequence[str] | None = None, agg: str = "mean", display: bool = True,
               on_result: Callable[[list[dict[str, Any]]], None] | None = None, **sweep_kwargs: Any) -> pd.DataFrame:
    """``paged.sweep(study, grid, **sweep_kwargs)`` with a ``SweepView`` displayed first and
    filled as points arrive; returns the sweep's table."""
    from paged.sweeps import sweep

    view = SweepView(metric, x=x, y=y, dims=dims, agg=agg, grid=grid if isinstance(grid, Mapping) else None)
    if display:
        from IPython.display import display as show
        show(view)

    def both(rows: list[dict[str, Any]]) -> None:
        view.add(rows)
        if on_result is not None:
            on_result(rows)

    df = sweep(study, grid, on_result=both, **sweep_kwargs)
    view.draw()
    return df
