"""The replicas' host tiers pooled inside a running SimFleet: a request takes from other nodes'
host tiers what its own node lacks, pays the network for it in its TTFT, and reads the copies as
local host-tier hits; without pooling nothing crosses; a down replica serves nothing; bad input
is refused."""
from __future__ import annotations

import pandas as pd
import pytest

from paged.errors import ConfigError, ReplicaDownWarning
from paged.fleet.pool import Network
from paged.fleet.sim import SimFleet
from paged.fleet.workloads import shared_prefix_trace
from paged.sim.config import SimConfig

# demote at once (1% of the GPU pool): a finished request's prefix is in its node's host tier by
# that node's next step
CFG = SimConfig(model="llama-2-7b", gpu="a100-80gb", block_size=16, num_blocks=400, enable_host_tier=True,
                host_tier_threshold=0.01, swap_space_gib=4.0)
# round robin over two replicas: rows 0 and 2 on replica 0, rows 1 and 3 on replica 1; row 2 makes
# replica 0 step (and demote prefix 0); row 3 wants prefix 0 on replica 1, which never computed it
TRACE = pd.DataFrame(dict(arrival_time=[0.0, 0.1, 5.0, 10.0], prompt_tokens=[1200] * 4, output_tokens=[16] * 4,
                          prefix_id=[0, 1, 2, 0], prefix_tokens=[1024] * 4))
PREFIX_BLOCKS = 1024 // 16


def run(pooled, trace=TRACE, cfg=CFG, n=2, **kw):
    fleet = SimFleet(cfg, "round_robin", num_replicas=n, pooled=pooled)
    res = fleet.run(trace, **kw)
    for r in fleet.replicas:
        r.kv.check_invariants()
    assert res.summary["num_blocks_in_use_at_end"] == 0 and res.requests["finish_s"].notna().all()
    return fleet, res


def test_a_remote_prefix_crosses_the_network_once_and_is_read_as_a_host_hit():
    net = Network()
    fleet, res = run(net)
    local, pooled = run(None)[1].requests, res.requests
    assert list(pooled["num_remote_blocks"]) == [0, 0, 0, PREFIX_BLOCKS]
    assert pooled.loc[3, "num_cached_tokens"] == 1024 and local.loc[3, "num_cached_tokens"] == 0
    assert (local["num_remote_blocks"] == 0).all()
    nbytes = PREFIX_BLOCKS * fleet.replicas[1].host_block_bytes
    s = res.summary
    assert (s["remote_fetches"], s["remote_blocks"], s["network_bytes"]) == (1, PREFIX_BLOCKS, nbytes)
    assert s["network_s"] == pytest.approx(net.seconds(nbytes))
    # it waits for the transfer before it can be scheduled, and still beats computing the prefix
    assert pooled.loc[3, "first_scheduled_s"] >= pooled.loc[3, "arrival_time_s"] + s["network_s"]
    assert pooled.loc[3, "ttft_s"] < local.loc[3, "ttft_s"]
    assert pooled.loc[:2, "ttft_s"].tolist() == local.loc[:2, "ttft_s"].tolist()   # the rest untouched
    assert "remote_blocks" not in run(None)[1].summary


def test_pooling_raises_the_fleets_hit_rate_under_round_robin():
    trace = shared_prefix_trace(160, rate=20.0, num_prefixes=24, seed=1)
    cfg = SimConfig(model="llama-2-7b", gpu="a100-80gb", block_size=16, num_blocks=600, enable_host_tier=True,
                    swap_space_gib=8.0)
    _, alone = run(None, trace, cfg, n=4)
    _, pooled = run(Network(), trace, cfg, n=4)
    assert pooled.summary["hit_rate"] > alone.summary["hit_rate"] + 0.05, (pooled.summary, alone.summary)
    assert pooled.summary["remote_blocks"] == pooled.requests["num_remote_blocks"].sum() > 0


def test_a_down_replica_serves_nothing_from_its_host_tier():
    with pytest.warns(ReplicaDownWarning):
        _, res = run(Network(), down_at={0: 9.0})
    assert res.requests.loc[3, "replica"] == 1
    assert res.requests.loc[3, "num_remote_blocks"] == 0 and res.requests.loc[3, "num_cached_tokens"] == 0
    assert res.summary["remote_blocks"] == 0


def test_a_failure_during_a_transfer_loses_no_request():
    # row 3's transfer to replica 1 takes ~6 ms from t=10; replica 1 goes away in the middle
    with pytest.warns(ReplicaDownWarning):
        _, res = run(Network(), down_at={1: 10.001})
    row = res.requests.loc[3]
    assert row["replica"] == 0 and row["num_reroutes"] == 1 and not row["rejected"]
    assert row["num_cached_tokens"] == 1024   # replica 0 computed prefix 0 itself
    assert row["arrival_time_s"] == 10.0


def test_bad_pools_are_refused():
    with pytest.raises(ConfigError, match="enable_host_tier=True"):
        SimFleet(SimConfig(model="llama-2-7b", gpu="a100-80gb", num_blocks=400), num_replicas=2, pooled=Network())
    other = SimConfig(model="llama-2-7b", gpu="a100-80gb", block_size=32, num_blocks=400, enable_host_tier=True)
    with pytest.raises(ConfigError, match="one block size"):
        SimFleet([CFG, other], pooled=Network())
    with pytest.raises(ConfigError, match="paged.fleet.Network"):
        SimFleet(CFG, num_replicas=2, pooled=87e9)


def test_two_transfers_from_one_node_at_once_queue_for_its_nics():
    # three replicas round robin: prefix 0 is computed on replica 0 and demoted by its next step (row 3);
    # rows 4 and 5 want it on replicas 1 and 2 at the same instant: both read node 0's NICs
    trace = pd.DataFrame(dict(arrival_time=[0.0, 0.1, 0.2, 5.0, 10.0, 10.0], prompt_tokens=[1200] * 6,
                              output_tokens=[16] * 6, prefix_id=[0, 1, 2, 3, 0, 0], prefix_tokens=[1024] * 6))
    slow = dict(nics=1, nic_gbps=10.0, efficiency=1.0)   # long transfers, so waiting shows
    fleet, queued = run(Network(**slow), trace, n=3)
    _, alone = run(Network(contention=False, **slow), trace, n=3)
    one = Network(**slow).seconds(PREFIX_BLOCKS * fleet.replicas[1].host_block_bytes)
    q, a = queued.requests, alone.requests
    assert list(q["num_remote_blocks"]) == list(a["num_remote_blocks"]) == [0, 0, 0, 0, PREFIX_BLOCKS, PREFIX_BLOCKS]
    assert queued.summary["network_s"] == pytest.approx(2 * one) == alone.summary["network_s"]
    assert queued.summary["network_wait_s"] == pytest.approx(one) and alone.summary["network_wait_s"] == 0.0
    # the second waits one transfer, then takes its own; the first is as fast as alone
    assert q.loc[5, "first_scheduled_s"] >= 10.0 + 2 * one > a.loc[5, "first_scheduled_s"]
    assert q.loc[4, "ttft_s"] == a.loc[4, "ttft_s"]
    with pytest.raises(ConfigError, match="contention"):
        Network(contention="yes")
