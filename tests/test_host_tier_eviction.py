"""The host tier past its capacity: which entry it evicts (``host_eviction``), and content ids
that survive a recompute on the GPU.

Each scenario is built so that the configured policy and LRU disagree on the victim: a test
that only fills the tier (or uses LRU) cannot tell a tier that ignores ``host_eviction`` from
one that follows it. Pure Python, manager level (``paged.core``).
"""
from __future__ import annotations

import pytest

from paged.core.block import Block
from paged.core.host_tier import HostBlock
from paged.core.kv_manager import KVCacheManager
from paged.core.request import Request


def _run(kv: KVCacheManager, rid: str, tokens: list[int]) -> list:
    """Admit ``tokens`` using any cached prefix, compute it, free it, take the step's copies;
    returns the cached blocks the request used."""
    req = Request(rid, list(tokens), max_tokens=1)
    cached = kv.find_cached_prefix(req)
    assert kv.allocate_slots(req, req.num_tokens - len(cached) * kv.block_size, cached) is not None
    kv.free(rid)
    kv.take_tier_ops()
    kv.check_invariants()
    return cached


def _host_tokens(kv: KVCacheManager) -> set[tuple[int, ...]]:
    return {e.token_ids for e in kv.host.entries.values()}


def _tier(host_eviction: str, num_blocks: int = 3) -> KVCacheManager:
    # the GPU tier is LRU in every case: only the host tier's policy varies
    return KVCacheManager(num_blocks, 2, num_cpu_blocks=2, enable_host_tier=True, hash_fn="builtin", eviction="lru",
                          host_eviction=host_eviction)


HOT, COLD = (1, 2), (5, 6)


@pytest.mark.parametrize("host_eviction, evicted", [
    ("lru", HOT),                   # demoted first: the oldest entry
    ("lfu", COLD),                  # 0 prefix hits against the hot block's 2
    ("score", COLD),                # (hits + 1) x decay^age: 1 x ~1 against 3 x ~1
    ("score:size_weight=1", COLD),  # both at depth 0: the frequency term decides
])
def test_host_tier_evicts_by_its_own_policy(host_eviction, evicted):
    """Two host entries, the hot one demoted first: LRU drops it, LFU and score drop the cold one."""
    kv = _tier(host_eviction)
    _run(kv, "hot", [*HOT, 3])
    assert [len(_run(kv, f"hit{i}", [*HOT, 9])) for i in range(2)] == [1, 1]  # two prefix hits
    _run(kv, "cold", [*COLD, 7])
    _run(kv, "fill", list(range(20, 26)))     # 3 blocks: demotes hot, then cold; the tier is full
    assert _host_tokens(kv) == {HOT, COLD} and kv.num_free_cpu_blocks == 0
    _run(kv, "one-more", [30])                # one more demotion: the tier must evict one entry
    assert kv.host.num_host_evicted_blocks == 1
    assert evicted not in _host_tokens(kv) and ({HOT, COLD} - {evicted}) <= _host_tokens(kv)
    # what the eviction means for the next request: the kept prefix is a host hit, the other is not
    kept = (HOT if evicted == COLD else COLD)
    assert [type(b) for b in kv.find_cached_prefix(Request("probe1", [*kept, 0], max_tokens=1))] == [HostBlock]
    assert kv.find_cached_prefix(Request("probe2", [*evicted, 0], max_tokens=1)) == []


@pytest.mark.parametrize("host_eviction, evicted", [
    ("lru", (3, 4)),                  # tail-first freeing demotes the child first
    ("score:size_weight=1", (1, 2)),  # equal hits: depth 0 scores lower than depth 1
    ("score:size_weight=-1", (3, 4)),  # deep blocks (leaves of the prefix tree) go first
])
def test_score_policy_weighs_depth_in_the_host_tier(host_eviction, evicted):
    """A two-block prefix in the tier (parent depth 0, child depth 1, no hits): the size term of
    the score decides the victim, against LRU's choice where the sign says so."""
    kv = _tier(host_eviction)
    _run(kv, "a", [1, 2, 3, 4, 5])
    _run(kv, "fill", list(range(20, 26)))     # demotes (3, 4) then (1, 2)
    assert _host_tokens(kv) == {(1, 2), (3, 4)}
    _run(kv, "one-more", [30])
    assert kv.host.num_host_evicted_blocks == 1 and evicted not in _host_tokens(kv)


def test_recomputing_a_host_prefix_keeps_the_rest_of_the_chain():
    """A chain [1,2] -> [3,4] -> [5,6] in the host tier; a request that bypasses the prefix cache
    recomputes the first block on the GPU. The GPU block takes over the host entry's content id,
    so the children still in the host tier remain hits for the next request."""
    kv = KVCacheManager(4, 2, num_cpu_blocks=8, enable_host_tier=True, hash_fn="builtin")  # room: no host eviction
    _run(kv, "a", [1, 2, 3, 4, 5, 6, 7])
    _run(kv, "fill", list(range(20, 28)))     # 4 blocks: a's three full blocks are demoted
    assert _host_tokens(kv) >= {(1, 2), (3, 4), (5, 6)}
    chain = kv.find_cached_prefix(Request("probe", [1, 2, 3, 4, 5, 6, 0], max_tokens=1))
    assert [type(b) for b in chain] == [HostBlock] * 3
    # recompute only the first block, without using the hit (a prompt-logprob request does this)
    req = Request("recompute", [1, 2, 8], max_tokens=1)
    assert kv.allocate_slots(req, req.num_tokens) is not None
    kv.free("recompute")
    kv.take_tier_ops()
    kv.check_invariants()
    assert (1, 2) not in _host_tokens(kv)     # one tier per block: the GPU holds it now
    after = kv.find_cached_prefix(Request("next", [1, 2, 3, 4, 5, 6, 0], max_tokens=1))
    assert [type(b) for b in after] == [Block, HostBlock, HostBlock]
    assert [b.token_ids for b in after] == [(1, 2), (3, 4), (5, 6)]
    # and the hit is usable: two blocks come back from the host tier
    use = Request("use", [1, 2, 3, 4, 5, 6, 0], max_tokens=1)
    assert kv.allocate_slots(use, 1, after) is not None
    _, tier_in, _ = kv.take_tier_ops()
    assert len(tier_in) == 2 and kv.host_cache_hits == 2 * 2
    kv.check_invariants()
