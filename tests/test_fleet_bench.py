"""benchmarks/fleet.py on tiny sizes (so it cannot rot) and the fleet study through paged.sweep's registry."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from paged.sweeps.registry import get_study

ROOT = Path(__file__).resolve().parents[1]


def test_quick_benchmark_prints_the_three_tables(capsys):
    spec = importlib.util.spec_from_file_location("bench_fleet", ROOT / "benchmarks" / "fleet.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
        assert mod.main(["--quick", "--only", "hot"]) == 0
    finally:
        sys.modules.pop(spec.name, None)
    out = capsys.readouterr().out
    assert "== hot" in out and "kv_aware w=1000" in out and "round_robin" in out


def test_the_fleet_study_is_registered_for_sweeps():
    study = get_study("fleet_routing")
    row = study({"policy": "cache_aware", "num_replicas": 3, "num_requests": 40, "num_prefixes": 4,
                 "model": "llama-2-7b", "num_blocks": 600})
    assert row["policy"] == "cache_aware" and row["replicas"] == 3 and row["requests_finished"] == 40
    assert 0 < row["hit_rate"] < 1
    kv = study({"policy": "kv_aware", "num_replicas": 3, "num_requests": 40, "num_prefixes": 4,
                "model": "llama-2-7b", "num_blocks": 600, "overlap_weight": 5.0})
    assert kv["router_overlap_weight"] == 5.0


def test_compare_policies_routes_the_same_requests_and_gives_ratios_to_round_robin():
    from paged.fleet.study import compare_policies
    df = compare_policies(("round_robin", "session_affinity"), num_replicas=3, num_requests=60, num_prefixes=3,
                          model="llama-2-7b", num_blocks=600)
    assert list(df["policy"]) == ["round_robin", "session_affinity"] and (df["requests_finished"] == 60).all()
    assert df["hit_rate_vs_rr"].iloc[0] == 1.0
    assert df["hit_rate_vs_rr"].iloc[1] == df["hit_rate"].iloc[1] / df["hit_rate"].iloc[0]
    assert df["hit_rate"].iloc[1] > df["hit_rate"].iloc[0]   # 3 sessions on 3 replicas: each prefix computed once
