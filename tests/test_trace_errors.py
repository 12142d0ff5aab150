"""Huge or overflowing trace values: a clear TraceFormatError naming file, row, column and
value, and lengths checked against the model before any prompt is synthesised."""
from __future__ import annotations

import json
import tracemalloc

import pandas as pd
import pytest

from paged.sim.simulator import SimConfig, simulate
from paged.sim.workload import TraceFormatError, load_trace, normalize_trace

SMALL = dict(model="llama-2-7b", gpu="a100-40gb", max_model_len=1024, num_blocks=200)


@pytest.mark.parametrize("col, value", [("output_tokens", "1e23"), ("prompt_tokens", "9.3e18"),
                                        ("prompt_tokens", "1e400"), ("output_tokens", "-1e30")])
def test_csv_values_outside_int64_name_file_row_column_and_value(tmp_path, col, value):
    """Catches 1e23 output tokens cast to int64 (it became -2**63 with a RuntimeWarning)."""
    f = tmp_path / "big.csv"
    row = {"arrival_time": "1", "prompt_tokens": "10", "output_tokens": "5", col: value}
    f.write_text("arrival_time,prompt_tokens,output_tokens\n0,10,5\n" + ",".join(row.values()) + "\n")
    with pytest.raises(TraceFormatError) as e:
        load_trace(f)
    assert str(e.value).startswith(f"big.csv: row 3, column '{col}': got '{value}'")


def test_jsonl_value_outside_int64_names_its_own_column(tmp_path):
    """Catches `input_toks: 1e30` reported as a 'prefix_tokens' problem."""
    f = tmp_path / "big.jsonl"
    rows = [{"input_toks": 10, "output_toks": 5, "arrival_time_ns": 0},
            {"input_toks": 1e30, "output_toks": 5, "arrival_time_ns": 1},]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(TraceFormatError, match=r"big.jsonl: row 2, column 'input_toks': got 1e\+30"):
        load_trace(f)
    rows[1] = {"input_toks": 10, "output_toks": 2**63, "arrival_time_ns": 1}
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(TraceFormatError, match="row 2, column 'output_toks'"):
        load_trace(f)


def test_largest_int64_still_loads():
    tr = normalize_trace(pd.DataFrame({"arrival_time": [0.0], "prompt_tokens": [2**62], "output_tokens": [1]}))
    assert int(tr["prompt_tokens"][0]) == 2**62


@pytest.mark.parametrize("prompt", [10**11, 2 * 10**8, 2 * 10**7])
def test_huge_rows_are_rejected_before_a_prompt_is_synthesised(prompt):
    """1e11 prompt tokens used to allocate 745 GiB; 2e7 cost 1 GB and seconds before the
    max_model_len check. Now the row is rejected before a prompt is synthesised (peak memory
    stays small) and the others run; what it costs is measured by benchmarks/time_budgets.py."""
    tr = pd.DataFrame({"arrival_time": [0.0, 0.5, 1.0], "prompt_tokens": [100, prompt, 50],
                       "output_tokens": [10, 10, 10**6]})
    tracemalloc.start()
    res = simulate(tr, SimConfig(**SMALL))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    s = res.summary
    assert s["requests_finished"] == 1 and s["requests_rejected"] == 2
    assert f"prompt ({prompt}) + output (10)" in s["first_rejection"] and "max_model_len=1024" in s["first_rejection"]
    assert res.requests["rejected"].tolist() == [False, True, True]
    assert peak < 200 * 2**20
