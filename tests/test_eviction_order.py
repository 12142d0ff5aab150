"""Eviction order where frequency and recency disagree, against tiny reference models.

The reference keeps its own hit counts and access clock (one tick per allocated block,
per prefix hit and per block whose ref count drops to 0, as `BlockPool` documents), so a
policy that ignores hits, or a pool that stops counting them, picks a different victim.
"""
from __future__ import annotations

import math
import random

import pytest

from paged import BlockPool, KVCacheManager, Request
from paged.core.eviction import LFUPolicy, LRUPolicy, WeightedPolicy


class RefPool:
    """What the pool's policy must see: hits since allocation and last access time."""

    def __init__(self) -> None:
        self.clock = 0
        self.hits: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.cached: set[int] = set()

    def _tick(self, bid: int) -> None:
        self.clock += 1
        self.last[bid] = self.clock

    def allocate(self, bid: int) -> None:
        self.cached.discard(bid)
        self.hits[bid] = 0
        self._tick(bid)

    def touch(self, bid: int) -> None:
        self.cached.discard(bid)
        self.hits[bid] += 1
        self._tick(bid)

    def freed(self, bid: int) -> None:
        self.cached.add(bid)
        self._tick(bid)

    def victim(self, policy: str, decay: float = 0.9) -> int:
        if policy == "lru":
            return min(self.cached, key=lambda b: self.last[b])
        if policy == "lfu":  # fewest hits, then least recent
            return min(self.cached, key=lambda b: (self.hits[b], self.last[b]))
        # frequency x recency decay: (hits + 1) * decay ** (now - last); lowest goes first
        return min(self.cached, key=lambda b: (self.hits[b] + 1) * decay ** (self.clock - self.last[b]))


def make(policy: str, decay: float = 0.9):
    return {"lru": LRUPolicy, "lfu": LFUPolicy}[policy]() if policy != "weighted" else WeightedPolicy(decay)


def drive(policy: str, seed: int, num_blocks: int = 6, steps: int = 400, decay: float = 0.9) -> int:
    """Random allocate / prefix hit / share / free over a pool of hashed blocks; every
    eviction is checked against the reference. Returns the number of evictions seen."""
    rng = random.Random(seed)
    pool = BlockPool(num_blocks, eviction=make(policy, decay))
    ref = RefPool()
    refs: dict[int, int] = {}            # block id -> holders
    blocks = {}
    serial = 0
    evictions = 0
    for _ in range(steps):
        op = rng.random()
        cached = sorted(ref.cached)
        if op < 0.4 and pool.num_free:
            fresh = pool._next_fresh < num_blocks
            expected = None if fresh else ref.victim(policy, decay)
            (b,) = pool.allocate(1)
            if expected is not None:
                evictions += 1
                assert b.block_id == expected, (policy, seed, b.block_id, expected, ref.hits, ref.last)
            serial += 1
            assert pool.register(b, ("h", serial), (serial,))
            blocks[b.block_id] = b
            refs[b.block_id] = 1
            ref.allocate(b.block_id)
        elif op < 0.55 and cached:        # a prefix hit revives a cached-free block
            bid = rng.choice(cached)
            pool.touch(blocks[bid])
            refs[bid] = 1
            ref.touch(bid)
        elif op < 0.6 and refs:          # a hit on a block still in use also counts
            bid = rng.choice(sorted(refs))
            pool.touch(blocks[bid])
            refs[bid] += 1
            ref.touch(bid)
        elif refs:
            bid = rng.choice(sorted(refs))
            pool.free(blocks[bid])
            refs[bid] -= 1
            if not refs[bid]:
                del refs[bid]
                ref.freed(bid)
        pool.check_invariants()
    return evictions


@pytest.mark.parametrize("policy", ["lru", "lfu", "weighted"])
@pytest.mark.parametrize("seed", range(4))
def test_victim_order_matches_the_reference_model(policy, seed):
    """Catches an LFU whose key is `last_access` alone (ignores hits), a WeightedPolicy
    whose key drops `log(hits + 1)`, and a pool whose `touch` stops counting hits: each
    evicts a block other than the reference's victim within the first few evictions."""
    assert drive(policy, seed) > 20


def cached_free(pool: BlockPool, specs):
    """Blocks given as (hits, free order) become cached-free in that order; returns them."""
    out = []
    for bid, (hits, _) in enumerate(specs):
        (b,) = pool.allocate(1)
        pool.register(b, ("h", bid), (bid,))
        out.append(b)
    for b, (hits, _) in zip(out, specs):
        for _ in range(hits):
            pool.touch(b)
            pool.free(b)
    for _, b in sorted(zip([order for _, order in specs], out), key=lambda t: t[0]):
        pool.free(b)
    return out


def pop_order(pool: BlockPool) -> list[int]:
    return [pool.cached_free.pop().block_id for _ in range(len(pool.cached_free))]


def test_lfu_keeps_the_old_frequent_block_over_the_recent_unused_one():
    """Block 0 has 3 hits but was freed first; block 1 has none and was freed last.
    LRU evicts 0 first, LFU must evict 1 first. Catches LFU ignoring hits."""
    lru = BlockPool(3, eviction="lru")
    cached_free(lru, [(3, 0), (0, 2), (1, 1)])
    assert pop_order(lru) == [0, 2, 1]
    lfu = BlockPool(3, eviction="lfu")
    cached_free(lfu, [(3, 0), (0, 2), (1, 1)])
    assert pop_order(lfu) == [1, 2, 0]


def test_weighted_trades_hits_against_age():
    """decay 0.9: 3 hits outweigh a few ticks of age (0 kept, the recent unused 1 goes
    first); with decay 0.1 age dominates and the order is LRU's. Catches a weighted
    policy that ignores hits (it would give the LRU order for both decays)."""
    for decay, expected in ((0.9, [1, 2, 0]), (0.1, [0, 2, 1])):
        pool = BlockPool(3, eviction=WeightedPolicy(decay))
        cached_free(pool, [(3, 0), (0, 2), (1, 1)])
        ref_scores = {}
        for bid in range(3):
            b = pool.blocks[bid]
            ref_scores[bid] = (b.hits + 1) * decay ** (pool._clock - b.last_access)
        assert sorted(ref_scores, key=ref_scores.get) == expected
        assert pop_order(pool) == expected


def test_weighted_key_is_log_of_the_documented_score():
    decay = 0.8
    pol = WeightedPolicy(decay)
    from paged.core.block_pool import Block
    b = Block(0)
    b.hits, b.last_access = 4, 7
    assert pol.key(b) == pytest.approx(math.log(5) + 7 * math.log(1 / decay))


class ParentsFirst(LRUPolicy):
    """Evicts the cached-free block with the lowest id: with blocks allocated in prefix
    order, a parent goes before its child (LRU frees tail first and never does this)."""

    def pop(self):
        victim = min(self, key=lambda b: b.block_id)
        self.remove(victim)
        return victim


def sum_hash(parent, token_ids, extra_keys):
    """Ignores the parent and collides on token sums, so only verification keeps hits right."""
    return ("sum", sum(token_ids))


def tokens_hash(parent, token_ids, extra_keys):
    """Ignores the parent (a block's hash is its own tokens)."""
    return ("tokens", tuple(token_ids))


def _fill(kv: KVCacheManager, rid: str, tokens) -> Request:
    req = Request(rid, list(tokens), max_tokens=1)
    cached = kv.find_cached_prefix(req)
    assert kv.allocate_slots(req, req.num_tokens - len(cached) * kv.block_size, cached) == []
    req.num_computed_tokens = req.num_tokens
    return req


def test_a_child_is_not_a_hit_after_its_parent_was_evicted_and_reused():
    """A = [1,2][3,4] -> blocks 0, 1, both freed. B = [2,1] misses (same hash, other
    tokens) and ParentsFirst evicts block 0, the parent, which B refills with [2,1] and
    indexes under the same hash. C = [2,1][3,4] matches block 0 on hash and tokens, then
    block 1 on hash and tokens, and block 1 was computed after block 0 -- but block 0 was
    reused since (its content id changed): block 1's K/V was computed after [1,2], so the
    hit must stop at one block. Catches verifying a parent by block identity alone."""
    kv = KVCacheManager(2, 2, hash_fn=sum_hash, eviction=ParentsFirst())
    _fill(kv, "a", [1, 2, 3, 4])
    first, second = kv.block_table("a")
    kv.free("a")
    assert kv.num_cached_free_blocks == 2
    _fill(kv, "b", [2, 1])                          # evicts block 0 (the parent) only
    assert kv.block_table("b") == [first]
    assert kv.pool.blocks[second].block_hash is not None
    assert kv.pool.blocks[second].parent_cid not in (0, None, kv.pool.blocks[first].cid)  # the old [1,2]
    kv.free("b")
    hit = kv.find_cached_prefix(Request("c", [2, 1, 3, 4, 5], max_tokens=1))
    assert [x.block_id for x in hit] == [first]


def test_a_child_of_another_parent_block_is_not_a_hit():
    """A = [1,2][3,4], B = [5,6][8]: with a parent-blind hash C = [5,6][3,4] finds B's first
    block, then A's second block on hash and tokens, but that block follows A's first
    block. Catches dropping the `parent_cid` check."""
    kv = KVCacheManager(8, 2, hash_fn=tokens_hash)
    _fill(kv, "a", [1, 2, 3, 4, 6])
    _fill(kv, "b", [5, 6, 8])
    hit = kv.find_cached_prefix(Request("c", [5, 6, 3, 4, 5], max_tokens=1))
    assert [x.block_id for x in hit] == [kv.block_table("b")[0]]
