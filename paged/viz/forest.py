"""Views of a real server (paged.connect): the prefix forest, usage and hit rate beside our engine,
the miss map (pure: DataFrames -> ``go.Figure``), and ``ServerView``, the live dashboard of them.

    fig = prefix_forest(src.forest_frame())              # icicle: the cache on top, one cell per block
    fig = server_vs_engine(src.server_frame(), {"ours": engine_steps_df})
    fig = miss_map(ledger.frame())                        # requests x blocks, colored by reason
"""
from __future__ import annotations

import asyncio
from typing import Any, Mapping

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from paged.connect import misses as M

from .pool_figures import legend_squares, state_colorscale
from .sizing import count_axis, styled

STATE_COLORS = {"live": "#3b6fb6", "evicted": "#e6550d", "cleared": "#bdbdbd"}
MISS_COLORS = {M.HIT: "#2ca25f", M.HIT_HOST: "#99d8c9", M.CACHED: "#2ca25f", M.PARTIAL: "#d9d9d9",
               M.LAST_BLOCK: "#c7e9c0", M.NEVER_SEEN: "#9ecae1", M.EVICTED: "#e6550d",
               M.EVICTED_HOST: "#fd8d3c", M.CLEARED: "#969696", M.SALTED: "#8c6bb1", M.REFUSED: "#e7298a",
               M.AFTER_MISS: "#fdd0a2", M.CACHING_OFF: "#636363", M.STORED_LATER: "#c6dbef"}


def _short(text: Any, n: int = 18) -> str:
    if not isinstance(text, str):
        return ""
    t = text.replace("\n", "⏎")
    return t if len(t) <= n else t[:n - 1] + "…"


ROOT_ID = "cache"
"""The icicle's root cell: the prefix cache itself, parent of every chain's first block."""
ROOT_COLOR = "#e8e8e8"
ROOT_LABEL = "prefix cache: below it, each chain of cached blocks, its first block on top"


def prefix_forest(frame: pd.DataFrame, *, max_nodes: int = 600, title: str = "prefix forest",
                  show_removed: bool = True) -> go.Figure:
    """An icicle of the forest (``PrefixForest.frame``): a row for the cache on top, then each
    chain's first block, each block one cell under its parent, labelled with its decoded tokens;
    blue live, orange evicted, grey cleared, hover with hash, age, times stored and removed. At
    most ``max_nodes`` nodes (the newest are kept, with their ancestors)."""
    df = frame if show_removed else frame[frame["state"] == "live"]
    if len(df) > max_nodes:
        keep = set(df["node_id"].iloc[-max_nodes:])
        parent = dict(zip(frame["node_id"], frame["parent_id"]))
        for nid in list(keep):
            p = parent.get(nid)
            while p is not None and not pd.isna(p) and p not in keep:
                keep.add(int(p))
                p = parent.get(int(p))
        df = df[df["node_id"].isin(keep)]
    ids = {int(n) for n in df["node_id"]}
    labels, parents, colors, hover = [], [], [], []
    for r in df.itertuples(index=False):
        p = r.parent_id
        parents.append(str(int(p)) if p is not None and not pd.isna(p) and int(p) in ids else ROOT_ID)
        labels.append(f"{_short(r.text) or r.hash[-6:]}")
        colors.append(STATE_COLORS.get(r.state, "#999999"))
        removed = "" if pd.isna(r.removed_s) else f"<br>removed at {r.removed_s:.2f} s"
        hover.append(f"node {r.node_id} · {r.state}<br>hash {r.hash}<br>depth {r.depth}, {r.num_tokens} tokens"
                     f"<br>age {r.age_s:.1f} s, stored {r.times_stored}x, removed {r.times_removed}x{removed}"
                     f"<br>{(r.text or '')[:80]!r}")
    counts = df["state"].value_counts()
    summary = ", ".join(f"{counts.get(s, 0)} {s}" for s in ("live", "evicted", "cleared"))
    # an explicit root row over the chains' first blocks (a forest's implicit root is an empty band)
    root = [ROOT_ID] if len(df) else []
    fig = go.Figure(go.Icicle(ids=[str(int(n)) for n in df["node_id"]] + root,
                              labels=labels + [ROOT_LABEL] * len(root),
                              parents=parents + [""] * len(root),
                              marker=dict(colors=colors + [ROOT_COLOR] * len(root)),
                              hovertext=hover + ["the prefix cache; below it, each chain's first block"] * len(root),
                              hoverinfo="text", tiling=dict(orientation="v"), maxdepth=-1))
    return styled(fig, f"{title} ({summary})", 420, margin=(10, 10, 40, 10))


def _engine_series(steps: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    t = steps["time_s"].to_numpy(float)
    q, h = steps["prefix_cache_queries"].to_numpy(float), steps["prefix_cache_hits"].to_numpy(float)
    with np.errstate(invalid="ignore", divide="ignore"):
        rate = np.where(q > 0, h / np.maximum(q, 1), np.nan)
    return t, steps["kv_cache_usage_perc"].to_numpy(float), rate


def server_vs_engine(server: pd.DataFrame | None, engines: Mapping[str, pd.DataFrame] | None = None, *,
                     label: str = "vLLM", title: str = "KV usage and prefix hit rate") -> go.Figure:
    """Two panels over time: KV block usage and cumulative prefix hit rate (tokens), for the server
    (``ServerSource.server_frame``) and any engines' steps frames (``STEP_COLUMNS``), side by side;
    the server's live cached blocks on the usage panel's second axis."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("KV cache usage (blocks in use)", "prefix hit rate (tokens)"),
                        specs=[[{"secondary_y": True}, {}]])
    if server is not None and len(server):
        fig.add_trace(go.Scatter(x=server["time_s"], y=server["kv_cache_usage_perc"], name=f"{label} usage",
                                 line=dict(color="#e6550d")), row=1, col=1)
        fig.add_trace(go.Scatter(x=server["time_s"], y=server["live_blocks"], name=f"{label} cached blocks",
                                 line=dict(color="#e6550d", dash="dot")), row=1, col=1, secondary_y=True)
        fig.add_trace(go.Scatter(x=server["time_s"], y=server["hit_rate"], name=f"{label} hit rate",
                                 line=dict(color="#e6550d")), row=1, col=2)
    palette = ("#3b6fb6", "#2ca25f", "#756bb1", "#636363")
    for i, (name, steps) in enumerate((engines or {}).items()):
        if steps is None or not len(steps):
            continue
        t, usage, rate = _engine_series(steps)
        c = palette[i % len(palette)]
        fig.add_trace(go.Scatter(x=t, y=usage, name=f"{name} usage", line=dict(color=c)), row=1, col=1)
        fig.add_trace(go.Scatter(x=t, y=rate, name=f"{name} hit rate", line=dict(color=c)), row=1, col=2)
    fig.update_yaxes(range=[0, 1.02], row=1, col=1, secondary_y=False)
    fig.update_yaxes(range=[0, 1.02], row=1, col=2)
    # whole blocks: integer ticks from 0 (a live view rebuilds this figure, so the known maximum is current)
    blocks = float(server["live_blocks"].max()) if server is not None and len(server) else None
    fig.update_yaxes(title_text="cached blocks", row=1, col=1, secondary_y=True, **count_axis(blocks))
    fig.update_xaxes(title_text="seconds")
    return styled(fig, title, 340, margin=(40, 40, 60, 40), legend=dict(orientation="h"))


def miss_map(misses: pd.DataFrame, *, max_requests: int = 40, title: str = "why each prompt block was (not) a hit"
             ) -> go.Figure:
    """Requests (rows, first admissions) by prompt blocks (columns), colored by status
    (``paged.connect.misses``); hover shows the detail (when, which policy, for whom)."""
    df = misses[misses["admission"] == 1] if "admission" in misses else misses
    reqs = list(dict.fromkeys(df["request_id"]))[-max_requests:]
    df = df[df["request_id"].isin(reqs)]
    statuses = list(dict.fromkeys(df["status"]))
    code = {s: i for i, s in enumerate(statuses)}
    nblk = int(df["block"].max()) + 1 if len(df) else 0
    z = np.full((len(reqs), nblk), np.nan)
    text = [["" for _ in range(nblk)] for _ in reqs]
    row_of = {r: i for i, r in enumerate(reqs)}
    for r in df.itertuples(index=False):
        i, j = row_of[r.request_id], int(r.block)
        z[i, j] = code[r.status]
        text[i][j] = f"{r.request_id} block {j}: {r.status}" + (f"<br>{r.detail}" if r.detail else "")
    n = max(len(statuses), 1)
    colors = [(s, MISS_COLORS.get(s, "#999999")) for s in statuses]
    zl = np.where(np.isnan(z), None, z).tolist()
    fig = go.Figure(go.Heatmap(z=zl, x=list(range(nblk)), y=reqs, text=text, hoverinfo="text",
                               colorscale=state_colorscale([c for _, c in colors]) or [[0, "#fff"], [1, "#fff"]],
                               zmin=-0.5, zmax=n - 0.5, showscale=False, xgap=1, ygap=1))
    fig.add_traces(legend_squares(colors))
    styled(fig, title, max(220, 24 * len(reqs) + 120), x="prompt block", margin=(80, 10, 50, 40),
           yaxis=dict(autorange="reversed"), plot_bgcolor="#ffffff")
    return fig.update_xaxes(**count_axis(float(nblk - 1) if nblk else None))  # block indices: no tick at 0.5


def status_panel(source: Any) -> str:
    """An HTML line of the source's counters and its latest warnings."""
    import html
    st = source.status
    keys = ("connected", "batches", "gaps", "replayed", "lost", "malformed_messages", "disconnects",
            "forest_live", "forest_removed", "scrapes", "metrics_failures")
    parts = [f"{k}={st[k]}" for k in keys if k in st]
    if st.get("unknown_events"):
        parts.append(f"unknown={st['unknown_events']}")
    warn = "".join(f"<div style='color:#b35806'>⚠ {html.escape(w)}</div>" for _, w in source.warnings[-3:])
    return f"<div style='font-family:monospace;font-size:12px'>{html.escape(' · '.join(parts))}{warn}</div>"


class ServerView:
    """Live figures over a ``ServerSource`` (and optionally an engine run on the same workload): the prefix
    forest, usage/hit rate beside our engine, the status line; ``refresh()`` once, ``play()`` in an asyncio
    task. Without ipywidgets/anywidget the figures are static."""

    def __init__(self, source: Any, engine_run: Any = None, *, engine_label: str = "ours", fps: float = 2.0,
                 max_nodes: int = 400) -> None:
        from .buffers import widgets_available
        self.source, self.engine_run, self.engine_label = source, engine_run, engine_label
        self.fps, self.max_nodes, self.frames = fps, max_nodes, 0
        self.no_widgets = widgets_available()
        self._task: asyncio.Task | None = None
        figs = self._figures()
        if self.no_widgets is None:
            import ipywidgets as W

            from .liveplot import LivePlot
            from .panels import ScrollAnchor
            self.plots = {k: LivePlot(f) for k, f in figs.items()}
            self.status = W.HTML(status_panel(source))
            self.anchor: Any = ScrollAnchor()
        else:
            self.plots, self.status, self.anchor = {}, None, None
        self.figures = figs

    def _figures(self) -> dict[str, go.Figure]:
        src = self.source
        engines = {} if self.engine_run is None else {self.engine_label: self.engine_run.steps_frame()}
        return {"forest": prefix_forest(src.forest_frame(), max_nodes=self.max_nodes),
                "usage": server_vs_engine(src.server_frame(), engines, label=getattr(src, "label", "vLLM"))}

    def refresh(self) -> None:
        """Redraw every figure from the source now (one message per plot); the first redraw brings
        the view into the page's window (Run All lands on the show)."""
        if self.anchor is not None and not self.frames:
            self.anchor.scroll += 1
        self.figures = figs = self._figures()
        for k, plot in self.plots.items():
            plot.replace_figure(figs[k])
        if self.status is not None:
            self.status.value = status_panel(self.source)
        self.frames += 1

    def play(self) -> None:
        """Redraw at ``fps`` in the notebook's event loop until ``stop()``."""
        async def loop() -> None:
            while True:
                self.refresh()
                await asyncio.sleep(1.0 / self.fps)
        if self._task is None or self._task.done():
            self._task = asyncio.get_event_loop().create_task(loop())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def _ipython_display_(self) -> None:
        from IPython.display import display
        if self.no_widgets is not None:
            print(f"static figures ({self.no_widgets})")
            for f in self.figures.values():
                display(f)
            return
        for w in (self.anchor, self.status, *self.plots.values()):
            display(w)
