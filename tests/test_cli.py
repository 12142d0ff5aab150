"""`python -m paged simulate | sweep | demo`."""
import json
import subprocess
import sys

import pandas as pd
import pytest

from paged.cli import main, parse_grid
from paged.errors import PagedError

SMALL = ["--model", "llama-2-7b", "--gpu", "a100-40gb", "--max-model-len", "1024", "-n", "40"]


def test_simulate_json(capsys):
    assert main(["simulate", *SMALL, "--rate", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for k in ("requests_finished", "throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "tbt_p50_s", "tbt_p99_s",
              "kv_token_usage_mean", "kv_block_usage_mean", "num_preemptions", "prefix_cache_hit_rate"):
        assert k in out
    assert out["requests_finished"] == 40 and out["num_blocks_in_use_at_end"] == 0


def test_simulate_table_trace_and_outputs(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,100,20\n0.5,300,10\n1.0,50,5\n")
    req = tmp_path / "req.csv"
    assert main(["simulate", *SMALL, "--trace", str(trace), "--allocator", "contiguous-pow2",
                 "--requests-out", str(req)]) == 0
    text = capsys.readouterr().out
    assert "requests_finished" in text and "num_blocks_in_use_at_end" in text
    assert len(pd.read_csv(req)) == 3


def test_errors_name_the_problem(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,x,20\n")
    assert main(["simulate", *SMALL, "--trace", str(bad)]) == 2
    assert "row 2, column 'num_prefill_tokens'" in capsys.readouterr().err
    assert main(["simulate", "--model", "llama-2-70b", "-n", "5"]) == 2
    assert "tensor_parallel" in capsys.readouterr().err
    with pytest.raises(PagedError, match="unknown key"):
        parse_grid(["blocksize=1"])
    for bad in ("block_size=true", "num_requests=false", "rate=true"):
        with pytest.raises(PagedError, match="takes (int|float) values, got (True|False)"):
            parse_grid([bad])
    assert parse_grid(["block_size=8,16", "enable_chunked_prefill=true,false", "rate=inf"]) == {
        "block_size": [8, 16], "enable_chunked_prefill": [True, False], "rate": [float("inf")]}


def test_sweep_csv(tmp_path, capsys):
    out = tmp_path / "s.csv"
    assert main(["sweep", *SMALL, "--grid", "block_size=16,32", "--grid", "allocator=paged,contiguous-max",
                 "--out", str(out), "-j", "2"]) == 0
    df = pd.read_csv(out)
    assert len(df) == 4 and set(df["block_size"]) == {16, 32}
    assert (df["requests_finished"] == 40).all() and (df["num_blocks_in_use_at_end"] == 0).all()


def test_demo_writes_report(tmp_path):
    assert main(["demo", "--out", str(tmp_path), "-n", "60", "-j", "1", "--engine-requests", "0"]) == 0
    md = (tmp_path / "simulation.md").read_text()
    assert "Memory story" in md and "interference" in md and "contiguous-max" in md
    mem = pd.read_csv(tmp_path / "memory_story.csv")
    assert list(mem["allocator"]) == ["contiguous-max", "contiguous-pow2", "contiguous-oracle", "paged"]
    assert len(pd.read_csv(tmp_path / "interference.csv")) == 4


def test_module_entry_point():
    r = subprocess.run([sys.executable, "-m", "paged", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "simulate" in r.stdout and "sweep" in r.stdout and "demo" in r.stdout


def test_sweep_parquet_needs_an_engine(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if neither Parquet engine were installed
    monkeypatch.setitem(sys.modules, "fastparquet", None)
    assert main(["sweep", *SMALL, "--grid", "block_size=16", "--out", str(tmp_path / "s.parquet")]) == 2
    assert "pyarrow" in capsys.readouterr().err


def test_demo_runs_the_embedded_model(tmp_path, monkeypatch, smollm2):
    import paged.models
    loads = []
    # one load per session: the demo gets the conftest model
    monkeypatch.setattr(paged.models, "load_model", lambda model: loads.append(model) or smollm2)
    args = ["demo", "--out", str(tmp_path), "-n", "40", "-j", "1",
            "--engine-requests", "4", "--engine-blocks", "10", "--max-tokens", "8"]
    assert main(args) == 0
    md = (tmp_path / "demo.md").read_text()
    assert "A real model through the paged cache" in md and "KV formats" in md and "Memory story" in md
    steps = pd.read_csv(tmp_path / "engine_steps.csv")
    assert steps["num_decode_tokens"].sum() > 0 and (steps["token_usage"] <= 1).all()
    formats = pd.read_csv(tmp_path / "kv_formats.csv")
    assert formats.loc[formats["kv_format"] == "auto", "outputs_identical"].item()
    assert (formats.set_index("kv_format").loc["int4", "capacity_vs_model_dtype"] > 4)
    assert loads == ["smollm2"]  # the demo ran the embedded model


def test_simulate_json_is_strict_json_when_a_metric_is_undefined(tmp_path, capsys):
    """One-token outputs have no time between tokens: the JSON says null, not the bare token NaN
    that strict parsers (jq, JSON.parse, json.loads(parse_constant=...)) reject; no warning either."""
    import warnings

    trace = tmp_path / "one.csv"
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,100,1\n0.5,300,1\n")

    def reject(token):
        raise ValueError(f"non-standard JSON token {token}")

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main(["simulate", *SMALL, "--trace", str(trace), "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out, parse_constant=reject)
    assert out["requests_finished"] == 2 and out["tbt_p50_s"] is None and out["tbt_p99_s"] is None
    assert out["ttft_p50_s"] > 0 and captured.err == ""


def test_sweep_num_requests_limits_a_trace_like_simulate(tmp_path, capsys):
    """`-n N` with `--trace` means the first N rows in both commands (sweep used to run every row)."""
    trace = tmp_path / "t.csv"
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,100,20\n0.5,300,10\n1.0,50,5\n")
    out = tmp_path / "s.csv"
    args = ["--model", "llama-2-7b", "--gpu", "a100-40gb", "--max-model-len", "1024", "--trace", str(trace)]
    assert main(["sweep", *args, "-n", "2", "--grid", "block_size=16", "--out", str(out), "-j", "1"]) == 0
    assert pd.read_csv(out)["requests"].tolist() == [2]
    assert main(["sweep", *args, "--grid", "block_size=16", "--out", str(out), "-j", "1"]) == 0
    assert pd.read_csv(out)["requests"].tolist() == [3]  # no -n: the whole trace
    assert main(["simulate", *args, "-n", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["requests"] == 2
