"""Steppable runs (engine on a tiny random model, simulator) and the live dashboard, headless."""
import time

import numpy as np
import pytest

import paged
from paged import runs
from paged.core import snapshot as S
from paged.engine import SamplingParams
from paged.sim.simulator import SimConfig
from paged.sim.workload import synthetic_trace


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from paged.models.testing import make_tiny_checkpoint
    d = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama")
    return paged.LLM(d, num_blocks=12, block_size=4, dtype="float32", device="cpu")


def _workload():
    shared = list(range(10, 22))
    return [runs.EngineRequest("a", shared + [1], SamplingParams(max_tokens=6, n=2, temperature=1.0, seed=1,
                                                                ignore_eos=True), 1),
            runs.EngineRequest("b", shared + [2], SamplingParams(max_tokens=6, ignore_eos=True), 3),
            runs.EngineRequest("c", list(range(40, 60)), SamplingParams(max_tokens=8, ignore_eos=True), 4)]


def test_engine_run_rows_requests_snapshot(llm):
    run = runs.Run(llm, _workload())
    states = set()
    while not run.done:
        row = run.step()
        assert set(row) == set(runs.STEP_COLUMNS)
        snap = run.snapshot()
        states.update(np.unique(snap.state).tolist())
        run.kv.check_invariants()
    assert {S.STATE_SHARED, S.STATE_WRITING} <= states          # n=2 shares the prompt's blocks
    assert sum(r["num_block_copies"] for r in run.rows) >= 1     # copy-on-write of the partial block
    assert run.rows[-1]["prefix_cache_hits"] >= 8                # b reuses a's full blocks
    req = run.requests_frame()
    assert sorted(req.request_id) == ["a", "b", "c"] and (req.ttft_s > 0).all()
    assert len(run.tbt_samples()) > 0 and "CPU run" in run.backend
    assert run.backend.startswith(f"{run.engine.runner.backend} kernels on cpu")  # native or torch: what ran
    again = run.fresh(enable_prefix_caching=False).run_to_completion()
    assert again.rows[-1]["prefix_cache_hits"] == 0


def test_sim_run_interface():
    run = runs.Run(SimConfig(model="llama-2-7b", num_blocks=64), synthetic_trace("sharegpt", 8, rate=4.0, trace_seed=0))
    run.run_to_completion()
    assert run.done and len(run.rows) > 5 and set(run.rows[0]) == set(runs.STEP_COLUMNS)
    assert len(run.request_rows()) == 8 and "simulated" in run.backend


def test_dashboard_frames_capped_and_live(llm):
    from paged.viz import live
    run = runs.Run(llm, _workload())
    dash = live.Dashboard(run, views=("grid", "tables", "usage", "timeline", "latency", "prefix"), fps=5)
    seen = []
    t0 = time.perf_counter()
    while not run.done:
        dash.step_once()
        seen.append(str(dash.figures["grid"].data[0].z))
    wall = time.perf_counter() - t0
    assert dash.frames <= 5 * wall + 2
    assert len(set(seen)) > 1                                      # the grid moved during the run
    text = dash.select_block(0)
    assert "block 0" in text
    assert len(dash.figures["usage"].data[0].x) == len(run.rows)
    dash.reset(num_blocks=10)
    assert dash.run.kv.num_blocks == 10 and dash.buffer.n == 0


def test_ring_buffer_wraps():
    from paged.viz.live import RingBuffer
    rb = RingBuffer(4, ("step",))
    for i in range(6):
        rb.push({"step": i})
    assert rb.frame()["step"].tolist() == [2, 3, 4, 5]


def test_dashboard_falls_back_to_static_figures(monkeypatch):
    from paged.viz import live
    monkeypatch.setattr(live, "widgets_available", lambda: "ImportError: no anywidget")
    run = runs.Run(SimConfig(model="llama-2-7b", num_blocks=64), synthetic_trace("sharegpt", 4, rate=4.0, trace_seed=0))
    dash = live.Dashboard(run, views=("grid", "usage"))
    assert dash.panel is None and all(type(f).__name__ == "Figure" for f in dash.figures.values())
    dash.run_to_completion()
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda x: shown.append(x))
    dash._ipython_display_()
    assert "no anywidget" in shown[0].data and len(shown) == 3


def test_replay_view_steps_through_snapshots(llm):
    from paged.viz import live
    run = runs.Run(llm, _workload()).keep_snapshots(1).run_to_completion()
    view = live.ReplayView(run, autoplay=False)
    first = str(view.figures["grid"].data[0].z)
    view.show_step(view.steps[len(view.steps) // 2])
    assert str(view.figures["grid"].data[0].z) != first and view.story.player.max == len(run.rows)
    assert not view.story.player.autoplay and view.story.summary.value  # the run's summary is shown too


def test_replay_view_autoplays_in_the_browser(llm):
    """The player starts in the page the first time it renders (its own timer, not ipywidgets.Play, whose
    playing=True set in the kernel shows pause and never moves); the browser test watches it advance."""
    from paged.viz import live
    run = runs.Run(llm, _workload()).keep_snapshots(1).run_to_completion()
    view = live.ReplayView(run)
    assert view.story.player.autoplay and view.story.player.value == min(run.snapshots)
    assert "autoplay" in view.story.player._esm and view.story.player.layout.display != "none"
