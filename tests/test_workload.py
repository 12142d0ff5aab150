"""Synthetic traces, arrival processes and trace-file loaders."""
import math

import numpy as np
import pandas as pd
import pytest

from paged.errors import ConfigError, PagedError
from paged.sim.workload import (TRACE_COLUMNS, TraceFormatError, arrival_times, concat_traces, load_trace, save_trace,
                            synthetic_trace)


@pytest.mark.parametrize("name,mean_in,mean_out", [("sharegpt", 161.31, 337.99), ("alpaca", 19.31, 58.45),
                                                   ("azure-conv", 1155, 211), ("azure-code", 2048, 28)])
def test_length_means_match_published(name, mean_in, mean_out):
    df = synthetic_trace(name, 40000, trace_seed=3)
    assert df["prompt_tokens"].mean() == pytest.approx(mean_in, rel=0.04)
    assert df["output_tokens"].mean() == pytest.approx(mean_out, rel=0.04)
    assert (df["prompt_tokens"] >= 1).all() and (df["output_tokens"] >= 1).all()


def test_seeded_and_columns():
    a = synthetic_trace("sharegpt", 200, rate=4.0, trace_seed=7)
    b = synthetic_trace("sharegpt", 200, rate=4.0, trace_seed=7)
    pd.testing.assert_frame_equal(a, b)
    assert list(a.columns) == TRACE_COLUMNS
    assert a["arrival_time"].is_monotonic_increasing
    assert not a.equals(synthetic_trace("sharegpt", 200, rate=4.0, trace_seed=8))


def test_arrival_processes():
    rng = np.random.default_rng(0)
    for proc in ("poisson", "gamma", "fixed"):
        t = arrival_times(20000, 5.0, proc, cv=3.0, rng=rng)
        assert 20000 / t[-1] == pytest.approx(5.0, rel=0.08)
    gaps = np.diff(arrival_times(20000, 5.0, "gamma", cv=3.0, rng=rng))
    assert gaps.std() / gaps.mean() == pytest.approx(3.0, rel=0.15)
    assert np.allclose(np.diff(arrival_times(10, 2.0, "fixed")), 0.5)
    assert (arrival_times(5, math.inf) == 0).all()
    with pytest.raises(ConfigError, match="arrival process"):
        arrival_times(3, 1.0, "weibull")
    with pytest.raises(ConfigError, match="rate"):
        arrival_times(3, 0.0)


def test_shared_prefix_and_context_fit():
    df = synthetic_trace("alpaca", 500, num_prefixes=3, prefix_tokens=64, prefix_fraction=0.5, trace_seed=1)
    has = df["prefix_id"] >= 0
    assert 0.4 < has.mean() < 0.6 and set(df.loc[has, "prefix_id"]) == {0, 1, 2}
    assert (df.loc[has, "prefix_tokens"] == 64).all() and (df.loc[has, "prompt_tokens"] > 64).all()
    assert (df.loc[~has, "prefix_tokens"] == 0).all()
    fitted = synthetic_trace("azure-code", 500, max_model_len=2048, trace_seed=1)
    assert (fitted["prompt_tokens"] + fitted["output_tokens"] <= 2048).all()
    merged = concat_traces([df, synthetic_trace("alpaca", 50, num_prefixes=2, prefix_tokens=8, trace_seed=2)])
    assert len(merged) == 550 and merged["prefix_id"].max() == 4


def test_loaders_roundtrip(tmp_path):
    (tmp_path / "v.csv").write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.5,10,3\n0.1,20,4\n")
    v = load_trace(tmp_path / "v.csv")
    assert v["prompt_tokens"].tolist() == [20, 10] and v["arrival_time"].tolist() == [0.1, 0.5]
    (tmp_path / "a.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                    "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n")
    a = load_trace(tmp_path / "a.csv")
    assert a["arrival_time"].tolist() == pytest.approx([0.0, 4.314579], abs=1e-6)
    (tmp_path / "j.jsonl").write_text('{"input_toks": 5, "output_toks": 7, "arrival_time_ns": 2000000000}\n'
                                      '{"input_toks": 6, "output_toks": 8, "arrival_time_ns": 1000000000}\n')
    j = load_trace(tmp_path / "j.jsonl")
    assert j["arrival_time"].tolist() == [1.0, 2.0] and j["output_tokens"].tolist() == [8, 7]
    df = synthetic_trace("sharegpt", 30, rate=2.0, num_prefixes=2, prefix_tokens=16, trace_seed=0)
    save_trace(df, tmp_path / "p.csv")
    back = load_trace(tmp_path / "p.csv")
    pd.testing.assert_frame_equal(back[TRACE_COLUMNS[1:]], df[TRACE_COLUMNS[1:]])


@pytest.mark.parametrize("text,match", [
    ("arrived_at,num_prefill_tokens,num_decode_tokens\n0.1,10,3\n0.2,abc,4\n", r"row 3, column 'num_prefill_tokens': got 'abc'"),
    ("arrived_at,num_prefill_tokens,num_decode_tokens\n0.1,10,0\n", r"row 2, column 'num_decode_tokens': got '0', need an integer >= 1"),
    ("arrived_at,num_prefill_tokens,num_decode_tokens\n-1,10,2\n", r"row 2, column 'arrived_at'"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,3,4\n", r"row 2, column 'TIMESTAMP'"),
    ("foo,bar\n1,2\n", r"unknown CSV header"),
])
def test_malformed_csv_rows_are_named(tmp_path, text, match):
    p = tmp_path / "bad.csv"
    p.write_text(text)
    with pytest.raises(TraceFormatError, match=match) as exc:
        load_trace(p)
    assert isinstance(exc.value, PagedError)


def test_malformed_jsonl_rows_are_named(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"input_toks": 5, "output_toks": 7}\n{"input_toks": 5, "output_toks": 2.5}\n')
    with pytest.raises(TraceFormatError, match=r"row 2, column 'output_toks'"):
        load_trace(p)
    p.write_text('{"input_toks": 5, "output_toks": 7}\n{oops\n')
    with pytest.raises(TraceFormatError, match=r"row 2: invalid JSON"):
        load_trace(p)
    with pytest.raises(TraceFormatError, match="does not exist"):
        load_trace(tmp_path / "nope.csv")


def test_sample_traces_in_data_load():
    import glob
    import os

    here = os.path.join(os.path.dirname(__file__), "..", "data", "traces")
    files = sorted(glob.glob(os.path.join(here, "*.csv")) + glob.glob(os.path.join(here, "*.jsonl")))
    assert len(files) == 5
    for f in files:
        df = load_trace(f)
        assert len(df) in (500, 1000) and df["arrival_time"].iloc[0] >= 0 and (df["output_tokens"] >= 1).all()
    shared = load_trace(os.path.join(here, "sharegpt_like_shared_prefix_1k.csv"))
    assert shared["prefix_id"].nunique() == 9  # 8 prompts + "none"


@pytest.mark.parametrize("text,match", [
    ("arrived_at,num_prefill_tokens,num_decode_tokens\n0.1,10,3\n\n\n0.2,abc,4\n", r"row 5, column 'num_prefill_tokens'"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,3,4\n\nyesterday,3,4\n", r"row 4, column 'TIMESTAMP'"),
])
def test_row_numbers_count_blank_lines(tmp_path, text, match):
    """The reported row is the file's line: pandas drops blank lines, which shifted the number."""
    p = tmp_path / "bad.csv"
    p.write_text(text)
    with pytest.raises(TraceFormatError, match=match):
        load_trace(p)
