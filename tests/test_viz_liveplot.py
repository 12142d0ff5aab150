"""LivePlot (paged.viz.liveplot): the figure travels in the comm's opening state, a batch of edits is one
message, a view gets the whole current figure, clicks come back as callbacks; the Dashboard uses it."""
from __future__ import annotations

import json

import plotly.graph_objects as go
import pytest

pytest.importorskip("anywidget")
from paged.viz.liveplot import LivePlot  # noqa: E402


def test_state_holds_the_figure_and_one_shared_plotly_js() -> None:
    p = LivePlot(go.Figure(go.Heatmap(z=[[1, 2], [3, 4]]), layout_title_text="pool"))
    q = LivePlot(go.Figure(go.Scatter(x=[0], y=[1])))
    fig = json.loads(p._figure)
    assert fig["data"][0]["type"] == "heatmap" and fig["layout"]["title"]["text"] == "pool"
    lib = p._library
    assert "plotly.js" in lib.source[:200] and len(lib.source) > 1_000_000  # plotly.py's own bundle
    # the library travels once per page: every plot references the same widget, none carries the source
    assert q._library is lib
    for w in (p, q):
        state = w.get_state()
        assert state["_library"] == f"IPY_MODEL_{lib.model_id}"
        assert len(json.dumps({k: v for k, v in state.items() if k != "_esm"})) < 100_000
    assert len(p._esm) < 4000  # small: loads well inside anywidget's 2 s start-up window


def test_frames_travel_on_a_plain_ipywidgets_model() -> None:
    """anywidget 0.11 drops every message to a model whose start-up missed its 2-s window (a page whose main
    thread is busy evaluating plotly.js): the frames go to a base WidgetModel, which nothing gates."""
    import anywidget
    p = LivePlot(go.Figure(go.Scatter(x=[0], y=[1])))
    st = p._figure_state
    assert not isinstance(st, anywidget.AnyWidget)
    assert (st._model_module, st._model_name, st._view_name) == ("@jupyter-widgets/base", "WidgetModel", None)
    assert p.get_state()["_figure_state"] == f"IPY_MODEL_{st.model_id}" and "_figure" not in p.get_state()
    assert 'model.get("_figure_state")' in p._esm and 'state.on("change:figure"' in p._esm
    p.close()
    assert st.comm is None  # closed with its plot


def test_a_closed_library_is_made_again() -> None:
    from paged.viz.liveplot import plotly_library
    lib = plotly_library()
    lib.close()
    p = LivePlot(go.Figure())
    assert p._library is not lib and p._library.comm is not None


def test_batch_update_sends_the_whole_figure_once() -> None:
    p = LivePlot(go.Figure(go.Scatter(x=[0], y=[0])))
    sent = []
    p._figure_state.observe(lambda ch: sent.append(json.loads(ch["new"])), "figure")
    with p.batch_update():
        p.data[0].x, p.data[0].y = [0, 1, 2], [3, 4, 5]
        p.layout.title.text = "step 3"
    assert len(sent) == 1 and sent[0]["data"][0]["y"] == [3, 4, 5] and sent[0]["layout"]["title"]["text"] == "step 3"
    p.update_layout(height=300)
    assert len(sent) == 2 and sent[1]["layout"]["height"] == 300


def test_clicks_reach_callbacks() -> None:
    p = LivePlot(go.Figure(go.Heatmap(z=[[1, 2]])))
    got = []
    p.on_click(lambda x, y, curve: got.append((x, y, curve)))
    p._on_msg(p, {"event": "click", "x": 1, "y": 0, "curve": 0}, [])
    p._on_msg(p, {"event": "other"}, [])
    assert got == [(1, 0, 0)]


def test_dashboard_grid_click_selects_the_block() -> None:
    from paged import runs
    from paged.sim.simulator import SimConfig
    from paged.sim.workload import synthetic_trace
    from paged.viz import live
    run = runs.Run(SimConfig(model="llama-2-7b", num_blocks=64), synthetic_trace("sharegpt", 8, rate=4.0, seed=0))
    dash = live.Dashboard(run, views=("grid", "tables"))
    assert isinstance(dash.figures["grid"], LivePlot) and isinstance(dash.figures["tables"], LivePlot)
    for _ in range(6):
        dash.step_once()
    dash.figures["grid"]._on_msg(None, {"event": "click", "x": 0, "y": 0, "curve": 0}, [])
    assert dash.panel.tokens.value.startswith("<b>block 0</b>")
