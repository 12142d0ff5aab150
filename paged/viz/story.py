"""The story of a run as a view: block usage over the steps with the key moments marked, a
player that replays the kept snapshots, and a short summary (``paged.story``).

``story_figure`` is pure (records -> go.Figure). ``StoryView`` is the widget strip a Dashboard
or a ReplayView shows: a click on the figure (a moment's marker or any step of the line) or a
move of the player calls ``show_step(step)``, which the owner uses to draw the pool as it was
after that step. Invariant: the marked current step is the last one shown.
"""
from __future__ import annotations

import html
from typing import Callable

import numpy as np
import plotly.graph_objects as go

from paged import story

__all__ = ["StoryView", "story_figure"]


def story_figure(steps, moments=None, current: int | None = None, title: str | None = None) -> go.Figure:
    """Block usage (%) per step, a marker per key moment (hover for what happened; one legend
    entry per kind present, traces in ``paged.story.MOMENTS`` order after the usage line), and a
    vertical line at ``current``. x is the 1-based step index."""
    moments = story.key_moments(steps) if moments is None else moments
    n = len(steps)
    usage = 100 * steps["kv_cache_usage_perc"].to_numpy(float) if n else np.zeros(0)
    fig = go.Figure(go.Scatter(x=np.arange(1, n + 1), y=usage, mode="lines", name="blocks in use (%)",
                               line=dict(color="#3b6fb6"),
                               hovertemplate="step %{x}: %{y:.0f}% of the blocks in use<extra></extra>"))
    for kind, m in story.MOMENTS.items():
        mine = moments[moments["kind"] == kind] if len(moments) else moments
        at = mine["step"].to_numpy(int) if len(mine) else np.zeros(0, int)
        fig.add_trace(go.Scatter(
            x=at, y=usage[at - 1] if len(at) else np.zeros(0), mode="markers", name=m.legend,
            text=list(mine["label"]) if len(mine) else [], hovertemplate="%{text}<extra></extra>",
            marker=dict(symbol=m.symbol, size=13, color=m.colour, line=dict(width=1.5, color=m.colour)),
            showlegend=bool(len(at))))
    if current is not None and n:
        fig.add_vline(x=current, line=dict(color="#888", dash="dot"))
    return fig.update_layout(
               title=title or (f"key moments of the run ({n} steps) · click one to see the pool then" if n else
                               "key moments appear here as the run goes"),
               height=280, margin=dict(l=60, r=20, t=50, b=40), hovermode="closest",
               legend=dict(orientation="h", yanchor="top", y=-0.22, x=0),
               xaxis=dict(title="step", range=[0.5, max(n, 1) + 0.5], tickformat="d", dtick=None if n > 10 else 1,
                          showticklabels=bool(n)),
               yaxis=dict(title="blocks in use (%)", range=[0, 105]))


class StoryView:
    """The story strip: a Player, the summary and the key-moments figure (widgets only).
    ``source`` has ``rows`` / ``steps_frame()`` / ``requests_frame()`` and ``label`` (a run or a
    recording); ``refresh()`` re-reads it. The player covers steps 1..len(rows)."""

    def __init__(self, source, show_step: Callable[[int], None], *, autoplay: bool = False,
                 interval_ms: int = 300) -> None:
        import ipywidgets as W

        from .liveplot import LivePlot
        from .player import Player
        self.source, self._show_step = source, show_step
        self.player = Player(min=1, max=1, value=1, interval_ms=interval_ms, autoplay=autoplay, repeat=True,
                             label="step")
        if not autoplay:
            self.player.layout.display = "none"  # shown by the owner once there is a run to replay
        self.summary = W.HTML()
        self.figure = LivePlot(story_figure(source.steps_frame()))
        self.figure.on_click(lambda x, y, trace: self.jump(x))
        self.player.observe(lambda change: self._show(int(change["new"])), "value")
        self.current: int | None = None
        self.moments = story.key_moments(source.steps_frame())
        self.widgets = (self.player, self.summary, self.figure)

    def refresh(self, current: int | None = None) -> None:
        """Re-read the records: moments, summary, the player's range and the figure (redrawn whole)."""
        steps = self.source.steps_frame()
        self.moments = story.key_moments(steps)
        n = len(steps)
        self.player.max = max(n, 1)
        self.current = current if current is not None else self.current
        self.figure.replace_figure(story_figure(steps, self.moments, self.current))
        sentences = story.summary(steps, self.source.requests_frame(), getattr(self.source, "label", "run"))
        items = "".join(f"<li>{html.escape(s)}</li>" for s in sentences)
        head = "What happened" if getattr(self.source, "done", True) else "So far"
        self.summary.value = f"<div class='paged-summary'><b>{head}</b><ul>{items}</ul></div>" if n else ""

    def clear(self) -> None:
        """A fresh run: nothing to tell yet."""
        self.current = None
        self.player.playing = False
        self.player.max = self.player.value = 1
        self.refresh()

    def jump(self, step) -> None:
        """Show the pool after ``step`` (a click or a moment); pauses the player."""
        if step is None:
            return
        step = int(round(float(step)))
        self.player.playing = False
        if self.player.value == step:
            self._show(step)
        else:
            self.player.value = step  # the observer shows it

    def _show(self, step: int) -> None:
        if not 1 <= step <= len(self.source.rows):
            return
        self.current = step
        self._show_step(step)
        fig = self.figure.figure
        with self.figure.batch_update():
            fig.layout.shapes = ()
            fig.add_vline(x=step, line=dict(color="#888", dash="dot"))
