"""Block pool, eviction policies, prefix cache and manager edge cases."""
from __future__ import annotations

import pytest

from paged import (BlockPool, BlockStateError, CacheInUseError, ConfigError, DuplicateRequestError,
                   InvalidRequestError, KVCacheManager, Recorder, Request, UnknownRequestError)
from paged.core.plan import Batch
from paged.engine.batch import build_batch
from paged import telemetry


def fill(kv: KVCacheManager, rid: str, tokens, salt=None) -> Request:
    req = Request(rid, tokens, max_tokens=1, cache_salt=salt)
    cached = kv.find_cached_prefix(req)
    start = len(cached) * kv.block_size
    assert kv.allocate_slots(req, req.num_tokens - start, cached) == []
    req.num_computed_tokens = req.num_tokens
    return req


@pytest.mark.parametrize("bad", [0, 3, 6, -4, 1.0])
def test_block_size_must_be_a_power_of_two(bad):
    with pytest.raises(ConfigError, match="power of two"):
        KVCacheManager(8, bad)


def test_num_blocks_must_be_positive():
    with pytest.raises(ConfigError, match="num_blocks"):
        KVCacheManager(0, 4)


def test_never_hashed_blocks_are_reused_before_cached_ones():
    kv = KVCacheManager(4, 2)
    fill(kv, "a", [1, 2, 3, 4])          # two full, hashed blocks
    cached = set(kv.block_table("a"))
    kv.free("a")
    fill(kv, "b", [9, 9, 8, 8])          # takes the two never-used blocks
    assert not set(kv.block_table("b")) & cached
    assert kv.num_cached_free_blocks == 2


def test_tail_first_free_keeps_the_prefix_longest():
    kv = KVCacheManager(3, 2)
    fill(kv, "a", [1, 2, 3, 4, 5, 6])
    first, second, third = kv.block_table("a")
    kv.free("a")
    fill(kv, "b", [7, 7])                # evicts the LRU block: the tail of a
    assert kv.block_table("b") == [third]
    req = Request("c", [1, 2, 3, 4, 5, 6, 0], max_tokens=1)
    assert [b.block_id for b in kv.find_cached_prefix(req)] == [first, second]


def test_lfu_evicts_the_least_hit_block():
    kv = KVCacheManager(3, 2, eviction="lfu")
    fill(kv, "a", [1, 2])
    fill(kv, "b", [3, 4])
    a, b = kv.block_table("a")[0], kv.block_table("b")[0]
    kv.free("a"); kv.free("b")
    for i in range(3):                   # three hits on a's block
        fill(kv, f"h{i}", [1, 2, 9]); kv.free(f"h{i}")
    fill(kv, "x", [5, 6]); fill(kv, "y", [7, 8])   # first takes the plain block, then evicts
    assert a not in (kv.block_table("x") + kv.block_table("y"))
    assert b in (kv.block_table("x") + kv.block_table("y"))


def test_weighted_policy_prefers_recent_over_old_frequent():
    kv = KVCacheManager(3, 1, eviction="weighted")
    kv.pool.cached_free._log_inv_decay = 2.0   # fast decay: recency dominates
    fill(kv, "old", [1]); kv.free("old")
    fill(kv, "h", [1, 5]); kv.free("h")        # one hit on [1]
    fill(kv, "new", [2]); kv.free("new")
    fill(kv, "x", [3, 3])                      # needs 2 blocks: 1 plain (from "h"'s suffix) + 1 evicted
    remaining = {tuple(b.token_ids) for b in kv.pool.index.values()}
    assert (2,) in remaining and (1,) not in remaining


def test_double_free_and_freeing_in_use_blocks_raise():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.free(b)
    with pytest.raises(BlockStateError, match="double free"):
        pool.free(b)
    kv = KVCacheManager(4, 2)
    fill(kv, "a", [1, 2, 3])
    with pytest.raises(CacheInUseError):
        kv.reset_prefix_cache()
    kv.free("a")
    with pytest.raises(UnknownRequestError):
        kv.free("a")
    assert kv.reset_prefix_cache() == 1
    assert kv.num_cached_free_blocks == 0


def test_bad_requests_leave_the_manager_unchanged():
    kv = KVCacheManager(4, 4, max_model_len=16)
    fill(kv, "a", [1, 2, 3])
    before = (kv.num_free_blocks, kv.block_table("a"))
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        kv.check_request(Request("big", list(range(1, 18)), max_tokens=1))
    with pytest.raises(InvalidRequestError, match="num_new_tokens"):
        kv.allocate_slots(Request("n", [1], max_tokens=1), -1)
    with pytest.raises(DuplicateRequestError):
        kv.fork("a", "a")
    with pytest.raises(UnknownRequestError):
        kv.fork("nope", "b")
    small = KVCacheManager(2, 4, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="pool has only 2"):
        small.check_request(Request("x", list(range(1, 9)), max_tokens=4))
    assert (kv.num_free_blocks, kv.block_table("a")) == before
    kv.check_invariants()


def test_salt_separates_caches_and_colliding_hash_is_verified():
    kv = KVCacheManager(16, 2)
    fill(kv, "a", [1, 2, 3, 4, 5], salt="alice")
    assert kv.find_cached_prefix(Request("b", [1, 2, 3, 4, 5], cache_salt="bob")) == []
    assert len(kv.find_cached_prefix(Request("c", [1, 2, 3, 4, 5], cache_salt="alice"))) == 2
    clash = KVCacheManager(16, 2, hash_fn=lambda parent, tokens, extra: 0)
    fill(clash, "a", [1, 2, 3, 4, 5])
    assert clash.find_cached_prefix(Request("x", [2, 1, 3, 4, 5])) == []   # same hash, other tokens
    assert len(clash.find_cached_prefix(Request("y", [1, 2, 9, 9, 9]))) == 1


def test_batch_metadata_matches_block_tables():
    kv = KVCacheManager(16, 4)
    a = Request("a", list(range(1, 11)), max_tokens=4)   # 10 tokens: 3 blocks
    b = Request("b", [7, 8], max_tokens=4)
    kv.allocate_slots(a, 10); kv.allocate_slots(b, 2)
    planned = Batch()
    planned.add(a, 0, 10, True, kv.blocks_of("a"))
    planned.add(b, 0, 2, True, kv.blocks_of("b"))
    batch = build_batch(planned, kv.block_size)
    ta, tb = kv.block_table("a"), kv.block_table("b")
    assert batch.slot_mapping.tolist() == [ta[p // 4] * 4 + p % 4 for p in range(10)] + [tb[0] * 4, tb[0] * 4 + 1]
    assert batch.query_start_loc.tolist() == [0, 10, 12]
    assert batch.seq_lens.tolist() == [10, 2]
    assert batch.block_tables.dtype.is_signed and batch.block_tables.shape == (2, 3)
    assert batch.block_tables.tolist() == [ta, tb + [0, 0]]
    assert batch.sample_indices.tolist() == [9, 11]


def test_telemetry_frames_and_metrics():
    rec = Recorder()
    kv = KVCacheManager(8, 4, recorder=rec)
    fill(kv, "a", [1, 2, 3, 4, 5])
    fill(kv, "b", [1, 2, 3, 4, 6])
    rec.step = 3
    kv.free("a"); kv.free("b")
    df = telemetry.events_frame(rec)
    assert set(df["kind"]) >= {"allocate", "free", "prefix_hit", "cache_block", "alloc_latency"}
    life = telemetry.block_lifetimes(df)
    assert (life["lifetime_steps"] == 3).all()
    m = telemetry.metrics(kv)
    assert m["prefix_cache_queries"] == 10 and m["prefix_cache_hits"] == 4 and m["kv_cache_usage_perc"] == 0
    assert len(telemetry.allocation_latency_ns(df)) == 2


def test_token_usage_shows_internal_fragmentation():
    kv = KVCacheManager(8, 4)
    fill(kv, "a", [1, 2, 3, 4, 5])      # 5 tokens in 2 blocks of 4
    assert kv.kv_cache_usage_perc == 2 / 8
    assert kv.token_usage == 5 / 8


def _pool_state(pool: BlockPool):
    return (pool.num_used, pool.num_cached_free, pool.free_block_ids(), sorted(pool.cached_free_block_ids()),
            [(b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks if b is not None], dict(pool.index))


def test_pool_moves_a_block_and_drops_entries_through_its_own_methods():
    """What compaction and the manager need, as pool methods: relocate, evict a cached-free block,
    uncache an in-use one; each keeps the invariants, and a bad call changes nothing."""
    rec = Recorder()
    pool = BlockPool(8, recorder=rec)
    a, b, c = pool.allocate(3, "r")
    assert pool.register(b, "hb", (1,)) and pool.register(c, "hc", (2,), b.cid, depth=1)
    pool.free(b)                                   # b: cached-free; a, c in use
    assert pool.num_created == 3 and pool.free_block_ids() == list(range(3, 8))
    assert pool.cached_free_block_ids() == {1} and pool.num_cached_free == 1
    pool.take_freed()
    before = _pool_state(pool)
    for bad in [(1, 5), (0, 2), (0, 8), (9, 3)]:   # src not in use, dst in use, out of range
        with pytest.raises(BlockStateError):
            pool.relocate(*bad)
        assert _pool_state(pool) == before
    pool.relocate(2, 6)                            # c (in use, hashed) to a never-used id
    assert c.block_id == 6 and pool.blocks[6] is c and pool.index["hc"] is c and c.parent_cid == b.cid
    assert pool.blocks[2].ref_cnt == 0 and pool.take_freed() == [2]
    assert pool.num_created == 7 and sorted(pool.free_block_ids()) == [2, 3, 4, 5, 7]
    pool.check_invariants()
    with pytest.raises(BlockStateError, match="not cached-free"):
        pool.evict_cached(0)
    pool.evict_cached(1)                           # b: entry dropped, plain free, an evict event
    assert "hb" not in pool.index and b.block_hash is None and 1 in pool.free_block_ids()
    assert rec.events[-1][1] == "evict"
    assert pool.uncache(6) and "hc" not in pool.index and c.ref_cnt == 1   # in use: keeps its holder
    assert not pool.uncache(6) and not pool.uncache(5)
    pool.check_invariants()


def test_uncache_of_a_cached_free_block_makes_it_plain_free():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.register(b, "h", (1,))
    pool.free(b)
    assert pool.uncache(b.block_id) and pool.num_cached_free == 0 and b.block_id in pool.free_block_ids()
    pool.check_invariants()
