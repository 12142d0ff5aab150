"""paged.sweep on Ray: one embedded local instance (2 CPUs) for the whole module, files in /tmp.

Ray is part of `make test`'s install (the [ray] extra); its workers import tests/sweep_helpers.py
by name (tests/ is put on their path when the instance starts)."""
from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest

from paged.sweeps import sweep
from paged.sweeps.backends import start_local_ray

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import sweep_helpers as H  # noqa: E402

ray = pytest.importorskip("ray", reason="Ray is the [ray] extra: pip install 'paged-kv-workbench[ray]'")
VOLATILE = ["wall_s", "cpu_s", "host", "pid", "node", "backend", "cached", "point"]


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    if ray.is_initialized():  # pragma: no cover - another module left one running
        ray.shutdown()
    assert start_local_ray(num_cpus=2, temp_dir="/tmp/paged-ray-tests", paths=[str(HERE)], log_to_driver=False)
    yield
    ray.shutdown()


def _sorted(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    return df.drop(columns=VOLATILE).sort_values(keys).reset_index(drop=True)


def test_48_point_simulator_sweep_on_ray_equals_local(tmp_path):
    grid = H.sim_grid_48()
    on_ray = sweep("simulate", grid, backend="ray", store=tmp_path / "ray", progress=False)
    local = sweep("simulate", grid, store=tmp_path / "local", progress=False)
    assert len(on_ray) == len(local) == 48 and (on_ray["status"] == "ok").all()
    assert (on_ray["backend"] == "ray").all() and on_ray["node"].nunique() == 1 and on_ray["node"].iloc[0] != "vm"
    assert on_ray["pid"].nunique() >= 2  # two worker processes shared the points
    keys = ["rate", "block_size", "max_num_batched_tokens", "kv_cache_dtype"]
    # shuffled: order-independent, and the rows still match number for number
    pd.testing.assert_frame_equal(_sorted(on_ray.sample(frac=1, random_state=0), keys), _sorted(local, keys))
    assert sorted(on_ray["point"]) == sorted(local["point"])  # the same keys: either store resumes the other


def test_a_killed_worker_is_retried_and_its_point_appears_once(tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    grid = {"x": list(range(8)), "marker_dir": str(markers), "victim": 3}
    df = sweep(H.die_once, grid, backend="ray", store=tmp_path / "s", progress=False)
    killed = int((markers / "killed-3").read_text())  # the first attempt ran, in this worker, and killed it
    assert list(df["x"]) == list(range(8)) and (df["status"] == "ok").all()
    assert list(df["y"]) == [10 * x for x in range(8)]
    assert df.loc[df["x"] == 3, "pid_seen"].item() != killed  # the retry ran in a fresh worker
    assert len(list((tmp_path / "s").rglob("*.parquet"))) == 8


def test_invalid_points_on_ray_carry_their_error(tmp_path):
    grid = [{**H.SIM_BASE, "block_size": 0}, {**H.SIM_BASE, "model": "llama-2-70b", "gpu": "a100-40gb"},
            {**H.SIM_BASE, "block_size": 16}]
    df = sweep("simulate", grid, backend="ray", store=False, progress=False)
    assert list(df["status"]) == ["error", "error", "ok"]
    assert "block_size" in df.loc[0, "error"] and "raise tensor_parallel" in df.loc[1, "error"]


def test_interrupted_ray_sweep_resumes_with_only_the_missing_points(tmp_path):
    grid = {"x": list(range(10)), "delay": 0.05}
    seen = []

    def stop_after_4(rows):
        seen.append(rows)
        if len(seen) == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        sweep(H.slow, grid, backend="ray", store=tmp_path, progress=False, on_result=stop_after_4)
    stored = len(list(tmp_path.rglob("*.parquet")))
    assert stored == 4
    df = sweep(H.slow, grid, backend="ray", store=tmp_path, progress=False)
    assert df.attrs["sweep"]["computed"] == 6 and list(df["y"]) == list(range(1, 11))


def test_cli_sweep_on_ray(tmp_path, capsys):
    from paged.cli import main

    out = tmp_path / "s.csv"
    assert main(["sweep", "--model", "llama-2-7b", "--gpu", "a100-40gb", "--max-model-len", "1024", "-n", "20",
                 "--grid", "block_size=8,16", "--backend", "ray", "--out", str(out)]) == 0
    df = pd.read_csv(out)
    assert list(df["block_size"]) == [8, 16] and (df["backend"] == "ray").all() and (df["status"] == "ok").all()


def test_benchmark_runs_small(capsys):
    """benchmarks/sweep.py at toy size on this module's instance, so the script cannot rot."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_sweep", HERE.parent / "benchmarks" / "sweep.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--quick", "-n", "8", "--skip-processes"]) == 0
    out = capsys.readouterr().out
    assert "Ray table identical to serial (all result columns, order-independent): yes" in out
    assert "sweep overhead per point, Ray" in out and ray.is_initialized()  # the module's instance is left up
