"""CLI and simulator input: one-line errors naming the knob the user set, no silent nonsense."""
from __future__ import annotations

import pytest

from paged.cli import main

SMALL = ["--model", "llama-2-7b", "--gpu", "a100-40gb", "--max-model-len", "1024"]


def _error(capsys, args, *needles) -> str:
    rc = main(args)
    err = capsys.readouterr().err.strip()
    assert rc == 2, (rc, err)
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)
    return err


@pytest.fixture
def csv(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("arrival_time,prompt_tokens,output_tokens\n0,10,5\n0.5,20,3\n1.0,30,2\n")
    return f


# ---- item 4: silently wrong simulations ---------------------------------------------------
def test_negative_step_overhead_is_an_error(capsys):
    _error(capsys, ["simulate", *SMALL, "-n", "5", "--step-overhead-s", "-1"], "step_overhead_s")


@pytest.mark.parametrize("n", ["0", "-1", "-5"])
def test_num_requests_must_be_positive(capsys, csv, n):
    """-n 0 ran 1000 requests; --trace f -n -1 dropped the last row; -n -5 ran nothing."""
    _error(capsys, ["simulate", *SMALL, "-n", n], "--num-requests")
    _error(capsys, ["simulate", *SMALL, "--trace", str(csv), "-n", n], "--num-requests")


def test_header_only_csv_is_an_error(capsys, tmp_path):
    f = tmp_path / "h.csv"
    f.write_text("arrival_time,prompt_tokens,output_tokens\n")
    _error(capsys, ["simulate", *SMALL, "--trace", str(f)], "h.csv", "no requests")


def test_demo_needs_requests(capsys, tmp_path):
    _error(capsys, ["demo", "--out", str(tmp_path / "r"), "-n", "0", "--engine-requests", "0"], "--num-requests")


@pytest.mark.parametrize("value, needle", [("100000", "4096"), ("0", "max_model_len"), ("-3", "max_model_len")])
def test_max_model_len_beyond_the_model_or_not_positive(capsys, value, needle):
    _error(capsys, ["simulate", "--model", "llama-2-13b", "--max-model-len", value, "-n", "3"], needle)


def test_nanosecond_arrival_times_are_rejected(capsys, tmp_path):
    """1.7e18 s arrival times leave no float resolution for step times (every TTFT was 0)."""
    f = tmp_path / "ns.csv"
    f.write_text("arrival_time,prompt_tokens,output_tokens\n1.7e18,10,5\n1.7000000001e18,10,5\n")
    _error(capsys, ["simulate", *SMALL, "--trace", str(f)], "ns.csv", "row 2", "arrival_time", "seconds")


# ---- item 5: one-line errors, not tracebacks ---------------------------------------------
def test_empty_trace_file_and_directory(capsys, tmp_path):
    f = tmp_path / "empty.csv"
    f.write_text("")
    _error(capsys, ["simulate", *SMALL, "--trace", str(f)], "empty.csv")
    _error(capsys, ["simulate", *SMALL, "--trace", str(tmp_path)], "directory")


def test_calibration_missing_or_empty(capsys, tmp_path):
    _error(capsys, ["simulate", *SMALL, "-n", "3", "--calibration", str(tmp_path / "nope.csv")], "nope.csv")
    f = tmp_path / "empty.csv"
    f.write_text("")
    _error(capsys, ["simulate", *SMALL, "-n", "3", "--calibration", str(f)], "empty.csv")


def test_output_folders_are_checked_before_running(capsys, tmp_path, monkeypatch):
    import paged.sim.simulator as simulator

    def no_run(*a, **k):
        raise AssertionError("ran before checking the output path")
    monkeypatch.setattr(simulator.Simulator, "run", no_run)
    monkeypatch.setattr(simulator.Simulator, "iter_steps", no_run)
    for flag in ("--requests-out", "--steps-out"):
        _error(capsys, ["simulate", *SMALL, "-n", "3", flag, str(tmp_path / "missing" / "r.csv")], flag, "missing")


def test_sweep_grid_values_are_checked(capsys, tmp_path):
    _error(capsys, ["sweep", *SMALL, "--grid", "rate=abc", "--out", str(tmp_path / "s.csv")], "rate", "abc")
    _error(capsys, ["sweep", *SMALL, "--grid", "block_size=sixteen", "--out", str(tmp_path / "s.csv")], "block_size")


def test_demo_out_must_be_a_folder(capsys, tmp_path):
    f = tmp_path / "file.txt"
    f.write_text("x")
    _error(capsys, ["demo", "--out", str(f), "-n", "10", "--engine-requests", "0"], "--out", "file.txt")


# ---- item 9: advice names the knob the user set ------------------------------------------
def test_one_block_too_large_blames_the_block_size(capsys):
    err = _error(capsys, ["simulate", *SMALL, "--block-size", "65536", "-n", "3"], "block_size")
    assert "weights" not in err


def test_rate_nan_blames_the_rate(capsys):
    err = _error(capsys, ["simulate", *SMALL, "--rate", "nan", "-n", "3"], "--rate")
    assert "row" not in err


def test_negative_swap_space_names_the_flag(capsys):
    err = _error(capsys, ["simulate", *SMALL, "--preemption-mode", "swap", "--swap-space-gib", "-1", "-n", "3"],
                 "swap_space_gib")
    assert "num_cpu_blocks" not in err


def test_demo_engine_blocks_too_few_names_the_demo_flag(capsys, tmp_path, monkeypatch):
    import paged.studies.demo
    import paged.models
    from paged.errors import InvalidRequestError

    def too_small(*a, **k):
        raise InvalidRequestError("request 'gen-1': ... exceed the KV cache of 1 blocks x 16 = 16 tokens")
    monkeypatch.setattr(paged.models, "load_model", lambda model: None)
    monkeypatch.setattr(paged.studies.demo, "engine_run", too_small)
    err = _error(capsys, ["demo", "--out", str(tmp_path / "r"), "-n", "10", "--engine-blocks", "1"], "--engine-blocks")
    assert "max_model_len" not in err
