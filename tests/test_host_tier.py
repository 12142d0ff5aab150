"""Host tier in the core (pure Python): one tier per block, copies planned in a safe order,
chains that survive moves, the shared CPU pool, the threshold knob and the score policy."""
from __future__ import annotations

import random

import pytest

from paged.core.eviction import LRUPolicy, ScorePolicy, make_policy
from paged.core.host_tier import HostBlock
from paged.core.kv_manager import KVCacheManager
from paged.core.request import Request
from paged.core.scheduler import Scheduler, SchedulerConfig
from paged.errors import ConfigError


def _fill(kv, rid, tokens):
    req = Request(rid, list(tokens), max_tokens=1)
    cached = kv.find_cached_prefix(req)
    assert kv.allocate_slots(req, req.num_tokens - len(cached) * kv.block_size, cached) is not None
    req.num_computed_tokens = req.num_tokens
    return req, cached


def _kv(num_blocks=4, num_cpu=4, **kw):
    return KVCacheManager(num_blocks, 2, num_cpu_blocks=num_cpu, enable_host_tier=True, hash_fn="builtin", **kw)


def test_eviction_demotes_and_a_hit_brings_back():
    kv = _kv()
    _fill(kv, "a", [1, 2, 3, 4, 5])          # blocks [1,2] [3,4] hashed, [5] partial
    kv.free("a")
    tier_out, _, _ = kv.take_tier_ops()
    assert tier_out == []
    _fill(kv, "b", [9, 8, 7, 6, 5, 4, 3])    # needs 4 blocks: evicts a's two hashed blocks
    kv.check_invariants()
    tier_out, tier_in, _ = kv.take_tier_ops()
    assert len(tier_out) == 2 and tier_in == [] and kv.num_host_cached_blocks == 2
    kv.free("b")
    req = Request("c", [1, 2, 3, 4, 6], max_tokens=1)
    hit = kv.find_cached_prefix(req)
    assert [type(h) for h in hit] == [HostBlock, HostBlock]   # found in the host tier
    kv.allocate_slots(req, 1, hit)
    kv.check_invariants()
    tier_out2, tier_in, _ = kv.take_tier_ops()
    cpus = {cpu for _, cpu in tier_out}
    assert len(tier_in) == 2 and {cpu for cpu, _ in tier_in} == cpus
    gpus = [g for _, g in tier_in]
    assert kv.block_table("c")[:2] == gpus
    assert kv.host_cache_hits == 4 and kv.prefix_cache_hits == 4
    # one tier per block: the hashes are in the GPU index again, not in the host tier
    assert kv.num_host_cached_blocks == len(tier_out2)
    # tier-out copies never write a CPU block this plan's tier-ins read (released after the plan)
    assert not {c for _, c in tier_out2} & cpus


def test_chain_survives_the_parent_moving_after_the_child():
    """Tail-first freeing demotes the child first, then the parent: the hit must still follow
    the chain (content ids travel with the content)."""
    kv = _kv(num_blocks=3, num_cpu=4)
    _fill(kv, "a", [1, 2, 3, 4, 5])
    kv.free("a")
    _fill(kv, "b", [7, 7, 7])                 # 2 blocks: 1 plain + evicts [3,4] (child) first
    kv.free("b")
    _fill(kv, "c", [8, 8, 8, 8, 8])           # 3 blocks: evicts the rest, incl. [1,2] (parent)
    kv.free("c")
    kv.check_invariants()
    hit = kv.find_cached_prefix(Request("d", [1, 2, 3, 4, 9], max_tokens=1))
    assert len(hit) == 2 and all(isinstance(h, HostBlock) for h in hit)
    # a child of different parent content is not a hit
    assert kv.find_cached_prefix(Request("e", [5, 5, 3, 4, 9], max_tokens=1)) == []


def test_gpu_indexing_a_host_hash_keeps_one_tier():
    kv = _kv(num_blocks=3, num_cpu=4)
    _fill(kv, "a", [1, 2, 3, 4, 5])
    kv.free("a")
    _fill(kv, "b", [7, 7, 7, 7, 7])           # demotes a's blocks
    kv.free("b")
    kv.take_tier_ops()
    req = Request("c", [1, 2, 3, 4, 5], max_tokens=1)
    kv.enable_prefix_caching = True
    # compute the prompt without using the hit: the GPU indexes the same hashes
    assert kv.allocate_slots(req, 5) is not None
    kv.check_invariants()                      # asserts no hash is in both tiers
    hashes = {kv.pool.blocks[b].block_hash for b in kv.block_table("c")[:2]}
    assert None not in hashes and not hashes & set(kv.host.entries)
    assert kv.num_host_cached_blocks == 2      # b's blocks, demoted by c's allocation


def test_swap_out_evicts_tier_entries_for_room():
    kv = _kv(num_blocks=4, num_cpu=2)
    _fill(kv, "a", [1, 2, 3, 4])
    kv.free("a")
    _fill(kv, "b", [5, 6, 7, 8, 9, 9, 9])     # 4 blocks: both of a's demoted, CPU pool full
    kv.take_tier_ops()
    assert kv.num_host_cached_blocks == 2 and kv.num_free_cpu_blocks == 0
    mapping = kv.swap_out("b")                 # 4 blocks > 2 CPU blocks even after evicting
    assert mapping is None and kv.num_host_cached_blocks == 2
    kv.free("b")
    _fill(kv, "c", [5, 6])
    assert kv.swap_out("c") is not None        # one entry evicted for the preempted request
    kv.check_invariants()
    _, _, evicted = kv.take_tier_ops()
    assert evicted == 1 and kv.num_host_cached_blocks == 1


def test_threshold_demotes_proactively():
    kv = _kv(num_blocks=8, num_cpu=8, host_tier_threshold=0.5)
    _fill(kv, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    kv.free("a")
    assert kv.num_cached_free_blocks == 4
    _fill(kv, "b", [11, 12, 13])               # used 2 + cached 4 = 6 > 0.5 x 8
    assert kv.demote_above_threshold() == 2
    kv.check_invariants()
    out, _, _ = kv.take_tier_ops()
    assert len(out) == 2 and kv.num_cached_free_blocks == 2 and kv.num_host_cached_blocks == 2
    off = _kv(num_blocks=8, num_cpu=8)
    assert off.demote_above_threshold() == 0


def test_scheduler_plans_tier_copies_and_nothing_leaks():
    rng = random.Random(1)
    for policy in ("lru", "score", "score:size_weight=2", "lfu"):
        kv = KVCacheManager(20, 4, num_cpu_blocks=12, enable_host_tier=True, eviction=policy, host_eviction=policy,
                            hash_fn="builtin", host_tier_threshold=0.8)
        s = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=32, preemption_mode="swap"))
        prefixes = [[rng.randrange(50) for _ in range(8)] for _ in range(5)]
        for i in range(40):
            s.add_request(Request(str(i), prefixes[rng.randrange(5)] + [rng.randrange(50)] * rng.randrange(1, 5),
                                  rng.randrange(1, 5)))
        moved_in = 0
        while s.has_unfinished_requests():
            plan = s.schedule()
            # writes (tier_out, swap_out) are applied before reads (swap_in, tier_in): a host block
            # read here was written by no copy of this plan, or (demoted, then hit in the same
            # plan) by exactly the tier-out that holds the content it reads
            outs = [c for _, c in plan.tier_out]
            assert len(set(outs + [c for _, c in plan.swap_out])) == len(outs) + len(plan.swap_out)
            assert not {c for c, _ in plan.swap_in} & (set(outs) | {c for _, c in plan.swap_out})
            assert not {c for c, _ in plan.tier_in} & {c for _, c in plan.swap_out}
            moved_in += len(plan.tier_in)
            s.update(plan, {c.request_id: 3 for c in plan.scheduled if c.samples})
            kv.check_invariants()
        assert moved_in > 0 and kv.host_cache_hits > 0, policy
        assert kv.num_used_blocks == 0
        assert kv.num_free_cpu_blocks + kv.num_host_cached_blocks == kv.num_cpu_blocks


def test_default_is_no_tier_and_config_errors():
    kv = KVCacheManager(4, 2, num_cpu_blocks=4)
    assert kv.host is None and kv.take_tier_ops() == ([], [], 0) and kv.num_host_cached_blocks == 0
    with pytest.raises(ConfigError, match="num_cpu_blocks"):
        KVCacheManager(4, 2, enable_host_tier=True)
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        KVCacheManager(4, 2, num_cpu_blocks=2, enable_host_tier=True, enable_prefix_caching=False)
    with pytest.raises(ConfigError, match="host_tier_threshold"):
        KVCacheManager(4, 2, num_cpu_blocks=2, enable_host_tier=True, host_tier_threshold=1.5)


class _B:
    def __init__(self, i, hits, last, depth):
        self.block_id, self.hits, self.last_access, self.depth = i, hits, last, depth
        self.prev = self.next = None


def test_score_policy_matches_its_formula():
    p = ScorePolicy(freq_weight=1.0, decay=0.9, size_weight=0.5)
    blocks = [_B(i, hits=i % 3, last=i * 2, depth=i % 4) for i in range(12)]
    for b in blocks:
        p.add(b)
    p.remove(blocks[5])
    now = 22
    expect = sorted((b for b in blocks if b.block_id != 5),
                    key=lambda b: ((b.hits + 1) * 0.9 ** (now - b.last_access) + 0.5 * b.depth, b.last_access))
    assert [b.block_id for b in p] == [b.block_id for b in expect]
    assert [p.pop().block_id for _ in range(len(p))] == [b.block_id for b in expect]


def test_make_policy_specs():
    p = make_policy("score:decay=0.95,size_weight=-1,freq_weight=2")
    assert isinstance(p, ScorePolicy) and (p.decay, p.size_weight, p.freq_weight) == (0.95, -1.0, 2.0)
    assert isinstance(make_policy("lru"), LRUPolicy)
    for bad in ("score:decay", "score:nope=1", "score:decay=2", "score:freq_weight=0", "mru"):
        with pytest.raises(ConfigError):
            make_policy(bad)


def test_reset_prefix_cache_clears_both_tiers():
    kv = _kv(num_blocks=3, num_cpu=4)
    _fill(kv, "a", [1, 2, 3, 4, 5])
    kv.free("a")
    _fill(kv, "b", [7, 7, 7, 7, 7])
    kv.free("b")
    kv.take_tier_ops()
    assert kv.num_host_cached_blocks == 2 and kv.num_cached_free_blocks == 2
    assert kv.reset_prefix_cache() == 4
    assert kv.num_host_cached_blocks == 0 and kv.num_free_cpu_blocks == 4
    assert kv.find_cached_prefix(Request("c", [1, 2, 3, 4, 5], max_tokens=1)) == []
    kv.check_invariants()


@pytest.mark.parametrize("threshold", [1.0, 0.6])
def test_scheduled_plans_through_the_shadow_store(threshold):
    """Whole plans (one step's tier copies, swaps and CoW batched, applied in the runner's order)
    through the shadow store: every chunk reads K/V computed from exactly its tokens, so no
    tier-out lands on a host block the same plan still reads and no hit reads an empty block."""
    from shadow import ShadowKV
    rng = random.Random(7)
    for policy in ("lru", "score"):
        kv = KVCacheManager(16, 4, num_cpu_blocks=10, enable_host_tier=True, eviction=policy, host_eviction=policy,
                            hash_fn="builtin", host_tier_threshold=threshold)
        shadow = ShadowKV(kv)
        s = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=24, preemption_mode="swap"))
        prefixes = [[rng.randrange(40) for _ in range(8)] for _ in range(6)]
        for i in range(60):
            s.add_request(Request(str(i), prefixes[rng.randrange(6)] + [rng.randrange(40)] * rng.randrange(1, 6),
                                  rng.randrange(1, 6)))
        tier_in = swaps = 0
        while s.has_unfinished_requests():
            plan = s.schedule()
            shadow.apply(plan)  # asserts what each chunk would attend to
            tier_in += len(plan.tier_in)
            swaps += len(plan.swap_out)
            s.update(plan, {c.request_id: 3 for c in plan.scheduled if c.samples})
            kv.check_invariants()
        assert tier_in > 0 and swaps > 0, (policy, tier_in, swaps)
        assert kv.num_used_blocks == 0
