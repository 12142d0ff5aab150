"""The Mooncake reproduction: the must-show command, the cache-only replay on the project's prefix
cache, the trace's own reuse count, Table 2 and the capacity curve (small slices of the shipped
traces; the full-size numbers are in docs/real_traffic.md and benchmarks/real_traffic.py)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from paged.cli import main
from paged.errors import ConfigError
from paged.sim.workload import load_trace
from paged.studies.cache_replay import capacity_sweep, replay_prefix_cache, unlimited_capacity
from paged.studies.mooncake import capacity_curve, capacity_point, mooncake_trace, table2, trace_reuse
from paged.sweeps import STUDIES

sys.path.insert(0, str(Path(__file__).parent))
from content_helpers import expected_hits  # noqa: E402

CONV = Path(__file__).resolve().parents[1] / "data" / "traces" / "mooncake" / "conversation_trace.jsonl.gz"
MUST_SHOW = ["simulate", "--trace", str(CONV), "--model", "llama-3.1-70b", "--gpu", "a100-80gb",
             "--tensor-parallel", "8", "--json"]


def _hand_trace() -> pd.DataFrame:
    """Three requests over 4-token blocks: B extends A's first block, C repeats all of B."""
    df = pd.DataFrame({"arrival_time": [0.0, 1.0, 2.0], "prompt_tokens": [8, 10, 10], "output_tokens": [1, 1, 1],
                       "block_hashes": [[1, 2], [1, 3, 4], [1, 3, 4]]})
    df.attrs["content_block_size"] = 4
    return df


def test_the_must_show_command_reports_hit_rate_and_tokens(capsys):
    assert main([*MUST_SHOW, "-n", "300"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "llama-3.1-70b" and out["tensor_parallel"] == 8 and out["requests_finished"] == 300
    assert out["prefix_cache_hit_tokens"] > 0 and out["num_blocks_in_use_at_end"] == 0
    assert out["prefix_cache_hit_rate"] == out["prefix_cache_hit_tokens"] / out["prefix_cache_query_tokens"]


def test_the_must_show_command_with_an_unlimited_cache_matches_the_ids_exactly(capsys):
    """All 12,031 requests (~30 s of CPU): 54,063,104 of 144,793,823 prompt tokens hit."""
    tr = load_trace(CONV)
    need = int(np.ceil((tr["prompt_tokens"] + tr["output_tokens"]) / 512).sum())  # a pool that never evicts
    assert main([*MUST_SHOW, "--block-size", "512", "--num-blocks", str(need)]) == 0
    out = json.loads(capsys.readouterr().out)
    hits, queries = expected_hits(tr, 512, 131072)
    assert (out["prefix_cache_hit_tokens"], out["prefix_cache_query_tokens"]) == (hits, queries)
    assert out["num_preemptions"] == 0


def test_trace_reuse_counts_leading_ids_seen_before():
    r = trace_reuse(_hand_trace())
    # blocks: A 0 of 2, B 1 of 3 (id 1), C 3 of 3; tokens: 0 + 4 + min(12, 10)
    assert r["trace_block_reuse"] == pytest.approx(4 / 8)
    assert r["trace_token_reuse"] == pytest.approx(14 / 28)


def test_replay_hits_the_hand_count_and_the_simulator_unlimited():
    rep = replay_prefix_cache(_hand_trace(), None, block_size=4, vocab_size=1000)
    # B hits block [1] (4 tokens); C hits [1, 3] (8 tokens: its last, partial block is computed)
    assert (rep["hit_tokens"], rep["query_tokens"]) == (12, 28) and rep["unlimited"]
    tr = load_trace(CONV).iloc[:500]
    for bs in (16, 512):
        rep = replay_prefix_cache(tr, None, block_size=bs)
        assert (rep["hit_tokens"], rep["query_tokens"]) == expected_hits(tr, bs, 10**9)


def test_a_small_cache_evicts_and_loses_hits_and_a_big_one_is_unlimited():
    tr = load_trace(CONV).iloc[:400]
    top = unlimited_capacity(tr, 512)
    df = capacity_sweep(tr, [200_000, 1_000_000, top], block_size=512)
    assert df["hit_rate"].iloc[0] < df["hit_rate"].iloc[1] < df["hit_rate"].iloc[-1]
    assert df["hit_rate"].iloc[2] == df["hit_rate"].iloc[-1] and df["fraction_of_max"].iloc[-1] == 1.0
    assert df["unlimited"].tolist() == [False, False, False, True]
    with pytest.raises(ConfigError, match="holds no block"):
        replay_prefix_cache(tr, 100, block_size=512)
    small = replay_prefix_cache(tr, 20_000, block_size=512)  # 39 blocks: longer prompts cannot be cached
    assert small["requests_skipped"] == int((-(-tr["prompt_tokens"] // 512) > 39).sum()) > 0


def test_table2_and_the_curve_put_ours_beside_the_paper():
    t = table2(("conversation",), num_requests=300)
    row = t.iloc[0]
    assert (row["requests"], row["paper_requests"], row["paper_cache_ratio"]) == (300, 12031, 0.40)
    assert row["unlimited_hit_rate"] <= row["trace_token_reuse"]  # the last prompt token is always computed
    c = capacity_curve(("conversation",), capacities=(10**6,), num_requests=300)
    assert len(c) == 2 and c["paper_fraction_at_3m"].iloc[0] == 0.41 and c["max_hit_rate"].iloc[0] == row["unlimited_hit_rate"]
    with pytest.raises(ConfigError, match="toolagent_trace.jsonl is stored apart"):
        mooncake_trace("toolagent")


def test_the_capacity_point_is_registered_for_sweeps():
    s = STUDIES["prefix_capacity"]
    out = s({"trace": "conversation", "capacity_tokens": 1e6, "num_requests": 200})
    assert out == capacity_point("conversation", 1e6, num_requests=200) and 0 < out["hit_rate"] < 1
    assert "mooncake_table" in STUDIES


def test_the_real_traffic_benchmark_runs_small():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "real_traffic.py"
    spec = importlib.util.spec_from_file_location("bench_real_traffic", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = [bench.one(20, False), bench.one(40, False)]
    assert [r["finished"] for r in rows] == [20, 40] and all(r["blocks_in_use_at_end"] == 0 for r in rows)
    text = bench.table(rows)
    assert "(1.00)" in text and "40" in text.splitlines()[-1]
