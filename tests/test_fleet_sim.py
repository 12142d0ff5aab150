"""The simulated fleet: N replicas, each its own StepLoop, pool and cost model, behind one router.
Each replica's precise view is exactly its pool's hash index (rebuilt from its KV events); every
request finishes on exactly one replica; KV-aware routing beats round robin on shared prefixes;
a hot prefix overloads pure cache affinity and the load term fixes it; bad input is refused."""
from __future__ import annotations

import pytest

from paged import telemetry
from paged.errors import ConfigError, ReplicaDownWarning
from paged.fleet import ROUTERS
from paged.fleet.sim import SimFleet
from paged.fleet.workloads import shared_prefix_trace
from paged.sim.config import SimConfig

CFG = SimConfig(model="llama-2-7b", gpu="a100-80gb", block_size=16, num_blocks=1200)


def run(router, trace, n=8, cfg=CFG, **kw):
    fleet = SimFleet(cfg, router, num_replicas=n, **kw)
    return fleet, fleet.run(trace)


def test_precise_views_equal_the_pools_and_every_request_finishes_once():
    trace = shared_prefix_trace(240, rate=30.0, num_prefixes=12, seed=1)
    fleet, res = run("kv_aware", trace, n=4)
    for r in fleet.replicas:
        assert set(r.precise.live.values()) == set(r.kv.pool.index), r.name
        assert r.precise.num_stored > 0
    req = res.requests
    assert len(req) == 240 and req["finish_s"].notna().all() and not req["rejected"].any()
    assert list(req["replica"]) == list(res.routing["replica"])            # routed = served
    assert res.summary["num_blocks_in_use_at_end"] == 0
    assert list(res.steps.columns) == list(telemetry.STEP_COLUMNS) + ["replica"]
    assert set(res.steps["replica"]) == {0, 1, 2, 3}
    assert res.per_replica["requests"].sum() == 240
    # every replica's own records: its step clock never goes back
    for _, s in res.steps.groupby("replica"):
        assert (s["time_s"].diff().dropna() >= 0).all()


def test_kv_aware_and_cache_aware_beat_round_robin_on_shared_prefixes():
    trace = shared_prefix_trace(320, rate=25.0, num_prefixes=16, seed=2)
    rates = {p: run(p, trace)[1].summary["hit_rate"] for p in ("round_robin", "least_outstanding", "kv_aware",
                                                               "cache_aware")}
    assert rates["kv_aware"] > rates["round_robin"] and rates["cache_aware"] > rates["round_robin"], rates
    assert rates["cache_aware"] > rates["least_outstanding"], rates


def test_a_hot_prefix_overloads_pure_affinity_and_the_load_term_fixes_it():
    trace = shared_prefix_trace(400, rate=60.0, num_prefixes=8, hot_share=0.7, output_tokens=128, seed=3)
    _, greedy = run("kv_aware", trace, overlap_weight=1000.0)   # the cost is (almost) all cache affinity
    _, balanced = run("kv_aware", trace, overlap_weight=1.0)    # Dynamo's default: decode blocks count too
    _, rr = run("round_robin", trace)
    g, b = greedy.summary, balanced.summary
    assert g["max_replica_share"] > 0.5                  # the hot prefix's replica takes most of the fleet
    assert b["max_replica_share"] < g["max_replica_share"] / 2
    assert g["ttft_p99_s"] > 2 * b["ttft_p99_s"], (g["ttft_p99_s"], b["ttft_p99_s"])
    assert b["hit_rate"] > rr.summary["hit_rate"]        # balanced still keeps most of the cache benefit


def test_the_approximate_view_differs_from_the_stream_where_it_should():
    """The guess is right while the pool keeps everything and requests do not overlap; it
    over-counts for prefixes still in flight (a burst) and for blocks a tight pool evicted."""
    def disagreements(trace, cfg=CFG):
        r = run("kv_aware", trace, n=4, cfg=cfg, view="approximate")[1].routing
        assert (r["approx_blocks"] >= 0).all() and (r["precise_blocks"] >= 0).all()
        return int((r["approx_blocks"] > r["precise_blocks"]).sum()), int((r["approx_blocks"] != r["precise_blocks"]).sum())
    calm = shared_prefix_trace(200, rate=40.0, num_prefixes=10, seed=4)
    assert disagreements(calm) == (0, 0)
    assert run("kv_aware", calm, n=4, view="approximate")[1].summary["view_agree"] == 1.0
    assert disagreements(shared_prefix_trace(200, rate=5000.0, num_prefixes=10, seed=4))[0] > 0   # in flight
    small = SimConfig(model="llama-2-7b", gpu="a100-80gb", block_size=16, num_blocks=200)
    assert disagreements(calm, small)[0] > 0                                                       # evicted


def test_heterogeneous_replicas_have_their_own_pools_and_cost_models():
    cfgs = [SimConfig(model="llama-2-70b", gpu="a100-80gb", tensor_parallel=4, block_size=16),
            SimConfig(model="llama-2-70b", gpu="h100-sxm", tensor_parallel=8, block_size=16)]
    trace = shared_prefix_trace(60, rate=10.0, num_prefixes=4, seed=5)
    fleet, res = run("least_kv_usage", trace, n=2, cfg=cfgs)
    per = res.per_replica
    assert list(per["gpu"]) == ["a100-80gb", "h100-sxm"] and list(per["tensor_parallel"]) == [4, 8]
    assert per["num_kv_blocks"].iloc[1] > per["num_kv_blocks"].iloc[0]
    assert res.requests["finish_s"].notna().all()


def test_bad_fleets_are_config_errors():
    with pytest.raises(ConfigError, match="at least one replica"):
        SimFleet(CFG, num_replicas=0)
    with pytest.raises(ConfigError, match="unknown router 'nearest'"):
        SimFleet(CFG, "nearest", num_replicas=2)
    with pytest.raises(ConfigError, match="replica r1 .*tensor_parallel"):
        SimFleet([CFG, SimConfig(model="llama-2-70b", gpu="a100-80gb", tensor_parallel=1)])
    with pytest.raises(ConfigError, match="vocabularies"):
        SimFleet([CFG, SimConfig(model="llama-3-8b", gpu="a100-80gb", block_size=16)])
    with pytest.raises(ConfigError, match="precise"):
        SimFleet(CFG, "kv_aware", num_replicas=2, precise=False).run(shared_prefix_trace(5))
    fleet = SimFleet(CFG, num_replicas=2)
    fleet.run(shared_prefix_trace(5))
    with pytest.raises(ConfigError, match="runs once"):
        fleet.run(shared_prefix_trace(5))
    assert "kv_aware" in ROUTERS


def test_a_replica_that_goes_away_mid_run_loses_no_request():
    trace = shared_prefix_trace(160, rate=40.0, num_prefixes=8, output_tokens=128, seed=6)
    t_down = float(trace["arrival_time"].iloc[80])
    fleet = SimFleet(CFG, "kv_aware", num_replicas=4)
    with pytest.warns(ReplicaDownWarning, match="'r2' is down"):
        res = fleet.run(trace, down_at={2: t_down})
    req, routing = res.requests, res.routing
    assert req["finish_s"].notna().all() and len(req) == 160          # nothing lost
    moved = req[req["num_reroutes"] == 1]
    assert len(moved) > 0 and (moved["replica"] != 2).all()            # re-routed elsewhere, arrival kept
    assert (moved["first_token_s"] > t_down).all()
    assert len(routing) == 160 + len(moved)                            # one more decision each
    assert (routing[routing["time_s"] > t_down]["replica"] != 2).all()
    on_two = req[req["replica"] == 2]
    assert (on_two["finish_s"] <= t_down).all()                        # what r2 finished, it finished before
    assert res.summary["num_blocks_in_use_at_end"] == 0
    with pytest.raises(ConfigError, match="down_at names replicas"):
        SimFleet(CFG, num_replicas=2).run(trace, down_at={5: 1.0})


def test_mooncake_content_blocks_route_to_the_replica_that_holds_them():
    """The real trace's prompts (equal block ids = equal tokens): KV-aware routing finds the blocks a
    replica holds (the routing record's matched blocks are real hits), and the views stay exact."""
    from paged.sim.workload import load_trace
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "data" / "traces" / "mooncake" / "conversation_trace.jsonl.gz"
    trace = load_trace(path).iloc[:60]
    cfg = SimConfig(model="llama-3.1-8b", gpu="a100-80gb", block_size=16)
    fleet = SimFleet(cfg, "kv_aware", num_replicas=3, overlap_weight=100.0)
    res = fleet.run(trace)
    assert res.requests["finish_s"].notna().all()
    for r in fleet.replicas:
        assert set(r.precise.live.values()) == set(r.kv.pool.index)
    routed = res.routing.set_index("request_id")["precise_blocks"]
    hit = res.requests.set_index("request_id")["num_cached_tokens"] // 16
    assert (routed > 0).any()
    assert (hit >= routed.reindex(hit.index) - 1).all()   # what the router saw cached was (almost all) hit
