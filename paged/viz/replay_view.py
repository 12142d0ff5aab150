"""ReplayView: a finished run (or a saved recording) replayed from the snapshots it kept.

The pool and tables at each step, a player that starts by itself once shown and ticks in the
browser (so it animates after the notebook finished, and in Voilà), the run's key moments (click one
to jump there) and its summary (``paged.viz.story``). Deterministic: step k always shows the
snapshot kept at or before step k.
"""
from __future__ import annotations

from typing import Sequence

from . import figures as F
from .buffers import widgets_available
from .dashboard_views import fix_table_rows, redraw_pool

__all__ = ["ReplayView"]


class ReplayView:
    """Replay the snapshots a finished run kept (`run.keep_snapshots`) or a `paged.replay.Recording`
    (see the module docstring)."""

    def __init__(self, run, views: Sequence[str] = ("grid", "tables"), *, interval_ms: int = 300,
                 autoplay: bool = True, cols: int | None = None, max_requests: int = 12) -> None:
        from paged.errors import ConfigError
        if not run.snapshots:
            raise ConfigError("no snapshots to replay; call run.keep_snapshots(1) before stepping the run")
        self.run, self.views, self.cols, self.max_requests = run, tuple(views), cols, max_requests
        self.steps = sorted(run.snapshots)
        first = run.snapshots[self.steps[0]]
        self.figures = {"grid": F.block_grid(first, cols), "tables": F.block_tables(first, max_requests)}
        self.figures = {k: v for k, v in self.figures.items() if k in self.views}
        if "tables" in self.figures:
            fix_table_rows(self.figures["tables"], max_requests)
        self.no_widgets = widgets_available()
        self.story = None
        if self.no_widgets is None:
            from .liveplot import LivePlot
            from .story import StoryView
            self.figures = {k: LivePlot(v) for k, v in self.figures.items()}
            self.story = StoryView(run, self.show_step, autoplay=autoplay, interval_ms=interval_ms)
            self.story.refresh(current=self.steps[0])
            self.story.player.value = self.steps[0]
        self.show_step(self.steps[0] if autoplay else self.steps[-1])

    def show_step(self, step: int) -> None:
        redraw_pool(self.figures, self.run.snapshot_at(step), f"replay: block pool at step {step}",
                    f"replay: block tables at step {step}", cols=self.cols, max_requests=self.max_requests)

    def _ipython_display_(self) -> None:
        from IPython.display import display
        figs = list(self.figures.values())
        if self.story is not None:  # the player on top, the summary and key moments below the first figure
            figs = [self.story.player, *figs[:1], self.story.summary, self.story.figure, *figs[1:]]
        for f in figs:
            display(f)
