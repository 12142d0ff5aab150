"""LivePlot: a plotly figure in the browser that the kernel redraws, robust to a slow page.

Why not ``go.FigureWidget``: plotly >= 6 builds it on anywidget with a 5 MB ESM (plotly.js inside)
that each model imports on its own, and anywidget 0.11 gives a model 2 s to load its ESM. On a busy
machine (or a CPU-throttled browser) it takes longer, the model's ``ready`` promise rejects and the
front end drops every later message of that model, the figure's data included: empty axes for good
(seen in JupyterLab on the 2-core CI machine; reproduced with Chromium's CPU throttling x12).

So LivePlot's ESM is a few hundred bytes, and plotly.js (the copy plotly.py ships, ~4.8 MB) lives in
ONE hidden ``PlotlyLibrary`` widget per kernel: it crosses the websocket and is evaluated once per
page. Evaluating it still blocks the page for seconds under 12-20x throttling, and a LivePlot model
starting then misses the same 2-s window; so frames do not travel as an anywidget trait but as the
state of a ``FigureState`` (a plain ipywidgets model, no view, no ESM, which anywidget's start-up
cannot gate) that the LivePlot's view listens to. Each frame is the whole figure in one message
(``batch_update``), redrawn with ``Plotly.react`` at most once per animation frame; a view created
later (re-render, Voila) draws the current figure. Clicks come back as messages (not gated).

Invariant: ``self.figure`` (a ``go.Figure``) is the truth; the browser shows the last figure sent.
"""
from __future__ import annotations

import contextlib
import functools
import pathlib
from typing import Callable, Iterator

import anywidget
import plotly
import plotly.graph_objects as go
import plotly.io as pio
import traitlets
from ipywidgets import Widget, widget_serialization

__all__ = ["FigureState", "LivePlot", "PlotlyLibrary", "plotly_library"]

_ESM = r"""
function loadPlotly(model) {
  if (!globalThis.__pagedPlotly) {
    globalThis.__pagedPlotly = (async () => {
      await new Promise((r) => setTimeout(r, 0));  // after the widget set-up tasks already queued
      const ref = String(model.get("_library") || "").replace(/^IPY_MODEL_/, "");
      const lib = await model.widget_manager.get_model(ref);
      const m = { exports: {} };
      new Function("module", "exports", lib.get("source"))(m, m.exports);
      return m.exports;
    })().catch((e) => { globalThis.__pagedPlotly = null; throw e; });
  }
  return globalThis.__pagedPlotly;
}
async function render({ model, el }) {
  // the frames arrive on a plain ipywidgets model (FigureState), not on this anywidget's own
  const ref = String(model.get("_figure_state") || "").replace(/^IPY_MODEL_/, "");
  const state = await model.widget_manager.get_model(ref);
  const Plotly = await loadPlotly(model);
  const div = document.createElement("div");
  el.appendChild(div);
  let queued = false;
  const draw = () => {
    queued = false;
    const fig = JSON.parse(state.get("figure") || "{}");
    Plotly.react(div, fig.data || [], fig.layout || {}, { displaylogo: false, responsive: true });
  };
  const onChange = () => { if (!queued) { queued = true; requestAnimationFrame(draw); } };
  draw();
  state.on("change:figure", onChange);
  div.on("plotly_click", (ev) => {
    const p = ev && ev.points && ev.points[0];
    if (p) model.send({ event: "click", x: p.x, y: p.y, curve: p.curveNumber });
  });
  return () => { state.off("change:figure", onChange); Plotly.purge(div); };
}
export default { render };
"""


@functools.lru_cache(maxsize=1)
def _plotly_js() -> str:
    """plotly.py's own plotly.min.js (the version its figures are validated against)."""
    return (pathlib.Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_text(encoding="utf-8")


class PlotlyLibrary(anywidget.AnyWidget):
    """plotly.js as the state of one widget that is never displayed; LivePlots reference it."""

    _esm = "export default {};"
    source = traitlets.Unicode("").tag(sync=True)


_shared: PlotlyLibrary | None = None
SHARE_PLOTLY = True
"""False: every LivePlot gets a library of its own, as before sharing (benchmarks/viz.py's page-bytes baseline)."""


def plotly_library() -> PlotlyLibrary:
    """The kernel's one PlotlyLibrary (made again if it was closed, e.g. by ``Widget.close_all``)."""
    global _shared
    if not SHARE_PLOTLY:
        return PlotlyLibrary(source=_plotly_js())
    if _shared is None or _shared.comm is None:
        _shared = PlotlyLibrary(source=_plotly_js())
    return _shared


class FigureState(Widget):
    """A figure's JSON as the state of a plain ipywidgets model (``@jupyter-widgets/base``'s
    ``WidgetModel``: no view, no ESM), so its updates reach the page even when anywidget's 2-s
    start-up window rejected the LivePlot's own model."""

    figure = traitlets.Unicode("{}").tag(sync=True)


class LivePlot(anywidget.AnyWidget):
    """``LivePlot(fig)``: ``.data`` / ``.layout`` / ``.update_layout`` edit the figure; the
    browser redraws when a ``batch_update()`` block ends (or on ``send()``)."""

    _esm = _ESM
    _figure_state = traitlets.Instance(FigureState).tag(sync=True, **widget_serialization)
    _library = traitlets.Instance(PlotlyLibrary).tag(sync=True, **widget_serialization)

    def __init__(self, fig: go.Figure | dict | None = None) -> None:
        figure = go.Figure(fig)
        # the figure goes in the state its model opens with (no first update to lose)
        state = FigureState(figure=pio.to_json(figure, validate=False))
        super().__init__(_figure_state=state, _library=plotly_library())
        self.figure = figure
        self._depth = 0
        self._click: list[Callable[[float, float, int], None]] = []
        self.on_msg(self._on_msg)

    @property
    def data(self):
        return self.figure.data

    @property
    def layout(self):
        return self.figure.layout

    def update_layout(self, *args, **kwargs) -> "LivePlot":
        self.figure.update_layout(*args, **kwargs)
        self.send_figure()
        return self

    @contextlib.contextmanager
    def batch_update(self) -> Iterator["LivePlot"]:
        """Edits inside go to the browser as one message when the outermost block ends."""
        self._depth += 1
        try:
            yield self
        finally:
            self._depth -= 1
            if self._depth == 0:
                self.send_figure()

    @property
    def _figure(self) -> str:
        """The JSON the browser has been sent last."""
        return self._figure_state.figure

    def send_figure(self) -> None:
        if self._depth == 0:
            self._figure_state.figure = pio.to_json(self.figure, validate=False)

    def replace_figure(self, fig: go.Figure) -> None:
        """Make ``fig`` the figure and send it whole (at the end of an enclosing ``batch_update``)."""
        self.figure = fig
        self.send_figure()

    def close(self) -> None:
        self._figure_state.close()
        super().close()

    def on_click(self, callback: Callable[[float, float, int], None]) -> None:
        """``callback(x, y, trace_index)`` for each click on a point of the plot."""
        self._click.append(callback)

    def _on_msg(self, _widget, content, _buffers) -> None:
        if isinstance(content, dict) and content.get("event") == "click":
            for cb in self._click:
                cb(content.get("x"), content.get("y"), int(content.get("curve") or 0))
