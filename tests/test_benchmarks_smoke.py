"""Smoke test of benchmarks/kv_manager.py: every benchmark runs on tiny sizes (well under 3 s),
so the script cannot rot when the core changes."""
import importlib.util
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_kv_manager", ROOT / "benchmarks" / "kv_manager.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up while the class is built
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


def test_every_benchmark_runs_small(bench, tmp_path):
    sizes, batches = [256, 1024], [2, 8]
    rows = bench.run(sizes, batches, rounds=2, work_blocks=256, req_steps=64, segment=256)
    cases = {case for _, case in rows}
    for expected in ("pool: plain free list", "kv: allocate_slots+free, plain free list",
                     "hit: find+allocate_slots+free, sha256", "  of which hashing (builtin)",
                     "schedule+update, µs / request (Recorder)"):
        assert expected in cases
    for row in rows.values():
        cols = batches if row.section.startswith("3") else sizes
        for c in cols:
            assert c in row.samples, (row.case, c)
            assert math.isfinite(row.min(c)), (row.case, c)
            if not row.case.startswith("  excluding"):  # a difference of two noisy runs
                assert row.min(c) > 0, (row.case, c)
    table = bench.format_table(rows, sizes, batches)
    assert "1k" not in table and "1024/256" in table and "8/2" in table
    path = tmp_path / "bench.csv"
    bench.write_csv(rows, str(path))
    assert path.read_text().startswith("section,case,unit,size,median,min,rounds")


def test_quick_command_line(bench, capsys):
    assert bench.main(["--quick", "--gc", "off"]) == 0
    out = capsys.readouterr().out
    assert "prefix hit / block" in out and "scheduler step" in out
