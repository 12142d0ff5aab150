"""Record/replay round trip and the Chrome-trace export, on a small simulated run and a manager."""
import json

import numpy as np

from paged import replay, runs
from paged.sim.simulator import SimConfig
from paged.sim.workload import synthetic_trace


def _run():
    cfg = SimConfig(model="llama-2-7b", num_blocks=48, preemption_mode="swap", max_num_batched_tokens=512)
    run = runs.Run(cfg, synthetic_trace("sharegpt", 12, rate=8.0, seed=1)).keep_snapshots(3)
    return run.run_to_completion()


def test_save_load_round_trip(tmp_path):
    run = _run()
    assert run.snapshots  # kept by the run itself (tests/test_run_snapshots.py: both run kinds, every step)
    p = replay.save(run, tmp_path / "r.npz")
    rec = replay.load(p)
    assert len(rec.rows) == len(run.rows)
    assert all(np.isclose(a[c], b[c]) for a, b in zip(rec.rows, run.rows) for c in runs.STEP_COLUMNS)
    assert [tuple(e) for e in rec.events] == [tuple(e) for e in run.events]
    assert len(rec.request_rows()) == len(run.request_rows())
    k = rec.snapshot_steps[-1]
    a, b = rec.snapshot(k), run.snapshots[k]
    assert np.array_equal(a.state, b.state) and a.request_ids == b.request_ids
    assert np.array_equal(a.table_blocks, b.table_blocks)
    again = replay.load(replay.save(rec, tmp_path / "r2.npz"))
    assert again.rows == rec.rows and [tuple(e) for e in again.events] == [tuple(e) for e in rec.events]


def test_chrome_trace_structure(tmp_path):
    run = _run()
    p = replay.to_chrome_trace(run, tmp_path / "t.json")
    doc = json.loads(p.read_text())
    evs = doc["traceEvents"]
    assert {"M", "X", "C"} <= {e["ph"] for e in evs}
    for e in evs:
        assert isinstance(e["pid"], int) and isinstance(e["name"], str)
        if e["ph"] in ("X", "C", "i"):
            assert e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] > 0
    steps = [e for e in evs if e["ph"] == "X" and e["cat"] == "step"]
    assert len(steps) == len(run.rows)
    phases = {e["name"] for e in evs if e.get("cat") == "request"}
    assert {"prefill", "decode"} <= phases
