"""Kept snapshots of both run kinds (``paged.runs``) are the cache right after the step they are
filed under, and survive a save/load round trip without any snapshot added by hand.

``keep_snapshots(k)`` files a snapshot under ``len(rows)`` after every k-th step; a replay slider
shows ``snapshots[s]`` beside step row ``s``, so a snapshot one step early or late would show a
grid that disagrees with the row next to it.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from paged import replay, runs, story
from paged.core import snapshot as S
from paged.engine import SamplingParams
from paged.sim.simulator import SimConfig
from paged.sim.workload import synthetic_trace


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    pytest.importorskip("transformers")
    import paged
    from paged.models.testing import make_tiny_checkpoint
    d = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama")
    return paged.LLM(d, num_blocks=12, block_size=4, dtype="float32", device="cpu")


def _workload():
    shared = list(range(10, 22))
    return [runs.EngineRequest("a", shared + [1], SamplingParams(max_tokens=6, ignore_eos=True), 1),
            runs.EngineRequest("b", shared + [2], SamplingParams(max_tokens=5, ignore_eos=True), 2),
            runs.EngineRequest("c", list(range(40, 58)), SamplingParams(max_tokens=4, ignore_eos=True), 4)]


def _sim_run():
    cfg = SimConfig(model="llama-2-7b", num_blocks=48, preemption_mode="swap", max_num_batched_tokens=512)
    return runs.Run(cfg, synthetic_trace("sharegpt", 8, rate=8.0, seed=1))


def _assert_same(a: S.KVSnapshot, b: S.KVSnapshot) -> None:
    for f in dataclasses.fields(S.KVSnapshot):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            assert np.array_equal(x, y), f.name
        else:
            assert x == y, f.name


def _written_by_last_step(run) -> set[int]:
    """Blocks holding the positions the last engine step computed, from its chunks."""
    kv, bs = run.kv, run.kv.block_size
    out = set()
    for c in run.last_output.scheduled:
        if c.num_tokens and kv.has(c.request_id):
            out.update(kv.block_table(c.request_id)[c.start // bs:(c.start + c.num_tokens - 1) // bs + 1])
    return out


@pytest.mark.parametrize("kind", ["engine", "simulator"])
def test_each_kept_snapshot_is_the_cache_after_its_step(kind, request):
    run = runs.Run(request.getfixturevalue("llm"), _workload()) if kind == "engine" else _sim_run()
    run.keep_snapshots(1)
    seen = marked = 0
    while not run.done:
        if run.step() is None:   # a Run's extra call past the end of its trace
            break
        k = len(run.rows)
        assert sorted(run.snapshots) == list(range(1, k + 1))   # one per step so far, none ahead
        kept = run.snapshots[k]
        assert kept.step == k
        _assert_same(kept, run.snapshot())                        # taken after step k, not before
        if kind == "engine":
            writing = set(np.flatnonzero(kept.state == S.STATE_WRITING).tolist())
            assert writing <= _written_by_last_step(run), k   # this step's writes, not the previous one's
            marked += bool(writing)
        seen += 1
    assert seen == len(run.rows) >= 5
    assert kind == "simulator" or marked >= seen // 2


def test_stride_files_snapshots_under_their_step(llm):
    run = runs.Run(llm, _workload()).keep_snapshots(3)
    run.run_to_completion()
    strided = set(range(3, len(run.rows) + 1, 3))
    moments = set(story.key_moments(run.steps_frame()).step)
    # every 3rd step, plus the steps with a key moment (kept for the story of the run), nothing else
    assert strided <= set(run.snapshots) and set(run.snapshots) - strided <= moments | _new_peaks(run)
    assert all(s.step == k for k, s in run.snapshots.items())


def _new_peaks(run) -> set[int]:
    """Steps whose block usage beat every earlier step's (each was the peak when it ran)."""
    best, out = 0.0, set()
    for i, r in enumerate(run.rows, 1):
        if r["kv_cache_usage_perc"] > best:
            best = r["kv_cache_usage_perc"]
            out.add(i)
    return out


@pytest.mark.parametrize("kind", ["engine", "simulator"])
def test_replay_round_trip_keeps_every_snapshot(kind, request, tmp_path):
    run = runs.Run(request.getfixturevalue("llm"), _workload()) if kind == "engine" else _sim_run()
    run.keep_snapshots(2).run_to_completion()
    assert run.snapshots, "keep_snapshots(2) kept none"   # none is added by hand here
    rec = replay.load(replay.save(run, tmp_path / "run.npz"))
    assert rec.snapshot_steps == sorted(run.snapshots) and set(range(2, len(run.rows) + 1, 2)) <= set(run.snapshots)
    for k in rec.snapshot_steps:
        a, b = rec.snapshot(k), run.snapshots[k]
        assert a.step == b.step == k
        for name in ("state", "ref_count", "owner", "logical", "filled", "table_indptr", "table_blocks"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), (k, name)
        assert a.request_ids == b.request_ids
    assert rec.snapshot(3).step == 2   # a slider between kept steps shows the last one before it
