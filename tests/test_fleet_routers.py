"""Routers, cache views and the routing record, without engines: each policy's rule, the
Dynamo-style cost, SGLang's three branches, consistent hashing, the approximate view's LRU, and
bad input (unknown names, zero replicas, replicas going down)."""
from __future__ import annotations

import math
import warnings

import pytest

from paged.connect.wire import BlockRemoved, BlockStored
from paged.errors import ConfigError, NoReplicaError, ReplicaDownWarning, UnknownRequestError
from paged.fleet import ApproxCache, Dispatcher, PreciseCache, ReplicaState, gap, make_router
from paged.fleet.live import Arrival

BS = 4


def stored(tokens, parent=None, base=0):
    n = len(tokens) // BS
    return BlockStored(tuple(base + i for i in range(n)), parent, tuple(tokens[:n * BS]), BS)


def replicas(n, capacity=64, precise=True):
    return [ReplicaState(i, f"r{i}", BS, capacity, PreciseCache(BS) if precise else None) for i in range(n)]


def req(i, tokens, max_tokens=4, session=None):
    return Arrival(f"q{i}", tuple(tokens), max_tokens, session)


def test_unknown_router_zero_replicas_and_bad_options_are_config_errors():
    with pytest.raises(ConfigError, match="unknown router 'fastest'.*round_robin"):
        make_router("fastest")
    with pytest.raises(ConfigError, match="at least one replica"):
        Dispatcher(make_router("round_robin"), [])
    with pytest.raises(ConfigError, match="at least one replica"):
        make_router("round_robin").route(req(0, [1, 2]), [])
    with pytest.raises(ConfigError, match="overlap_weight"):
        make_router("kv_aware", overlap_weight=-1)
    with pytest.raises(ConfigError, match="view must be"):
        make_router("kv_aware", view="psychic")
    with pytest.raises(ConfigError, match="router 'round_robin'"):
        make_router("round_robin", temperature=1.0)
    with pytest.raises(ConfigError, match="distinct"):
        Dispatcher(make_router("round_robin"), [ReplicaState(0, "a", BS, 8), ReplicaState(1, "a", BS, 8)])
    with pytest.raises(ConfigError, match="precise"):  # no KV events, yet the precise view is asked for
        Dispatcher(make_router("kv_aware"), replicas(2, precise=False)).route(req(0, [1] * 8))


def test_round_robin_rotates_and_skips_a_replica_that_is_down():
    d = Dispatcher(make_router("round_robin"), replicas(3))
    assert [d.route(req(i, [i])) for i in range(4)] == [0, 1, 2, 0]
    with pytest.warns(ReplicaDownWarning, match="'r1' is down.*2 replica"):
        lost = d.mark_down(1, "test")
    assert lost == ["q1"]  # its unfinished request, for the caller to re-route
    assert [d.route(req(i, [i])) for i in range(4, 8)] == [2, 0, 2, 0]
    d.mark_up(1)
    assert 1 in [d.route(req(i, [i])) for i in range(8, 11)]
    with pytest.warns(ReplicaDownWarning):
        for i in (0, 1, 2):
            d.mark_down(i, "test")
    assert d.mark_down(0, "again") == []   # already down: nothing more to say
    with pytest.raises(NoReplicaError, match="all 3 replicas are down"):
        d.route(req(99, [1]))


def test_least_outstanding_and_finished_bookkeeping():
    d = Dispatcher(make_router("least_outstanding"), replicas(3))
    picks = [d.route(req(i, [i] * 8)) for i in range(3)]
    assert sorted(picks) == [0, 1, 2]
    d.finished(picks[1], "q1")
    assert d.route(req(3, [3])) == picks[1]   # the only one with fewer outstanding
    with pytest.raises(UnknownRequestError, match="not outstanding"):
        d.finished(0, "nope")
    assert d.replicas[picks[1]].view().active_blocks == math.ceil((1 + 4) / BS)


def test_least_kv_usage_follows_the_usage_given():
    d = Dispatcher(make_router("least_kv_usage"), replicas(3))
    assert d.route(req(0, [1]), usage=[0.9, 0.2, 0.5]) == 1
    assert d.route(req(1, [1]), usage=[0.1, 0.2, 0.5]) == 0


def test_session_affinity_is_consistent_hashing():
    d = Dispatcher(make_router("session_affinity"), replicas(4))
    first = {s: d.route(req(s, [1], session=f"s{s}")) for s in range(200)}
    assert len(set(first.values())) == 4                             # every replica gets sessions
    again = {s: d.route(req(1000 + s, [1], session=f"s{s}")) for s in range(200)}
    assert again == first                                             # a session sticks
    with pytest.warns(ReplicaDownWarning):
        d.mark_down(2, "test")
    after = {s: d.route(req(2000 + s, [1], session=f"s{s}")) for s in range(200)}
    moved = {s for s in first if after[s] != first[s]}
    assert moved == {s for s in first if first[s] == 2}               # only the down replica's sessions move
    assert 2 not in after.values()


def test_kv_aware_cost_is_overlap_weight_times_prefill_plus_decode_blocks():
    reps = replicas(3)
    shared = list(range(100, 116))                 # 4 blocks
    reps[2].precise.apply([stored(shared + [7] * 4)])
    d = Dispatcher(make_router("kv_aware", overlap_weight=1.0), reps)
    prompt = shared + [1, 2, 3, 4, 5, 6]           # 22 tokens: 5.5 blocks, 4 cached on r2
    assert d.route(req(0, prompt, max_tokens=2)) == 2
    dec = d.router.decisions[-1]
    assert dec.overlaps == (0, 0, 4)
    assert dec.scores == pytest.approx((22 / 4 + 6, 22 / 4 + 6, 22 / 4 - 4 + 6))
    row = d.frame().iloc[-1]
    assert (row["overlap_blocks"], row["precise_blocks"], row["approx_blocks"]) == (4, 4, 0)
    # r2 now holds the request (6 decode blocks): with weight 1 the next one prefers an idle replica
    # once its decode load outweighs the cached prefix; with a large weight it stays (pure affinity)
    for i in range(1, 3):
        d.route(req(i, prompt, max_tokens=2))
    assert [r[3] for r in d.rows] == [2, 0, 1]
    greedy = Dispatcher(make_router("kv_aware", overlap_weight=100.0), replicas(3))
    greedy.replicas[2].precise.apply([stored(shared)])
    assert [greedy.route(req(i, prompt, max_tokens=2)) for i in range(3)] == [2, 2, 2]


def test_kv_aware_softmax_is_seeded_and_prefers_the_cheaper_replica():
    def picks(seed):
        reps = replicas(2)
        reps[0].precise.apply([stored(list(range(40)))])
        d = Dispatcher(make_router("kv_aware", temperature=0.5, seed=seed), reps)
        out = []
        for i in range(200):           # one at a time: no decode load builds up
            out.append(d.route(req(i, list(range(40)), max_tokens=1)))
            d.finished(out[-1], f"q{i}")
        return out
    a = picks(1)
    assert a == picks(1) and a != picks(2)
    assert 0 < a.count(1) < a.count(0)   # both get traffic, the cached one more


def test_cache_aware_branches_balance_cache_and_space():
    r = make_router("cache_aware", cache_threshold=0.5, balance_abs=2, balance_rel=1.5, view="precise")
    reps = replicas(2)
    reps[1].precise.apply([stored(list(range(16)))])
    d = Dispatcher(r, reps)
    assert d.route(req(0, list(range(16)) + [9])) == 1 and r.decisions[-1].reason == "cache"   # 16/17 > 0.5
    assert d.route(req(1, [5] * 17)) == 0 and r.decisions[-1].reason == "space"   # no match: the emptier view
    for i in range(2, 6):
        d.route(req(i, list(range(16)) + [9]))     # loads 1 on r0, climbing on r1 (cache branch)
    assert r.decisions[-1].reason == "balance" and r.decisions[-1].replica == 0
    loads = [len(x.outstanding) for x in reps]
    assert max(loads) - min(loads) <= 3


def test_precise_view_follows_stores_and_removals():
    c = PreciseCache(BS)
    assert c.match_blocks(list(range(12))) == 0        # nothing reported yet
    c.apply([stored(list(range(12)))])
    assert c.match_blocks(list(range(12)) + [5]) == 3
    c.apply([BlockRemoved((1,))])                       # the middle block went: the chain breaks there
    assert c.match_blocks(list(range(12))) == 1 and c.num_blocks() == 2
    assert set(c.live.values()) == c.forest.live == {0, 2}
    c.apply([stored(list(range(50, 54)), parent=77, base=9)])   # parent never seen (joined late)
    assert c.match_blocks(list(range(50, 54))) == 0 and c.num_blocks() == 3
    c.clear()
    assert c.match_blocks(list(range(12))) == 0


def test_approximate_view_is_an_lru_of_what_was_sent_tail_first():
    a = ApproxCache(BS, capacity_blocks=5)
    p, q = list(range(12)), list(range(50, 62))       # 3 blocks each
    a.record(p)
    a.record(q)                                        # 6 blocks > 5: p's last block goes
    assert (a.match_blocks(p), a.match_blocks(q), a.num_evicted) == (2, 3, 1)
    a.record(p[:8])                                    # p's first two blocks are recent again
    a.record(list(range(80, 88)))                      # q's tail goes first, then its middle
    assert a.match_blocks(p) == 2 and a.match_blocks(q) == 1
    with pytest.raises(ConfigError, match="capacity_blocks"):
        ApproxCache(BS, -1)
    with pytest.raises(ConfigError, match="block_size"):
        PreciseCache(0)


def test_gap_counts_where_the_guess_and_the_stream_disagree():
    precise, approx = PreciseCache(BS), ApproxCache(BS, 100)
    p, q = list(range(8)), list(range(20, 28))
    precise.apply([stored(p)])
    approx.record(p)
    approx.record(q)                                   # sent, but the replica never reported it
    g = gap(precise, approx, [p, q, [9] * 8])
    assert g == {"prompts": 3, "over_blocks": 2, "under_blocks": 0, "agree": pytest.approx(2 / 3)}


def test_the_routing_record_has_one_row_per_decision_and_per_candidate():
    d = Dispatcher(make_router("round_robin"), replicas(3))
    for i in range(5):
        d.route(req(i, [i] * 5), time_s=float(i))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReplicaDownWarning)
        d.mark_down(0, "test")
    d.route(req(5, [1]))
    f, c = d.frame(), d.candidates_frame()
    assert list(f["replica"]) == [0, 1, 2, 0, 1, 2] and len(c) == 6 * 3
    last = c[c["request_id"] == "q5"]
    assert last["chosen"].sum() == 1 and math.isnan(last[last["replica"] == 0]["score"].iloc[0])
