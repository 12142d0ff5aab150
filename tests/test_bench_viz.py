"""benchmarks/viz.py part 1 runs on a small pool and reports every column."""
import importlib.util
from pathlib import Path


def test_snapshot_table_small():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "viz.py"
    spec = importlib.util.spec_from_file_location("bench_viz", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    df = mod.snapshot_table(sizes=(256,), repeats=1)
    assert list(df.index) == [256] and (df[["snapshot_ms", "frame_grid_only_ms"]] > 0).all(axis=None)
