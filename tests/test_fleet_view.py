"""paged.viz.fleet_view's pure figures and sentences over a small simulated fleet: one grid per
replica with every block, one marker per decision, a story whose counts come from the record."""
from __future__ import annotations

from figure_check import figure_problems

from paged.fleet.sim import SimFleet
from paged.fleet.workloads import shared_prefix_trace
from paged.sim.config import SimConfig
from paged.viz.fleet_view import fleet_story, policies_figure, pools_figure, routing_figure


def test_fleet_figures_and_story_follow_the_record():
    cfg = SimConfig(model="llama-2-7b", gpu="a100-80gb", block_size=16, num_blocks=40)
    fleet = SimFleet(cfg, "kv_aware", num_replicas=2)
    res = fleet.run(shared_prefix_trace(12, rate=2.0, num_prefixes=2, prompt_tokens=96, prefix_tokens=64, seed=1))
    snaps = {r.name: r.kv.snapshot() for r in fleet.replicas}
    pools = pools_figure(snaps, cols=8)
    grids = [t for t in pools.data if t.type == "heatmap"]
    assert len(grids) == 2 and all((t.z.size - (t.z != t.z).sum()) == 40 for t in grids)
    assert {1.0} <= set(grids[0].z.ravel()) | set(grids[1].z.ravel())   # cached-free prefix blocks remain
    d = fleet.dispatcher.frame()
    routing = routing_figure(d)
    assert len(routing.data[0].x) == 12 and list(routing.data[0].y) == list(d["replica_name"])
    warm = int((d["overlap_blocks"] > 0).sum())
    story = fleet_story(d, {"kv_aware": res.summary["hit_rate"], "round_robin": res.summary["hit_rate"] / 2})
    assert f"{warm} of 12 requests" in story and "2.0x" in story
    pol = policies_figure(__import__("pandas").DataFrame([res.summary]))
    for fig in (pools, routing, pol):
        assert figure_problems(fig) == [], figure_problems(fig)
