"""paged.studies.compaction (the measurements behind benchmarks/compaction.py, small shapes; the
simulated cost; a before/after pass) and its figure (paged.viz.compaction)."""
from __future__ import annotations

import numpy as np
import pytest

from paged.studies.compaction import compaction_snapshots, runs_frame
from paged.viz.compaction import compaction_grids


def test_before_after_snapshots_hold_the_same_requests_and_the_figure_draws_both():
    demo = compaction_snapshots(steps=30)
    b, a = demo.before, demo.after
    assert b.request_ids == a.request_ids and demo.plan.num_copies > 0
    assert sorted(b.ref_count.tolist()) == sorted(a.ref_count.tolist())
    assert sorted(b.filled.tolist()) == sorted(a.filled.tolist())
    assert np.array_equal(np.diff(b.table_indptr), np.diff(a.table_indptr))
    runs = runs_frame(demo)
    assert (runs["runs_after"] <= runs["runs_before"]).all()
    assert int((runs["runs_after"] > 1).sum()) == demo.plan.num_skipped
    fig = compaction_grids(demo)
    heat = [t for t in fig.data if t.type == "heatmap"]
    assert len(heat) == 2 and heat[0].z != heat[1].z


def test_measurement_functions_return_their_tables():
    from paged.studies.compaction import copy_table, read_table, verdict
    reads = read_table((32, 64), (16,), batch=2, rounds=1, gpu=False)
    assert len(reads) == 2 and (reads["slots_ratio"] > 0).all()
    copies = copy_table(16, 300, threshold=0.0, interval=4, layers=1)
    assert bool(copies["same_schedule"][0]) and copies["passes"][0] > 0
    v = verdict(reads, copies)
    assert v["pass_ms"] > 0 and isinstance(v["pays"], bool)


def test_engine_table_runs_both_ways(tmp_path):
    pytest.importorskip("transformers")
    from paged.studies.compaction import engine_table
    from paged.models import load_model
    from paged.models.testing import make_tiny_checkpoint
    model = load_model(make_tiny_checkpoint(tmp_path, "llama", num_heads=4, num_kv_heads=2, head_dim=16))
    e = engine_table(model, requests=3, max_tokens=24, num_blocks=60, interval=1, threshold=0.0, repeats=1)
    assert bool(e["identical"][0]) and e["copies"][0] > 0


def test_simulated_compaction_costs_only_copies():
    from paged.studies.compaction import compaction_sim_table
    t = compaction_sim_table(60)
    off, on = t.iloc[0], t.iloc[1]
    assert off["copies"] == 0 and on["copies"] > 0 and on["gib_copied"] > 0
    assert on["sim_seconds"] >= off["sim_seconds"]                # same schedule here: the copies only add time


def test_contiguous_allocators_have_nothing_to_compact():
    import pandas as pd

    from paged.sim.simulator import SimConfig, simulate
    trace = pd.DataFrame([dict(arrival_time=0.0, prompt_tokens=50 + 9 * i, output_tokens=40) for i in range(12)])
    r = simulate(trace, SimConfig(model="llama-2-7b", num_blocks=400, allocator="contiguous-max",
                                  enable_block_compaction=True, compaction_threshold=0.0, compaction_interval=1))
    assert r.steps["num_compaction_copies"].sum() == 0
