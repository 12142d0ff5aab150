"""Verified prefix hits around duplicates: blocks that hold content another block already indexes.

A duplicate arises when a request computes a block whose hash the pool already indexes (it bypassed
the prefix cache, e.g. for prompt logprobs; it swapped back in; or two requests computed the same
block at once). First writer wins, so the duplicate is not indexed. Two promises:
- a hit is never wrong: a block computed after a duplicate is never verified against whatever the
  duplicate's physical block holds later (the hash may collide: only content ids decide);
- a hit is not lost: that block is indexed as the child of the indexed block holding the same tokens
  after the same content (checked by tokens and chain, not by hash alone), so later requests find it.
"""
from __future__ import annotations

import itertools

import pytest

from paged import KVCacheManager, Request
from paged.core.host_tier import HostBlock


def sum_mod_3(parent, token_ids, extra_keys):
    """Ignores the parent and collides on token sums mod 3: only verification keeps hits right."""
    return sum(token_ids) % 3


def run(kv: KVCacheManager, rid: str, tokens: list[int], *, use_cache: bool = True) -> list:
    """Admit ``tokens`` (with or without a prefix-cache lookup), compute them and free the request;
    returns the hit."""
    req = Request(rid, tokens, max_tokens=1)
    hit = kv.find_cached_prefix(req) if use_cache else []
    assert kv.allocate_slots(req, req.num_tokens - len(hit) * kv.block_size, hit) is not None
    req.num_computed_tokens = req.num_tokens
    kv.take_tier_ops()
    kv.check_invariants()
    kv.free(rid)
    return hit


def hit_of(kv: KVCacheManager, tokens: list[int]) -> list:
    """The verified hit for ``tokens`` (a new request id each time: the manager keeps a request's
    hashes until it is freed)."""
    return kv.find_cached_prefix(Request(f"probe{next(_probe_ids)}", tokens, max_tokens=1))


_probe_ids = itertools.count()


def test_a_block_computed_after_a_duplicate_is_no_hit_once_the_duplicate_holds_other_tokens():
    """Block size 1, a hash colliding on token sums. [1] is indexed (X). B = [1, 2] bypasses the
    cache: its [1] is a duplicate P (not indexed), its [2] (C) is indexed as computed after [1].
    P is freed and reused for [3], indexed under its own hash. E = [3, 2, 9] matches P on hash and
    tokens, then C on hash and tokens -- but C's K/V was computed after [1], not [3], so the hit is
    P alone. The shrunk case of the property test (tests/test_kv_properties.py); with parent checks
    by block identity and a generation bumped only when a block loses a hash, the never-indexed P
    kept its generation and C was a (wrong) hit."""
    kv = KVCacheManager(8, 1, hash_fn=sum_mod_3)
    run(kv, "a", [1])
    run(kv, "b", [1, 2], use_cache=False)
    p, c = kv.pool.blocks[1], kv.pool.blocks[2]
    assert p.block_hash is None and c.token_ids == (2,)  # P: the duplicate of [1]; C: indexed
    run(kv, "d", [3])                                   # takes P's physical block again
    assert kv.pool.index[0] is p and p.token_ids == (3,)
    assert [b.block_id for b in hit_of(kv, [3, 2, 9])] == [p.block_id]


@pytest.mark.parametrize("host_tier", [False, True])
def test_a_block_computed_after_a_duplicate_parent_stays_a_hit(host_tier):
    """A = [1,2] caches [1,2]; B = [1,2][3,4] bypasses the cache: its [1,2] is a duplicate, its
    [3,4] is new. A later [1,2,3,4,x] must hit both blocks ([3,4] is a child of A's [1,2], the
    indexed block holding the same content); before, [3,4] was indexed as the duplicate's child and
    never found."""
    kw = dict(num_cpu_blocks=8, enable_host_tier=True) if host_tier else {}
    kv = KVCacheManager(8, 2, hash_fn="builtin", **kw)
    run(kv, "a", [1, 2, 3])
    run(kv, "b", [1, 2, 3, 4, 5], use_cache=False)
    hit = hit_of(kv, [1, 2, 3, 4, 0])
    assert [b.token_ids for b in hit] == [(1, 2), (3, 4)]
    assert hit[1].parent_cid == hit[0].cid and hit[1].depth == 1


def test_a_recomputed_child_takes_over_its_host_entry_after_a_duplicate_parent():
    """Host tier: [1,2] on the GPU, its child [3,4] in the host tier. B = [1,2,3,4,x] bypasses the
    cache: its [1,2] is a duplicate of the GPU block, its [3,4] the same content as the host entry.
    The recomputed [3,4] must be indexed after the GPU [1,2] and take over the entry's content id
    (one tier each), so [1,2,3,4,x] still hits both; before, the entry was discarded and the new
    block indexed after the duplicate: 1 of 2."""
    kv = KVCacheManager(4, 2, num_cpu_blocks=8, enable_host_tier=True, hash_fn="builtin")
    run(kv, "a", [1, 2, 3, 4, 5])
    run(kv, "f", [20, 21, 22, 23, 24, 25])  # 3 blocks: demotes a's [3,4] and [1,2] to the host tier
    run(kv, "g", [1, 2, 9])                 # a hit brings [1,2] back to the GPU; [3,4] stays in host
    assert [type(b) for b in hit_of(kv, [1, 2, 3, 4, 0])] == [type(kv.pool.blocks[0]), HostBlock]
    entry_cid = hit_of(kv, [1, 2, 3, 4, 0])[1].cid
    run(kv, "b", [1, 2, 3, 4, 5], use_cache=False)
    hit = hit_of(kv, [1, 2, 3, 4, 0])
    assert [b.token_ids for b in hit] == [(1, 2), (3, 4)]
    assert not any(isinstance(b, HostBlock) for b in hit) and hit[1].cid == entry_cid
    assert hit[1].block_hash not in kv.host.entries  # the entry gave way to the GPU copy


def test_the_blocks_after_a_swap_in_stay_hits():
    """A request swapped out and back in re-indexes its blocks: duplicates of its own cached-free
    originals. The block it fills next must follow them: [1,2][3,4][5,6] is a 3-block hit."""
    kv = KVCacheManager(16, 2, num_cpu_blocks=8, hash_fn="builtin")
    req = Request("a", [1, 2, 3, 4, 5], max_tokens=4)
    assert kv.allocate_slots(req, 5) == []
    req.num_computed_tokens = 5
    assert kv.swap_out("a") is not None and kv.swap_in("a") is not None
    req.token_ids.append(6)
    assert kv.allocate_slots(req, 1) is not None
    req.num_computed_tokens = 6
    kv.check_invariants()
    assert [b.token_ids for b in hit_of(kv, [1, 2, 3, 4, 5, 6, 0])] == [(1, 2), (3, 4), (5, 6)]


def tokens_only(parent, token_ids, extra_keys):
    """Ignores the parent: the same tokens after any prefix share one hash."""
    return ("tokens", tuple(token_ids))


@pytest.mark.parametrize("hash_fn, second", [(tokens_only, [3, 1, 2]), (sum_mod_3, [0, 4, 2])],
                         ids=["other-parent", "other-tokens"])
def test_a_duplicate_is_linked_only_to_the_same_tokens_after_the_same_content(hash_fn, second):
    """Block size 1, a parent-blind hash. A = [0, 1] indexes [0] and [1] after it. B bypasses the
    cache with ``second``: in [3, 1, 2] the [1] has A's [1]'s hash and tokens but follows [3], not
    [0]; in [0, 4, 2] (hashes colliding on token sums mod 3) the [4] has A's [1]'s hash but other
    tokens. Either way B's [2] was computed after another prefix than [0, 1], so [0, 1, 2, x] hits
    two blocks, not three (a duplicate matched by hash alone, or by hash and tokens without the
    parent content, would make B's [2] a wrong hit); nor is B's [2] a first block: [2, x] misses."""
    kv = KVCacheManager(8, 1, hash_fn=hash_fn)
    run(kv, "a", [0, 1])
    run(kv, "b", second, use_cache=False)
    assert [b.token_ids for b in hit_of(kv, [0, 1, 2, 9])] == [(0,), (1,)]
    assert hit_of(kv, [2, 9]) == []
