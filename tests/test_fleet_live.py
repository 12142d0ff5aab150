"""The router in front of two live engines (ours, tiny random llama) publishing vLLM's KV events
on their own ipc endpoints: the router's precise view of each replica equals that replica's pool
index and what paged.connect rebuilds from the same stream; on a shared-prefix workload KV-aware
routing measures a higher hit rate than round robin (the engines' own cached-token counts); a
replica that goes away is marked down and no request is lost."""
from __future__ import annotations

import warnings

import pytest

import paged
import paged.connect as pc
from paged.connect.wire import to_int_hash
from paged.errors import ConfigError, NoReplicaError, ReplicaDownWarning
from paged.fleet import EngineReplica, LiveFleet

BS, POOL = 4, 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from paged.models import load_model
    from paged.models.testing import make_tiny_checkpoint
    return load_model(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama"))


def engine(tiny, path, name):
    llm = paged.LLM(tiny, block_size=BS, num_blocks=POOL)
    return EngineReplica(llm, {"endpoint": f"ipc://{path}/{name}", "replay_endpoint": f"ipc://{path}/{name}r"}, name)


def workload(prefixes=3, rounds=3):
    """Prompt i: shared prefix i % prefixes (3 blocks) + its own 3 tokens; prefixes cycle."""
    out = []
    for i in range(prefixes * rounds):
        k = i % prefixes
        out.append([10 + 20 * k + j for j in range(12)] + [200 + 3 * i + j for j in range(3)])
    return out


def run(tiny, path, router):
    reps = [engine(tiny, path, f"{router}-{k}") for k in range(2)]
    fleet = LiveFleet(reps, router)
    fleet.run(workload(), max_tokens=3)
    return fleet, reps


def test_precise_views_equal_each_stream_and_kv_aware_beats_round_robin(tiny, tmp_path):
    rates = {}
    for router in ("round_robin", "kv_aware"):
        fleet, reps = run(tiny, tmp_path, router)
        try:
            assert len(fleet.results) == 9 and {r[1] for r in fleet.results} == {0, 1}
            for i, rep in enumerate(reps):
                precise = fleet.dispatcher.replicas[i].precise
                view = precise.forest.live
                assert set(precise.live.values()) == view      # the key index and the forest agree
                assert view == {to_int_hash(h) for h in rep.llm.kv_manager.pool.index}
                with pc.connect(events=rep.events_endpoint, replay=rep.replay_endpoint, background=False) as src:
                    src.poll(0.5)   # joins late: the replay socket gives the whole stream
                    assert src.forest.live == view
            rates[router] = fleet.hit_rate()
            # the engines' own counters agree with the answers' cached tokens
            kv_hits = sum(r.llm.kv_manager.prefix_cache_hits for r in reps)
            assert kv_hits == sum(row[4] for row in fleet.results)
        finally:
            fleet.close()
            for r in reps:
                r.close()
    assert rates["kv_aware"] > rates["round_robin"], rates
    assert rates["kv_aware"] >= 0.5   # 6 of 9 requests reuse their 12-token prefix


def test_a_replica_that_goes_away_is_marked_down_and_nothing_is_lost(tiny, tmp_path):
    fleet, reps = run(tiny, tmp_path, "kv_aware")
    try:
        reps[1].close()
        with pytest.warns(ReplicaDownWarning, match="kv_aware-1"):
            rows = [fleet.send(p, 2) for p in workload(3, 1)]
        assert [r[1] for r in rows] == [0, 0, 0] and len(fleet.results) == 12
        assert not fleet.dispatcher.replicas[1].up
        frame = fleet.dispatcher.frame()
        assert set(frame["replica"].iloc[9:]) <= {0, 1} and (frame["replica"].iloc[-3:] == 0).all()
        reps[0].close()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ReplicaDownWarning)
            with pytest.raises(NoReplicaError, match="all 2 replicas are down"):
                fleet.send([1, 2, 3, 4, 5], 2)
    finally:
        fleet.close()
        for r in reps:
            r.close()


def test_an_engine_without_kv_events_cannot_be_a_replica(tiny):
    with pytest.raises(ConfigError, match="kv_events_endpoint"):
        EngineReplica(paged.LLM(tiny, block_size=BS, num_blocks=POOL), None)
    with pytest.raises(ConfigError, match="at least one replica"):
        LiveFleet([])
