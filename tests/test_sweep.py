"""paged.sweeps without Ray: grids, the point store, the local backend, resume, errors, the CLI.

(Ray: tests/test_sweep_ray.py.)"""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import paged
from paged.errors import ConfigError
from paged.sweeps import (META, STUDIES, PointStore, Range, Study, expand, get_study, latin_hypercube, pareto_front,
                          random_sample, sweep)
from paged.sweeps.registry import signature_of
from paged.sweeps.store import read_rows

sys.path.insert(0, str(Path(__file__).parent))
import sweep_helpers as H  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VOLATILE = ["wall_s", "cpu_s", "host", "pid", "node", "backend", "cached"]


def results_only(df: pd.DataFrame) -> pd.DataFrame:
    return df.drop(columns=VOLATILE).reset_index(drop=True)


# ---- grids ---------------------------------------------------------------------------------

def test_dict_of_lists_is_the_product_in_key_order_with_fixed_scalars():
    pts = expand({"model": "m", "a": [1, 2], "b": ("x", "y", "z"), "c": np.int64(3)})
    assert len(pts) == 6
    assert pts[0] == {"model": "m", "a": 1, "b": "x", "c": 3} and pts[1]["b"] == "y" and pts[3]["a"] == 2
    assert type(pts[0]["c"]) is int  # numpy scalars become Python numbers


def test_list_of_dicts_as_given_and_repeats_kept_once():
    assert expand([{"a": 1}, {"a": 2, "b": 0}, {"a": 1}]) == [{"a": 1}, {"a": 2, "b": 0}]
    assert expand({"a": [1, 1, 2]}) == [{"a": 1}, {"a": 2}]


@pytest.mark.parametrize("bad, what", [({"a": []}, "empty"), ([{"a": 1}, 3], r"grid\[1\] is int"), ("a=1", "dict of lists"),
                                       ({"": [1]}, "non-empty strings")])
def test_bad_grids_say_what_to_change(bad, what):
    with pytest.raises(ConfigError, match=what):
        expand(bad)


def test_latin_hypercube_puts_one_point_in_every_stratum():
    n = 40
    pts = latin_hypercube({"rate": Range(0.5, 16, log=True), "frac": Range(0.0, 1.0),
                           "fmt": ["fp16", "fp8", "int4", "int8"], "model": "m"}, n, seed=3)
    assert len(pts) == n and all(p["model"] == "m" for p in pts)
    frac = np.array([p["frac"] for p in pts])
    assert sorted(np.floor(frac * n).astype(int)) == list(range(n))  # each of the n strata exactly once
    u = (np.log([p["rate"] for p in pts]) - math.log(0.5)) / (math.log(16) - math.log(0.5))
    assert sorted(np.floor(u * n).astype(int)) == list(range(n))
    counts = pd.Series([p["fmt"] for p in pts]).value_counts()
    assert set(counts.index) == {"fp16", "fp8", "int4", "int8"} and counts.max() - counts.min() <= 2
    assert latin_hypercube({"frac": Range(0, 1)}, 5, seed=3) == latin_hypercube({"frac": Range(0, 1)}, 5, seed=3)
    assert latin_hypercube({"frac": Range(0, 1)}, 5, seed=3) != latin_hypercube({"frac": Range(0, 1)}, 5, seed=4)


def test_random_sample_and_integer_ranges():
    pts = random_sample({"block_size": Range(1, 4, integer=True), "x": [True, False]}, 200, seed=0)
    sizes = {p["block_size"] for p in pts}
    assert sizes == {1, 2, 3, 4} and all(type(p["block_size"]) is int for p in pts)
    assert len(pts) == 8  # 4 x 2 distinct points; repeats kept once
    with pytest.raises(ConfigError, match="low <= high"):
        Range(2, 1)
    with pytest.raises(ConfigError, match="low > 0"):
        Range(0, 1, log=True)
    with pytest.raises(ConfigError, match="integer >= 1"):
        latin_hypercube({"x": Range(0, 1)}, 0)


# ---- the point store ---------------------------------------------------------------------

def test_store_round_trip_is_exact(tmp_path):
    st = PointStore(tmp_path, get_study(H.square))
    rows = [{"a": 1, "f": 0.1, "nan": float("nan"), "none": None, "s": "x", "b": True, "l": [1, 2], "d": {"k": 1},
             "mixed": 1, "status": "ok", "cached": False},
            {"a": 2, "f": float("inf"), "nan": 1.0, "none": None, "s": None, "b": False, "l": [], "d": {},
             "mixed": "two", "status": "ok", "cached": False, "extra": 5}]
    st.save("k1", rows, {"x": 1})
    back = st.load("k1")
    assert [p.name for p in (tmp_path / st.study.name).iterdir()] == ["k1.parquet"]  # no temporary left
    for got, want in zip(back, rows):
        want = {**{k: None for k in ("extra",)}, **want, "cached": True}
        assert set(got) == set(want)
        for k, v in want.items():
            g = got[k]
            assert (isinstance(v, float) and math.isnan(v) and math.isnan(g)) or (g == v and type(g) is type(v)), k


def test_store_key_covers_study_params_version_and_file_contents(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("a\n1\n")
    sim = PointStore(tmp_path, STUDIES["simulate"])
    k = sim.key({"block_size": 16, "trace": str(trace)})
    assert k == PointStore(tmp_path, STUDIES["simulate"]).key({"trace": str(trace), "block_size": 16})
    assert k != sim.key({"block_size": 32, "trace": str(trace)})
    assert k != PointStore(tmp_path, STUDIES["simulate"], version="other").key({"block_size": 16, "trace": str(trace)})
    trace.write_text("a\n2\n")
    assert k != PointStore(tmp_path, STUDIES["simulate"]).key({"block_size": 16, "trace": str(trace)})
    moved = Study("simulate", "elsewhere.module:run_point", call="point", files=("trace",))
    assert PointStore(tmp_path, moved).key({"block_size": 16}) == sim.key({"block_size": 16})  # target not in key
    assert PointStore(tmp_path, get_study("quant")).key({}) != PointStore(
        tmp_path, Study("quant", "paged.quant.study:study")).key({})  # fixed defaults are


# ---- the registry ------------------------------------------------------------------------

def test_every_registered_study_imports_and_takes_its_parameters():
    for name, s in STUDIES.items():
        sig = signature_of(s)
        params = list(sig.parameters.values())
        if s.call == "point":
            assert len([p for p in params if p.default is p.empty]) == 1, name
        for k in s.defaults:
            assert k in sig.parameters, (name, k)
        assert s.num_cpus >= 1 and s.doc, name


def test_unknown_studies_and_lambdas_are_refused():
    with pytest.raises(ConfigError, match="unknown study 'simulat'.*simulate"):
        sweep("simulat", {"a": [1]}, store=False, progress=False)
    with pytest.raises(ConfigError, match="top level of a module"):
        get_study(lambda x: x)
    with pytest.raises(ConfigError, match="module:function"):
        Study("x", "no_colon")
    with pytest.raises(ConfigError, match="backend must be"):
        sweep(H.square, {"x": [1]}, backend="dask", store=False, progress=False)
    with pytest.raises(ConfigError, match="for backend='ray'"):
        sweep(H.square, {"x": [1]}, address="auto", store=False, progress=False)
    with pytest.raises(ConfigError, match="jobs must be"):
        sweep(H.square, {"x": [1]}, jobs=0, store=False, progress=False)


# ---- sweeps on the local backend ----------------------------------------------------------

def test_invalid_points_carry_their_error_and_the_others_complete(tmp_path):
    grid = [{**H.SIM_BASE, "block_size": 16}, {**H.SIM_BASE, "block_size": 0},
            {**H.SIM_BASE, "model": "llama-2-70b", "gpu": "a100-40gb"}, {**H.SIM_BASE, "block_size": 32}]
    df = sweep("simulate", grid, store=tmp_path, progress=False)
    assert list(df["status"]) == ["ok", "error", "error", "ok"]
    assert df.loc[1, "error"].startswith("ConfigError: block_size") and "got 0" in df.loc[1, "error"]
    assert "SizingError" in df.loc[2, "error"] and "raise tensor_parallel" in df.loc[2, "error"]
    assert (df.loc[[0, 3], "requests_finished"] == H.SIM_BASE["num_requests"]).all()
    assert df.loc[[0, 3], "error"].isna().all() and df.attrs["sweep"]["errors"] == 2
    assert list(df.columns[-len(META):]) == list(META) and list(df.columns[:5]) == list(grid[0])
    assert "wall_s" not in set(df.columns) - set(META)  # the simulator's own timing is dropped
    again = sweep("simulate", grid, store=tmp_path, progress=False)
    assert again.attrs["sweep"]["computed"] == 0  # errors are stored too
    retried = sweep("simulate", grid, store=tmp_path, progress=False, retry_errors=True)
    assert retried.attrs["sweep"]["computed"] == 2


def test_a_retried_point_replaces_its_stored_error_row(tmp_path):
    """retry_errors recomputes a stored error and the table holds the new rows instead: 2 points, 2 rows."""
    grid = {"x": [1, 2], "marker_dir": str(tmp_path)}
    store = tmp_path / "store"
    first = sweep(H.broken_until_fixed, grid, store=store, progress=False)
    assert list(first["status"]) == ["ok", "error"] and first.loc[1, "error"].startswith("RuntimeError: not fixed yet")
    (tmp_path / "fixed").write_text("")
    retried = sweep(H.broken_until_fixed, grid, store=store, progress=False, retry_errors=True)
    assert retried.attrs["sweep"]["computed"] == 1 and retried.attrs["sweep"]["errors"] == 0
    assert len(retried) == 2 and list(retried["x"]) == [1, 2] and list(retried["y"]) == [10, 20]
    assert list(retried["status"]) == ["ok", "ok"] and retried["error"].isna().all()
    assert list(retried["point"]) == list(first["point"]) and retried["point"].is_unique
    again = sweep(H.broken_until_fixed, grid, store=store, progress=False)  # the store holds the retried rows
    assert again.attrs["sweep"]["computed"] == 0 and list(again["y"]) == [10, 20] and len(again) == 2


def test_study_results_a_dataframe_collisions_and_plain_functions(tmp_path):
    df = sweep(H.table, {"n": [1, 3]}, store=tmp_path, progress=False)
    assert list(df["n"]) == [1, 3, 3, 3] and list(df["row"]) == [0, 0, 1, 2] and list(df["i"]) == [0, 0, 1, 2]
    assert df.attrs["sweep"]["points"] == 2 and len(set(df["point"])) == 2
    df = sweep(H.echo_meta, {"x": [1]}, store=False, progress=False)
    assert df.loc[0, "result_status"] == "study-status" and df.loc[0, "status"] == "ok"
    assert df.loc[0, "result_x"] == 2 and df.loc[0, "x"] == 1 and df.loc[0, "result_wall_s"] == 123.0
    df = sweep(H.square, {"x": [2, -1]}, store=False, progress=False)
    assert df.loc[0, "y"] == 4 and df.loc[1, "error"] == "ValueError: x must be >= 0, got -1"
    assert df["point"].isna().all()  # no store, no key


def test_a_registered_paper_study_sweeps_by_name(tmp_path):
    df = sweep("interference", {"num_requests": 20, "budgets": [(256,)], "rate": [2.0, 8.0]}, store=tmp_path,
               progress=False)
    assert list(df["rate"]) == [2.0, 2.0, 8.0, 8.0] and list(df["row"]) == [0, 1, 0, 1]
    assert list(df["chunked_prefill"]) == ["none", "256"] * 2 and (df["status"] == "ok").all()
    assert df["tbt_p99_ms"].gt(0).all() and df.attrs["sweep"]["points"] == 2


def test_local_processes_give_the_serial_results(tmp_path):
    grid = {**H.SIM_BASE, "rate": [2.0, 8.0], "block_size": [8, 32], "kv_cache_dtype": ["fp16", "fp8"]}
    one = sweep("simulate", grid, store=tmp_path / "a", progress=False)
    two = sweep("simulate", grid, jobs=2, store=tmp_path / "b", progress=False)
    pd.testing.assert_frame_equal(results_only(one), results_only(two))
    assert (one["status"] == "ok").all() and two["pid"].nunique() >= 1


def test_interrupted_sweep_resumes_with_only_the_missing_points(tmp_path):
    grid = {**H.SIM_BASE, "rate": [2.0, 8.0], "block_size": [8, 16, 32], "max_num_batched_tokens": [512, 2048]}
    full = sweep("simulate", grid, store=tmp_path / "full", progress=False)
    seen = []

    def stop_after_5(rows):
        seen.append(rows)
        if len(seen) == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        sweep("simulate", grid, store=tmp_path / "cut", progress=False, on_result=stop_after_5)
    assert len(list((tmp_path / "cut" / "simulate").glob("*.parquet"))) == 5
    arrived = []
    resumed = sweep("simulate", grid, store=tmp_path / "cut", progress=False, on_result=arrived.append)
    info = resumed.attrs["sweep"]
    assert (info["points"], info["cached"], info["computed"]) == (12, 5, 7)
    assert int(resumed["cached"].sum()) == 5 and len(arrived) == 12  # stored points are shown too
    pd.testing.assert_frame_equal(results_only(resumed), results_only(full))
    forced = sweep("simulate", grid, store=tmp_path / "cut", progress=False, force=True)
    assert forced.attrs["sweep"]["computed"] == 12 and not forced["cached"].any()


def test_killed_driver_resumes_with_only_the_missing_points(tmp_path):
    store = tmp_path / "store"
    grid = {**H.SIM_BASE, "num_requests": 48, "rate": [4.0, 16.0], "block_size": [8, 16, 32],
            "kv_cache_dtype": ["fp16", "fp8"]}
    script = textwrap.dedent(f"""
        import paged
        paged.sweep("simulate", {grid!r}, store={str(store)!r}, progress=False)
    """).replace("inf", "float('inf')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env)
    folder = store / "simulate"
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and len(list(folder.glob("*.parquet"))) < 3 and proc.poll() is None:
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    done = len(list(folder.glob("*.parquet")))
    assert proc.returncode == -signal.SIGKILL and 3 <= done < 12, done
    assert all(read_rows(p)[0]["status"] == "ok" for p in folder.glob("*.parquet"))  # whole files only
    resumed = sweep("simulate", grid, store=store, progress=False)
    assert resumed.attrs["sweep"]["computed"] == 12 - done and int(resumed["cached"].sum()) == done
    fresh = sweep("simulate", grid, store=False, progress=False)
    pd.testing.assert_frame_equal(results_only(resumed).drop(columns="point"), results_only(fresh).drop(columns="point"))


def test_a_dead_local_worker_is_lost_not_stored_and_computed_on_the_next_run(tmp_path):
    marker = tmp_path / "markers"
    marker.mkdir()
    grid = {"x": [1, 2, 3, 4], "marker_dir": str(marker), "victim": 3}
    df = sweep(H.die_once, grid, jobs=2, store=tmp_path / "s", progress=False)
    assert (marker / "killed-3").exists()
    lost = df[df["status"] == "lost"]
    assert 3 in set(lost["x"]) and lost["error"].str.contains("worker process died").all()
    again = sweep(H.die_once, grid, jobs=2, store=tmp_path / "s", progress=False)
    assert (again["status"] == "ok").all() and again.attrs["sweep"]["computed"] == len(lost)
    assert list(again["y"]) == [10, 20, 30, 40]


def test_the_store_without_pyarrow_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(ConfigError, match="pip install pyarrow.*store=False"):
        sweep(H.square, {"x": [1]}, store=tmp_path, progress=False)
    assert sweep(H.square, {"x": [1]}, store=False, progress=False).loc[0, "y"] == 1


def test_stored_points_load_without_the_grid(tmp_path):
    sweep(H.square, {"x": [1, 2]}, store=tmp_path, progress=False)
    df = paged.sweeps.load(H.square, tmp_path)
    assert sorted(df["y"]) == [1, 4] and df["cached"].all()
    assert read_rows(next((tmp_path / get_study(H.square).name).glob("*.parquet")))[0]["status"] == "ok"
    with pytest.raises(ConfigError, match="no stored points"):
        paged.sweeps.load("simulate", tmp_path / "nothing")


def test_pareto_front():
    df = pd.DataFrame({"tp": [10, 8, 12, 12, 5, np.nan], "p99": [1.0, 0.5, 2.0, 3.0, 0.5, 0.1],
                       "status": ["ok", "ok", "ok", "ok", "ok", "ok"]})
    front = pareto_front(df, maximize=["tp"], minimize=["p99"])
    assert list(front) == [True, True, True, False, False, False]
    df.loc[1, "status"] = "error"
    assert list(pareto_front(df, maximize=["tp"], minimize=["p99"])) == [True, False, True, False, True, False]
    with pytest.raises(ConfigError, match="no column"):
        pareto_front(df, maximize=["nope"])


# ---- the command line and the import cost ----------------------------------------------

def test_cli_sweep_goes_through_the_store_and_resumes(tmp_path, capsys):
    from paged.cli import main

    out = tmp_path / "s.csv"
    args = ["sweep", "--model", "llama-2-7b", "--gpu", "a100-40gb", "--max-model-len", "1024", "-n", "20",
            "--grid", "block_size=0,16", "--out", str(out), "-j", "1"]
    assert main(args) == 0
    text = capsys.readouterr()
    assert "0 from" in text.out and "1 failed" in text.out and "ConfigError: block_size" in text.err
    assert (tmp_path / "s.points" / "simulate").is_dir()
    assert main(args) == 0 and "2 from" in capsys.readouterr().out
    assert main(args + ["--force"]) == 0 and "0 from" in capsys.readouterr().out
    assert main(args + ["--no-store", "--out", str(tmp_path / "t.csv")]) == 0 and "from None" in capsys.readouterr().out
    df = pd.read_csv(out)
    assert list(df["status"]) == ["error", "ok"] and df.loc[1, "requests_finished"] == 20


def test_import_and_local_sweeps_do_not_import_ray():
    code = ("import sys, paged; from paged.sweeps import sweep; "
            "sweep('simulate', {'num_requests': 5, 'model': 'llama-2-7b'}, store=False, progress=False); "
            "print('ray' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr
