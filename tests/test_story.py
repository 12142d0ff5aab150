"""The story of a run (paged.story, paged.viz.story, the Dashboard once a run is over): key moments
and summaries computed from records, snapshots kept within a budget, a finished dashboard that shows
its peak instead of an empty pool, a reset that clears every panel."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from paged import runs, story
from paged.telemetry import STEP_COLUMNS


def _steps(**cols) -> pd.DataFrame:
    n = len(next(iter(cols.values())))
    base = {c: np.zeros(n) for c in STEP_COLUMNS}
    base["step"] = np.arange(1, n + 1)
    base["time_s"] = np.arange(n) * 0.5
    base["step_time_s"] = np.full(n, 0.5)
    base.update({k: np.asarray(v, float) for k, v in cols.items()})
    return pd.DataFrame(base)


def test_key_moments_from_hand_built_records() -> None:
    steps = _steps(prefix_cache_hits=[0, 0, 16, 16, 32, 32, 32, 32],
                   num_block_copies=[0, 2, 1, 0, 0, 1, 0, 0],
                   num_preempted=[0, 0, 0, 1, 0, 1, 0, 0],
                   num_swapped_out_blocks=[0, 0, 0, 0, 0, 3, 0, 0],
                   kv_cache_usage_perc=[0.1, 0.4, 0.5, 0.9, 0.9, 0.7, 0.2, 0.0],
                   num_used_blocks=[2, 8, 10, 18, 18, 14, 4, 0])
    m = story.key_moments(steps)
    got = list(zip(m.step, m.kind))
    assert got == [(2, "cow"), (3, "prefix_hit"), (4, "preempt"), (4, "peak"), (6, "cow"), (6, "swap_out")]
    labels = dict(zip(zip(m.step, m.kind), m.label))
    assert labels[(2, "cow")] == "3 copy-on-writes (steps 2–3)"  # a run of steps is one moment, counts summed
    assert labels[(3, "prefix_hit")].startswith("first prefix-cache hit: 16 prompt tokens")
    assert labels[(6, "swap_out")] == "3 blocks swapped out (step 6)"  # told as its swap, not also as a preemption
    assert "90%" in labels[(4, "peak")] and "18 used" in labels[(4, "peak")]
    assert story.key_moments(steps.iloc[:0]).empty


def test_key_moments_keep_the_first_few_of_a_kind() -> None:
    steps = _steps(num_block_copies=[1, 0] * 20, kv_cache_usage_perc=[0.5] * 40, num_used_blocks=[5] * 40)
    m = story.key_moments(steps, per_kind=3)
    assert list(m[m.kind == "cow"].step) == [1, 3, 5]


def test_summary_sentences_carry_the_records_numbers() -> None:
    steps = _steps(prefix_cache_queries=[100, 200, 300], prefix_cache_hits=[0, 60, 150],
                   kv_cache_usage_perc=[0.25, 0.75, 0.5], token_usage=[1.0, 0.8, 0.9], num_used_blocks=[1, 3, 2],
                   num_free_blocks=[3, 1, 2], num_finished=[0, 1, 2], num_block_copies=[0, 1, 0],
                   num_preempted=[0, 0, 1])
    req = pd.DataFrame({"ttft_s": [0.2, 0.4, 1.0]})
    text = " ".join(story.summary(steps, req, "engine"))
    assert "3 requests finished in 3 steps, 1,500 ms of step time" in text
    assert "peaked at 75% of 4 blocks at step 2" in text and "90% of their slots" in text
    assert "150 of 300 prompt tokens (50%)" in text
    assert "1 copy-on-write" in text and "1 preemption (recompute)" in text
    assert "median 400 ms, worst 1,000 ms" in text


def _sim_run(num_blocks: int = 48, n: int = 24):
    from paged.sim.simulator import SimConfig
    from paged.sim.workload import synthetic_trace
    return runs.Run(SimConfig(model="llama-2-7b", num_blocks=num_blocks, block_size=16),
                       synthetic_trace("sharegpt", n, rate=16.0, seed=3))


def test_snapshots_stay_within_the_cap_and_keep_the_moments() -> None:
    run = _sim_run().keep_snapshots(1, max_snapshots=20)
    run.run_to_completion()
    assert 2 <= len(run.snapshots) <= 20
    m = story.key_moments(run.steps_frame())
    peak = int(m[m.kind == "peak"].step.iloc[0])
    # the pool near its peak survives thinning: a kept snapshot at most 2% of the pool below the peak
    snap = run.snapshot_at(peak)
    used = int((snap.ref_count > 0).sum())
    assert used >= run.rows[peak - 1]["num_used_blocks"] - 0.02 * snap.num_blocks - 1
    first = min(run.snapshots)
    assert run.snapshot_at(first - 1 if first > 1 else 1).step == first  # before the first: the first one
    with pytest.raises(Exception, match="max_snapshots"):
        run.keep_snapshots(1, max_snapshots=1)


def test_a_step_without_its_own_snapshot_is_shown_and_named_as_the_kept_one() -> None:
    """The status line and the grid name the same step: the snapshot's, not the one asked for."""
    pytest.importorskip("anywidget")
    from paged.viz import live
    run = _sim_run().keep_snapshots(5)  # every 5th step (and the key moments)
    dash = live.Dashboard(run, views=("grid",))
    dash.run_to_completion()
    gap = next(s for s in range(2, len(run.rows)) if s not in run.snapshots)
    dash.show_step(gap)
    kept = run.snapshot_at(gap).step
    assert kept < gap and dash.viewing == kept and f"step {kept} (replayed)" in dash.figures["grid"].layout.title.text


def test_finished_dashboard_tells_its_story_and_reset_clears_it() -> None:
    pytest.importorskip("anywidget")
    from paged.viz import live
    run = _sim_run()
    dash = live.Dashboard(run, views=("grid", "tables", "usage"))
    assert dash.story.player.layout.display == "none"  # nothing to replay yet
    dash.run_to_completion()
    m = dash.story.moments
    peak = int(m[m.kind == "peak"].step.iloc[0])
    assert dash.viewing == peak and "(replayed" in dash.figures["grid"].layout.title.text
    assert dash.story.player.layout.display is None and dash.story.player.max == len(run.rows)
    assert "What happened" in dash.story.summary.value and "finished" in dash.story.summary.value
    fig = dash.story.figure.figure
    assert any(t.name == "peak usage" and len(t.x) == 1 for t in fig.data)
    # a click on a moment shows that step; the tokens panel follows the selection
    dash.story.jump(1)
    assert dash.viewing == 1 and "step 1 (replayed)" in dash.figures["grid"].layout.title.text
    dash.select_block(0)
    assert dash.panel.tokens.value.startswith("<b>block 0</b>")
    dash.reset(num_blocks=64)
    assert dash.viewing is None and dash.panel.tokens.value.startswith("<i>click a block")
    assert dash.story.summary.value == "" and dash.story.player.layout.display == "none"
    assert dash.run is not run and not dash.run.rows and dash.run.snapshot_stride


def test_a_starting_run_brings_its_dashboard_into_view() -> None:
    pytest.importorskip("anywidget")
    from paged.viz import live
    dash = live.Dashboard(_sim_run(n=4), views=("grid",))
    before = dash.anchor.scroll
    dash.run_to_completion()
    assert dash.anchor.scroll == before + 1 and "scrollIntoView" in dash.anchor._esm
