"""The hybrid pool: sliding-window blocks freed as they leave the window, prefix hits that keep it.

Property tests (hypothesis) over small layouts (a full-attention group beside sliding, full or
state groups), block sizes, windows, prompt lengths, chunk sizes and pool sizes:
- after every allocation a sliding group holds exactly the blocks some query from the request's
  next position on can read (``(p + 1) x block_size > computed - window + 1``), frees every other
  one, and the full groups keep every block; the pool's counts and ref counts agree;
- a prefix hit on a hybrid model never hands out a block whose window content is gone: each
  sliding group's last ``cdiv(window - 1, block_size)`` blocks before the hit's end are cached,
  hold the prompt's own tokens and belong to the very prefix the manager's table verified; a
  model with state layers gets no hit (its state at that position is not kept).
"""
from __future__ import annotations

import random

from hypothesis import given, settings, strategies as st

from paged import Request
from paged.core.hybrid_manager import HybridKVCacheManager
from paged.core.kv_groups import FULL, SLIDING, STATE, make_layout
from paged.errors import ConfigError

import pytest


def _layout(kinds, bs, window, state_bytes=0):
    return make_layout(kinds, 64, bs, window=window, state_bytes=state_bytes)


def _group_tables(kv, rid):
    return kv.groups.tables[rid]


layouts = st.sampled_from([
    ["full", "sliding"],                      # gpt-oss: alternating
    ["sliding"] * 5 + ["full"],               # gemma 3: 5 local per global -> 5 sliding groups
    ["full", "full", "sliding", "sliding"],   # groups of 2
    ["full", "sliding", "full", "full"],      # 1.5x rule: groups of 3, one sliding group (padded)
    ["sliding"],                              # Mistral-7B v0.1: every layer slides (anchored pool)
])


def _kept(kv):
    """The layout's groups ``kv.groups`` keeps (all of them when no group is full: anchored)."""
    return kv.layout.groups[0 if kv.anchored else 1:]


@settings(max_examples=60, deadline=None)
@given(kinds=layouts, bs=st.sampled_from([1, 2, 4, 8]), window=st.integers(1, 40),
       prompt=st.integers(1, 70), decode=st.integers(0, 30), chunk=st.integers(1, 33))
def test_window_blocks_are_freed_exactly_when_no_query_reads_them(kinds, bs, window, prompt, decode, chunk):
    layout = _layout(kinds, bs, window)
    kv = HybridKVCacheManager(4096, layout, enable_prefix_caching=False)
    req = Request("r", list(range(prompt)), max_tokens=decode + 1)
    kv.check_request(req)
    while req.num_computed_tokens < prompt + decode:
        if req.num_computed_tokens == req.num_tokens:
            req.append_token(7)
        computed = req.num_computed_tokens
        n = min(chunk, req.num_tokens - computed)
        assert kv.allocate_slots(req, n) is not None
        skipped = max(0, computed - window + 1)  # the next query (at `computed`) reads from here on
        for g, table in zip(_kept(kv), _group_tables(kv, "r")):
            assert len(table) == -(-(computed + n) // bs)
            for p, block in enumerate(table):
                readable = g.kind == FULL or (p + 1) * bs > skipped
                assert (block is not None) == readable, (g.kind, p, computed, window)
        assert len(kv.blocks_of("r")) == -(-(computed + n) // bs)  # the full group (or chain) has everything
        assert kv.num_used_blocks == (0 if kv.anchored else len(kv.blocks_of("r"))) + kv.groups.held("r")
        kv.check_invariants()
        req.num_computed_tokens = computed + n
    kv.free("r")
    assert kv.num_used_blocks == 0
    kv.check_invariants()


def test_pages_match_the_layout_sizing_after_each_step():
    """The allocator holds what ``KVLayout.request_pages`` says, once a step's retirement ran."""
    layout = _layout(["sliding"] * 5 + ["full"], 16, 1024)
    kv = HybridKVCacheManager(20000, layout, enable_prefix_caching=False)
    req = Request("r", list(range(4096)), max_tokens=1)
    for start in range(0, 4096, 512):
        kv.allocate_slots(req, 512)
        req.num_computed_tokens = start + 512
    kv.groups.retire("r", req.num_computed_tokens)
    assert kv.num_used_blocks == layout.request_pages(4096) == 256 + 5 * 64


# ---- prefix hits ------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(kinds=layouts, bs=st.sampled_from([2, 4, 8]), window=st.integers(2, 30), pool=st.integers(40, 160),
       seed=st.integers(0, 10_000), steps=st.integers(5, 25))
def test_prefix_hit_never_returns_a_block_whose_window_is_gone(kinds, bs, window, pool, seed, steps):
    rng = random.Random(seed)
    layout = _layout(kinds, bs, window)
    kv = HybridKVCacheManager(pool, layout)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(8, 60))] for _ in range(3)]
    running: list[Request] = []
    trimmed = 0
    for step in range(steps):
        base = rng.choice(prefixes)
        cut = rng.randrange(1, len(base) + 1)
        req = Request(f"q{step}", base[:cut] + [rng.randrange(50) for _ in range(rng.randrange(0, 12))], max_tokens=1)
        hit = kv.find_cached_prefix(req)
        own = kv.manager.find_cached_prefix(req)  # the manager's table alone, untrimmed
        assert len(hit) <= len(own) and list(own[:len(hit)]) == hit
        trimmed += len(hit) < len(own)
        L, tables = kv.groups.trim_hit(kv.prefix.hashes[req.request_id], req.token_ids, own)
        assert L == len(hit)
        for i, g in enumerate(_kept(kv)):
            lo = max(0, L - kv.groups.need[i]) if g.kind == SLIDING else 0
            for p in range(lo, L):
                block = tables[i][p]
                assert block is not None and block.block_hash is not None, "window block gone"
                assert block.token_ids == tuple(req.token_ids[p * bs:(p + 1) * bs])
                assert block.parent_cid == hit[p].cid  # the same prefix the manager verified
        n = req.num_tokens - L * bs
        if not kv.can_allocate(req, n, hit):
            while running and not kv.can_allocate(req, n, hit):
                kv.free(running.pop(0).request_id)
            hit = kv.find_cached_prefix(req)  # the pool changed: ask again
            n = req.num_tokens - len(hit) * bs
            if not kv.can_allocate(req, n, hit):
                continue
        assert kv.allocate_slots(req, n, hit) is not None
        req.num_computed_tokens = req.num_tokens
        kv.check_invariants()
        if rng.random() < 0.6:
            kv.free(req.request_id)
        else:
            running.append(req)
    for r in running:
        kv.free(r.request_id)
    assert kv.num_used_blocks == 0
    kv.check_invariants()
    test_prefix_hit_never_returns_a_block_whose_window_is_gone.trimmed += trimmed


test_prefix_hit_never_returns_a_block_whose_window_is_gone.trimmed = 0


def test_the_trimming_ran():
    """The property test above must have cut hits short (else it proves nothing about windows)."""
    fn = test_prefix_hit_never_returns_a_block_whose_window_is_gone
    if fn.trimmed == 0:
        fn()  # run alone: run the property here
    assert fn.trimmed > 0


def test_hit_inside_the_window_survives_and_a_retired_window_is_trimmed():
    """A second request sharing a long prefix gets the hit while the window blocks are cached, and
    exactly the window's length back from a point whose window was evicted."""
    bs, window = 4, 8
    layout = _layout(["full", "sliding"], bs, window)
    kv = HybridKVCacheManager(64, layout)
    prompt = list(range(100, 140))  # 40 tokens, 10 blocks
    a = Request("a", prompt, max_tokens=1)
    kv.allocate_slots(a, 40)
    a.num_computed_tokens = 40
    kv.free("a")  # every block cached-free; the window blocks before position 40 kept their hashes
    b = Request("b", prompt + [1, 2, 3], max_tokens=1)
    assert len(kv.find_cached_prefix(b)) == 10  # blocks 8, 9 of the sliding group are cached
    # evict sliding block 9 (position 36..39): the hit must step back to where a whole window is cached
    kv.pool.uncache(kv.pool.lookup(("group", 0, kv.prefix.hashes["b"][9])).block_id)
    hit = kv.find_cached_prefix(b)
    assert len(hit) == 9  # blocks 7, 8 still cached: a hit ending at position 36 keeps its window
    assert kv.allocate_slots(b, 43 - 36, hit) is not None
    table = kv.groups.tables["b"][0]
    assert table[:7] == [None] * 7 and all(blk is not None for blk in table[7:])
    kv.check_invariants()


def test_state_layers_get_no_prefix_hit_but_keep_their_pages():
    layout = make_layout(["state", "state", "state", "full"], 64, 4, state_bytes=1000)
    kv = HybridKVCacheManager(64, layout)
    a = Request("a", list(range(32)), max_tokens=1)
    kv.allocate_slots(a, 32)
    pages = layout.state_pages(layout.groups[1])
    assert pages == -(-1000 // (4 * 64)) and kv.groups.held("a") == 3 * pages
    a.num_computed_tokens = 32
    kv.free("a")
    b = Request("b", list(range(32)) + [5], max_tokens=1)
    assert kv.manager.find_cached_prefix(b) and kv.find_cached_prefix(b) == []


def test_hybrid_pool_refuses_what_it_does_not_offer():
    with pytest.raises(ConfigError, match="needs an attention group"):
        HybridKVCacheManager(16, make_layout(["state"], 0, 4, state_bytes=100))
    with pytest.raises(ConfigError, match="host tier"):
        HybridKVCacheManager(16, _layout(["full", "sliding"], 4, 8), enable_host_tier=True, num_cpu_blocks=4)
    kv = HybridKVCacheManager(16, _layout(["full", "sliding"], 4, 8))
    kv.allocate_slots(Request("a", [1, 2, 3], max_tokens=1), 3)
    with pytest.raises(ConfigError, match="fork"):
        kv.fork("a", "b")
    assert kv.swap_out("a") is None  # preemption recomputes
    kv.check_invariants()


@settings(max_examples=40, deadline=None)
@given(kinds=layouts, bs=st.sampled_from([2, 4]), window=st.integers(2, 24), pool=st.integers(30, 90),
       seed=st.integers(0, 10_000))
def test_shared_window_blocks_never_overcommit_the_pool(kinds, bs, window, pool, seed):
    """Requests sharing a prefix hit decode side by side in a small pool: a retired block that
    another request still holds frees nothing, so ``allocate_slots`` must not count it as free
    (it returned a plan and then found the pool short: BlockStateError)."""
    rng = random.Random(seed)
    kv = HybridKVCacheManager(pool, _layout(kinds, bs, window))
    prefix = [rng.randrange(50) for _ in range(rng.randrange(bs * 3, bs * 8))]
    running: list[Request] = []
    for k in range(6):
        req = Request(f"r{k}", prefix + [rng.randrange(50)], max_tokens=40)
        hit = kv.find_cached_prefix(req)
        n = req.num_tokens - len(hit) * bs
        if not kv.can_allocate(req, n, hit) or kv.allocate_slots(req, n, hit) is None:
            continue
        req.num_computed_tokens = req.num_tokens
        running.append(req)
    for _ in range(40):  # decode in lockstep; a request that does not fit is preempted (freed)
        for req in list(running):
            req.append_token(rng.randrange(50))
            if kv.allocate_slots(req, 1) is None:
                kv.free(req.request_id)
                running.remove(req)
                continue
            req.num_computed_tokens += 1
        kv.check_invariants()
    for req in running:
        kv.free(req.request_id)
    assert kv.num_used_blocks == 0


def test_the_hybrid_pool_is_a_kv_cache():
    from paged.core.kv_cache import KVCache
    assert isinstance(HybridKVCacheManager(16, _layout(["full", "sliding"], 4, 8)), KVCache)
    assert isinstance(HybridKVCacheManager(16, _layout(["sliding"], 4, 8)), KVCache)


# ---- every layer sliding (anchored: the manager keeps only the content chain) ---------------------

def test_all_sliding_pool_holds_only_the_window_and_frees_blocks_as_they_leave_it():
    bs, window = 4, 8  # need = cdiv(7, 4) = 2 blocks before a hit point
    kv = HybridKVCacheManager(64, _layout(["sliding", "sliding"], bs, window))  # one group of 2 layers
    assert kv.anchored and len(kv.layout.groups) == 1
    a = Request("a", list(range(100, 140)), max_tokens=1)  # 40 tokens, 10 blocks
    freed = []
    for start in range(0, 40, 4):  # one block per step
        assert kv.allocate_slots(a, 4) is not None
        a.num_computed_tokens = start + 4
        freed.append(kv.groups.retire("a", a.num_computed_tokens))
    # after n tokens the next query reads n - 7 .. n: block p goes once 4(p + 1) <= n - 7
    assert freed == [0, 0, 1, 1, 1, 1, 1, 1, 1, 1]
    assert kv.num_used_blocks == kv.groups.held("a") == 2 == kv.layout.request_pages(40)
    assert len(kv.blocks_of("a")) == 10  # the chain: content ids, no pages
    kv.check_invariants()
    kv.free("a")
    assert kv.num_used_blocks == 0 and kv.pool.num_cached_free == 10  # freed pages keep their hashes


def test_all_sliding_hit_needs_only_the_window_before_the_hit_point():
    """vLLM's SlidingWindowManager: from the right, the first run of ``need`` cached blocks ends the
    hit; earlier blocks may be gone (None), the chain still verifies the whole prefix."""
    bs, window = 4, 8
    kv = HybridKVCacheManager(64, _layout(["sliding"], bs, window))
    prompt = list(range(100, 140))
    a = Request("a", prompt, max_tokens=1)
    kv.allocate_slots(a, 40)
    a.num_computed_tokens = 40
    hashes = list(kv.prefix.hashes["a"])
    kv.free("a")
    for p in range(0, 6):  # evict the pages of blocks 0..5: only the chain remembers them
        kv.pool.uncache(kv.pool.lookup(("group", 0, hashes[p])).block_id)
    b = Request("b", prompt + [1, 2, 3], max_tokens=1)
    hit = kv.find_cached_prefix(b)
    assert len(hit) == 10  # blocks 8, 9 are the window before position 40
    used = kv.num_used_blocks
    assert kv.allocate_slots(b, 3, hit) is not None
    table = kv.groups.tables["b"][0]
    assert table[:8] == [None] * 8 and all(blk is not None for blk in table[8:])
    assert kv.num_used_blocks == used + 2 + 1  # two revived window pages, one new block
    assert kv.prefix_cache_hits == 40
    kv.check_invariants()
    # a block inside the window gone: the hit steps back to where a whole window is cached (7, 8)
    kv.free("b")
    kv.pool.uncache(kv.pool.lookup(("group", 0, hashes[9])).block_id)
    c = Request("c", prompt + [4], max_tokens=1)
    assert len(kv.find_cached_prefix(c)) == 9
    kv.pool.uncache(kv.pool.lookup(("group", 0, hashes[7])).block_id)  # and 7: no window before 9 or 8 ...
    assert kv.find_cached_prefix(c) == []  # ... nor before 7 (blocks 5, 6: 5 is gone): no hit at all
    kv.check_invariants()


def test_a_window_recomputed_after_an_eviction_serves_hits_again():
    """Two ways a window stopped serving hits for good (Gemma 3 lost hits to them): a request that
    recomputes an evicted window beside the manager's still-indexed blocks (its own are duplicates)
    must anchor its window to that indexed content; and an entry anchored to content that was
    evicted and recomputed (stale) must give way to the window computed after the new content."""
    bs, window = 4, 8
    kv = HybridKVCacheManager(64, _layout(["full", "sliding"], bs, window))
    prompt = list(range(100, 140))  # 10 blocks
    a = Request("a", prompt, max_tokens=1)
    kv.allocate_slots(a, 40)
    a.num_computed_tokens = 40
    hashes = list(kv.prefix.hashes["a"])
    kv.free("a")
    kv.pool.uncache(kv.pool.lookup(("group", 0, hashes[9])).block_id)  # the window's last page gone
    b = Request("b", prompt + [1], max_tokens=1)
    hit = kv.find_cached_prefix(b)
    assert len(hit) == 9
    assert kv.allocate_slots(b, 41 - 36, hit) is not None  # recomputes block 9 (a duplicate in the full group)
    b.num_computed_tokens = 41
    kv.free("b")
    c = Request("c", prompt + [2], max_tokens=1)
    assert len(kv.find_cached_prefix(c)) == 10  # b's window, anchored to a's indexed block 9
    # now the full group's block 9 goes and comes back under a new content id: the window entry of
    # block 9 is anchored to the old one (stale) until a request computes it again
    kv.pool.uncache(kv.pool.lookup(hashes[9]).block_id)
    d = Request("d", prompt + [3], max_tokens=1)
    hit = kv.find_cached_prefix(d)
    assert len(hit) == 9
    assert kv.allocate_slots(d, 41 - 36, hit) is not None
    d.num_computed_tokens = 41
    kv.free("d")
    e = Request("e", prompt + [4], max_tokens=1)
    assert len(kv.find_cached_prefix(e)) == 10
    kv.check_invariants()


def test_a_prefix_and_its_windows_outlive_the_suffix_in_every_group():
    """Window pages retired while the request decoded are older than its suffix; on free the
    pool orders them with it, tail first in every group, so eviction takes the suffix first and
    a later request sharing the prompt still finds its window (it found nothing before)."""
    bs, window = 4, 8
    kv = HybridKVCacheManager(20, _layout(["full", "sliding"], bs, window))
    prompt = list(range(100, 124))  # 6 blocks
    a = Request("a", prompt, max_tokens=17)
    kv.allocate_slots(a, 24)
    a.num_computed_tokens = 24
    for t in range(16):  # decode to 40 tokens: sliding blocks 0..7 retire on the way
        a.append_token(200 + t)
        assert kv.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
    kv.free("a")
    assert kv.pool.num_cached_free == 20  # 10 full pages, 10 window pages, all still indexed
    x = Request("x", list(range(500, 512)), max_tokens=1)  # 3 + 3 pages: evicts the 6 oldest
    assert kv.allocate_slots(x, 12) is not None
    b = Request("b", prompt + [1], max_tokens=1)
    assert len(kv.find_cached_prefix(b)) == 6  # full blocks 0..5, window blocks 4, 5
    kv.check_invariants()
