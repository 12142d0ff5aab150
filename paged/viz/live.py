"""Live dashboards: live plots that follow a run (paged.runs) while it steps.

    dash = Dashboard(run, views=("grid", "tables", "usage", "timeline")); dash   # press play
    dash.run_to_completion()   # or step it to the end from the cell (headless execution)

Invariants: at most `fps` frames a second whatever the step rate, and drawing about `draw_share`
of the wall time (a frame is due when 1/fps and (1/draw_share - 1) x the last frame's cost have both
passed; the last step is always drawn); one `batch_update()` per figure per frame; time series from
fixed-size ring buffers assigned whole. Counting never depends on drawing: the run records every
step. Plots are `liveplot.LivePlot`s, not FigureWidgets (whose 5 MB ESM can miss anywidget's 2-s
start-up window on a busy machine: an empty plot for good; see liveplot.py), displayed one by one,
never inside a Box (plotly #4998). Without ipywidgets/anywidget: static figures, and a note.
"""
from __future__ import annotations

import asyncio
import html
import time
from typing import Any, Callable, Sequence

import numpy as np
import plotly.graph_objects as go

from paged.telemetry import STEP_COLUMNS
from . import figures as F
from .buffers import CachedDecoder, FramePacer, RingBuffer, widgets_available
from .dashboard_views import VIEWS, build_views, redraw_pool, table_rows, update_series
from .replay_view import ReplayView

SNAPSHOT_BUDGET_BYTES = 64 << 20
"""What a dashboard lets its run keep in snapshots (for the story of the finished run)."""
STORY_EVERY_S = 1.0
"""How often a live frame also redraws the key-moments strip (it reads all the run's rows)."""

__all__ = ["CachedDecoder", "Dashboard", "ReplayView", "RingBuffer", "VIEWS", "widgets_available"]


class Dashboard:
    """Live figures and a control panel over `run` (a `paged.runs.Run`). `settings`: cache settings shown in
    the panel (name -> initial value; applied on reset via `run.fresh(**settings)`); `workload`: (builder,
    kwargs) whose int kwargs get sliders, rebuilt on reset as `builder(run.tokenizer, **kwargs)`."""

    def __init__(self, run, views: Sequence[str] = ("grid", "tables", "usage", "timeline"), *, fps: float = 15.0,
                 steps_per_second: float | None = None, history: int = 4096, cols: int | None = None,
                 max_requests: int = 12, settings: dict[str, Any] | None = None,
                 workload: tuple[Callable, dict] | None = None, title: str | None = None) -> None:
        bad = [v for v in views if v not in VIEWS]
        if bad:
            from paged.errors import ConfigError
            raise ConfigError(f"unknown view(s) {bad}; choose from {VIEWS}")
        self.run, self.views, self.fps, self.cols, self.max_requests = run, tuple(views), fps, cols, max_requests
        self.steps_per_second, self.title = steps_per_second, title
        self.buffer = RingBuffer(history)
        self.frames = 0
        self.selected: str | None = None
        self.page = 0
        self.pacer = FramePacer(fps)
        self._story_at = 0.0
        self._task: asyncio.Task | None = None
        self._playing = False
        self._stepping = False  # run_to_completion is stepping from a cell
        self._workload = workload
        self.no_widgets = widgets_available()
        self._decoder = CachedDecoder(run.tokenizer) if run.tokenizer is not None else None
        self.panel = self.story = self.anchor = None
        self.viewing: int | None = None  # a past step shown from its snapshot (None: the live state)
        self._keep_snapshots(run)
        if self.no_widgets is None:
            from .panels import ControlPanel, ScrollAnchor
            from .story import StoryView
            self.panel = ControlPanel(self, settings, workload[1] if workload else None)
            self.anchor = ScrollAnchor()
            self.story = StoryView(run, self.show_step)
        self.figures: dict[str, go.Figure] = {}
        self._build()
        if run.done:
            self._finished()

    @staticmethod
    def _keep_snapshots(run) -> None:
        """Let the run keep snapshots for the story (if it does not already), within a memory budget."""
        if getattr(run, "snapshot_stride", 1) or not hasattr(run, "keep_snapshots"):
            return
        per = max(1, run.kv.num_blocks) * 40 + 4096  # ~bytes of one snapshot (arrays per block + tables)
        run.keep_snapshots(1, max_snapshots=int(max(16, min(4000, SNAPSHOT_BUDGET_BYTES // per))))

    # ---- figures ---------------------------------------------------------------------
    def _static(self) -> dict[str, go.Figure]:
        return build_views(self.views, self.run, self.run.snapshot(), self._steps_frame(), cols=self.cols,
                           page=self.page, decoder=self._decoder, selected=self.selected, max_requests=self.max_requests)

    def _steps_frame(self):
        import pandas as pd
        d = self.buffer.frame()
        return pd.DataFrame({c: d.get(c, np.zeros(len(d["step"]))) for c in STEP_COLUMNS})

    def _build(self) -> None:
        figs = self._static()
        if self.no_widgets is None:
            from .liveplot import LivePlot  # needs anywidget: imported only when widgets work
            figs = {k: LivePlot(f) for k, f in figs.items()}
            if "grid" in figs:
                figs["grid"].on_click(self._on_grid_click)
        self.figures = figs
        self._status()

    def _status(self) -> None:
        if self.panel is None:
            return
        r = self.run
        last = r.rows[-1] if r.rows else None
        t = f"{last['time_s'] + last['step_time_s']:.2f} s" if last else "-"
        state = 'done' if r.done else 'running' if self._playing or self._stepping else 'paused'
        shown = f" · showing step {self.viewing}" if self.viewing is not None else ""
        self.panel.status.value = (
            f"<b>{html.escape(self.title or r.label)}</b> · {html.escape(r.backend)}<br>"
            f"step {len(r.rows)} · {r.label} clock {t} · {state}{shown}"
            f" · frames drawn {self.frames} (≤ {self.fps:g}/s)")

    def draw(self) -> None:
        """Draw one frame now (each figure in one batch_update)."""
        self.frames += 1
        with self.pacer.timed():
            self._draw()

    def _draw(self) -> None:
        if self.no_widgets is not None:
            return
        self.viewing = None
        run, figs = self.run, self.figures
        self._draw_pool(run.snapshot if "tables" in figs else None)
        update_series(figs, self.buffer.frame(), run)
        if self.story is not None and (run.done or time.perf_counter() - self._story_at >= STORY_EVERY_S):
            self.story.refresh(current=len(run.rows) or None)  # reads every row: at most once a second live
            self._story_at = time.perf_counter()
        self._status()

    def _draw_pool(self, take=None, step: int | None = None) -> None:
        """Grid and tables from `take()` (a snapshot of the whole pool), or of the page drawn only."""
        run, figs = self.run, self.figures
        snap = None
        if take is not None:
            snap = take()
        elif "grid" in figs:  # only the page drawn is read (cheap frames for pools of 100k+ blocks)
            rows, cols = F.grid_shape(run.kv.num_blocks, self.cols)
            snap = run.snapshot(block_range=(self.page * rows * cols, (self.page + 1) * rows * cols))
        if snap is None:
            return
        when = f"step {snap.step}" if step is None else f"step {snap.step} (replayed)"  # the snapshot's own step
        redraw_pool(figs, snap, f"pool at {when} ({snap.num_blocks}×{snap.block_size} tokens)",
                    f"block tables at {when} (cell = physical block id)", cols=self.cols, page=self.page,
                    decoder=self._decoder, selected=self.selected, max_requests=table_rows(run, self.max_requests))

    def show_step(self, step: int) -> None:
        """Show the pool as it was after `step` (its kept snapshot; the nearest earlier one if it
        kept none, and then `viewing` is that one's step): what a click on a key moment or the
        replay player does. Pauses a playing run."""
        if self.no_widgets is not None or not self.run.snapshots:
            return
        if self._playing:
            self.pause()
        snap = self.run.snapshot_at(step)
        self.viewing = snap.step  # the status line names the step the grid shows
        self._draw_pool(lambda: snap, step)
        self._status()

    def _on_grid_click(self, x, y, trace: int = 0) -> None:
        if x is None or y is None:
            return
        g = F.grid_shape(self.run.kv.num_blocks, self.cols)
        self.select_block(self.page * g[0] * g[1] + int(y) * g[1] + int(x))

    def select_block(self, block: int) -> str:
        """Highlight the table of the request owning `block` (in the step shown); show its tokens.
        Returns the text shown."""
        snap = self.run.snapshot() if self.viewing is None else self.run.snapshot_at(self.viewing)
        if not 0 <= block < snap.num_blocks:
            return ""
        o = int(snap.owner[block])
        self.selected = snap.request_ids[o] if o >= 0 else None
        toks = snap.block_tokens(block)
        tok = self.run.tokenizer
        body = (html.escape(tok.decode(list(toks))) if toks and tok is not None else str(list(toks or [])))
        holders = ", ".join(snap.holders(block)) or "none (free)"
        text = (f"<b>block {block}</b> ({F.STATE_NAMES[snap.state[block]]}, ref {int(snap.ref_count[block])}) "
                f"held by: {html.escape(holders)}<br><code>{body or '(no tokens)'}</code>")
        if self.panel is not None:
            self.panel.tokens.value = text
        if self.viewing is None:
            self.draw()
        else:
            self.show_step(self.viewing)
        return text

    # ---- stepping --------------------------------------------------------------------
    def step_once(self, draw: bool = False) -> dict | None:
        """One run step; a frame is drawn if one is due (or `draw`)."""
        if self.run.done:
            return None
        row = self.run.step()
        if row is not None:
            self.buffer.push(row)
        if draw or self.run.done or self.pacer.due():
            self.draw()
        if self.run.done:
            self._finished()
        return row

    def _finished(self) -> None:
        """The run is over: keep its story on screen (summary, key moments, replay), showing the
        pool at its peak usage rather than the empty pool of the end."""
        if self.story is None:
            return
        self.story.refresh()
        self.story.player.layout.display = None
        peak = self.story.moments[self.story.moments["kind"] == "peak"]
        if len(peak) and self.run.snapshots:
            self.story.jump(int(peak["step"].iloc[0]))

    def set_speed(self, steps_per_second: float | None) -> None:
        self.steps_per_second = None if not steps_per_second or steps_per_second >= 1000 else steps_per_second

    def _pause_s(self, started: float) -> float:
        return max(0.0, 1.0 / self.steps_per_second - (time.perf_counter() - started)) if self.steps_per_second else 0.0

    async def _loop(self) -> None:
        try:
            while self._playing and not self.run.done:
                t = time.perf_counter()
                self.step_once()
                await asyncio.sleep(self._pause_s(t))  # yields: widget messages get handled
        finally:
            self._playing = False
            self._last_frame()
            if self.panel is not None:
                self.panel.stopped()

    def play(self) -> asyncio.Task | None:
        """Run in a background asyncio task (needs a running event loop, as in Jupyter)."""
        if self._playing or self.run.done:
            return self._task
        try:
            loop = asyncio.get_event_loop()  # the running loop where there is one (Jupyter)
        except RuntimeError:
            loop = None
        if loop is None or not loop.is_running():
            self.run_to_completion()  # no event loop to run in (a script): finish here
            return None
        self._bring_into_view()
        self._playing = True
        self._task = loop.create_task(self._loop())
        return self._task

    def pause(self) -> None:
        self._playing = False

    async def wait(self) -> None:
        """Await the background task (a final `await dash.wait()` cell keeps a headless kernel alive)."""
        if self._task is not None:
            await self._task

    def run_to_completion(self, max_steps: int = 100_000, pace: bool = True) -> None:
        """Step to the end from here (blocking); frames still go out at <= fps (a cell running
        this shows the motion live; returns None so the dashboard is not displayed twice)."""
        self._playing, self._stepping = False, True
        self._bring_into_view()
        try:
            for _ in range(max_steps):
                if self.run.done:
                    break
                t = time.perf_counter()
                self.step_once()
                if pace and self.steps_per_second:
                    time.sleep(self._pause_s(t))
        finally:
            self._stepping = False
        self._last_frame()

    def _last_frame(self) -> None:
        """The frame a play or a blocking run ends on (and the run's story, once it is over)."""
        self.draw()
        if self.run.done:
            self._finished()

    def _bring_into_view(self) -> None:
        """Scroll the page to this dashboard as its run starts (Run All lands on the show)."""
        if self.anchor is not None:
            self.anchor.scroll += 1

    def reset(self, workload: dict | None = None, **settings) -> None:
        """A fresh run with changed settings (and workload kwargs), drawn from step 0."""
        self._playing = False
        kw = {}
        if workload is not None and self._workload is not None:
            builder, base = self._workload
            self._workload = (builder, {**base, **workload})
            kw["workload"] = builder(self.run.tokenizer, **self._workload[1])
        self.run = self.run.fresh(**kw, **settings)
        self._keep_snapshots(self.run)
        self._decoder = CachedDecoder(self.run.tokenizer) if self.run.tokenizer is not None else None
        self.buffer.clear()
        self.selected = self.viewing = None
        if self.panel is not None:
            self.panel.clear_tokens()
        if self.story is not None:
            self.story.source = self.run
            self.story.clear()
            self.story.player.layout.display = "none"
        self.draw()

    # ---- display ---------------------------------------------------------------------
    def _ipython_display_(self) -> None:
        from IPython.display import HTML, display
        if self.no_widgets is not None:
            display(HTML(f"<p><b>Static figures</b>: live widgets are unavailable here ({html.escape(self.no_widgets)}); "
                         "install ipywidgets and anywidget for the live view. Backend: "
                         f"{html.escape(self.run.backend)}</p>"))
            for f in self._static().values():
                display(f)
            return
        figs = list(self.figures.values())
        # one by one (a FigureWidget inside a Box rendered broken: plotly #4998); the story strip
        # (replay player, summary, key moments) right below the first figure (the pool)
        for w in (self.anchor, self.panel.widget, *figs[:1], *self.story.widgets, *figs[1:]):
            display(w)
