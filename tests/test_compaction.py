"""Block compaction (paged.core.compaction): the planner's guarantees, the manager's commit and the
scheduler's trigger, checked by the shadow store.

- a plan is a list of rounds: sources live, destinations free (at the start, or vacated by an
  earlier round), each block moved at most once, no copy reads a block an earlier copy wrote (in
  order == all at once); one round: no destination is a source;
- every compacted request's own blocks are one run afterwards; shared blocks are contiguous for
  their first holder only;
- the manager's invariants hold, every running request still reads its whole context (shadow),
  prefix entries follow their blocks (hits verified after the remap), nothing leaks;
- with compaction on, the scheduler makes exactly the same schedule as with it off.
"""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from paged import ConfigError, KVCacheManager, Recorder, Request, Scheduler, SchedulerConfig
from paged.core import events as ev
from paged.core.compaction import count_runs, fragmentation, own_blocks, plan_compaction
from paged.errors import BlockStateError
from shadow import ShadowKV


def test_runs_own_blocks_and_fragmentation():
    assert count_runs([]) == 0 and count_runs([3]) == 1 and count_runs([3, 4, 5]) == 1
    assert count_runs([3, 5, 6, 2]) == 3
    tables = [("a", [0, 1, 5]), ("b", [0, 1, 7, 8])]          # b shares a's prefix
    assert own_blocks(tables) == [("a", [0, 1, 5]), ("b", [7, 8])]
    assert fragmentation(tables) == pytest.approx(1 / 3)       # one break in a's 2 pairs + b's 1 pair


def test_plan_is_one_round_into_free_blocks():
    tables = [("a", [0, 2, 4]), ("b", [1, 3])]
    plan = plan_compaction(tables, 10, free=[5, 6, 7, 8, 9])
    assert plan.copies == [(0, 5), (2, 6), (4, 7), (1, 8), (3, 9)]
    assert plan.num_fragmented == plan.num_compacted == 2 and plan.fragmentation_after == 0.0
    assert (plan.runs_before, plan.runs_after) == (5, 2)


def test_plan_keeps_blocks_in_place_and_skips_what_does_not_fit():
    plan = plan_compaction([("a", [0, 1, 2, 9])], 10, free=[3, 4, 5, 6, 7, 8])
    assert plan.copies == [(9, 3)]                               # [0, 1, 2] stay
    plan = plan_compaction([("a", [0, 2])], 3, free=[])          # no free window
    assert plan.copies == [] and plan.num_skipped == 1
    plan = plan_compaction([("a", [0, 2, 4]), ("b", [1, 3])], 10, free=range(5, 10), max_copies=3)
    assert plan.num_copies == 3 and plan.num_skipped == 1


def test_cached_free_blocks_are_kept_unless_dropping_is_allowed():
    tables = [("a", [0, 2])]
    assert plan_compaction(tables, 5, free=[3], cached=[1, 4]).copies == []
    plan = plan_compaction(tables, 5, free=[3], cached=[1, 4], drop_cached=True)
    assert plan.copies == [(2, 1)] and plan.dropped_cached == [1]


def test_a_table_naming_a_free_block_is_rejected():
    with pytest.raises(BlockStateError):
        plan_compaction([("a", [0, 2])], 4, free=[2, 3])


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**20), st.integers(4, 40), st.sampled_from([1, 4]))
def test_random_plans_keep_their_guarantees(seed, num_blocks, rounds):
    rng = random.Random(seed)
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    live = ids[:rng.randint(0, num_blocks)]
    tables, k = [], 0
    while k < len(live):
        n = rng.randint(1, 6)
        table = live[k:k + n]
        if tables and rng.random() < 0.3:                        # share a prefix of an earlier table
            table = tables[-1][1][:rng.randint(1, len(tables[-1][1]))] + table
        tables.append((f"r{len(tables)}", table))
        k += n
    free = [b for b in ids if b not in set(live)]
    plan = plan_compaction(tables, num_blocks, free, max_rounds=rounds)
    srcs, dsts = [s for s, _ in plan.copies], [d for _, d in plan.copies]
    assert set(srcs) <= set(live) and set(dsts) <= set(free) | set(srcs)
    assert len(set(srcs)) == len(srcs) and len(set(dsts)) == len(dsts)   # each block moves at most once
    assert all(dsts[i] != srcs[j] for j in range(len(srcs)) for i in range(j))  # no read after a write
    if rounds == 1:
        assert not set(srcs) & set(dsts) and plan.num_copies <= len(free)
    # applied in order (sequentially) == applied at once
    store = {b: ("v", b) for b in range(num_blocks)}
    at_once = dict(store)
    for s_, d in plan.copies:
        store[d] = store[s_]
    at_once.update({d: ("v", s_) for s_, d in plan.copies})
    assert store == at_once
    moved = dict(plan.copies)
    after = [(rid, [moved.get(b, b) for b in t]) for rid, t in tables]
    runs = [count_runs(own) for _, own in own_blocks(after)]
    assert sum(runs) == plan.runs_after and plan.runs_after <= plan.runs_before
    assert sum(r > 1 for r in runs) == plan.num_skipped
    assert plan.num_compacted + plan.num_skipped == plan.num_fragmented


def _fragment(kv: KVCacheManager, n: int = 4, prompt: int = 6, decode: int = 9):
    """n requests prefilled then decoding in lockstep: their later blocks interleave."""
    shadow = ShadowKV(kv)
    reqs = [Request(f"r{i}", [i * 7 % 50 + j % 5 for j in range(prompt)], max_tokens=decode + 1) for i in range(n)]
    for r in reqs:
        kv.allocate_slots(r, r.num_tokens)
        shadow.write(r.request_id, r.token_ids, 0, r.num_tokens)
        r.num_computed_tokens = r.num_tokens
    for t in range(decode):
        for r in reqs:
            r.append_token((t * 3 + len(r.request_id)) % 50)
            kv.allocate_slots(r, 1)
            shadow.write(r.request_id, r.token_ids, r.num_computed_tokens, 1)
            r.num_computed_tokens += 1
    return reqs, shadow


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_manager_compaction_keeps_context_prefix_hits_and_counts(eviction):
    rec = Recorder()
    kv = KVCacheManager(64, 2, eviction=eviction, recorder=rec)
    reqs, shadow = _fragment(kv)
    order = [r.request_id for r in reqs]
    before = kv.block_fragmentation(order)
    assert before > 0.3
    mark = len(rec)
    copies = kv.compact(order)
    shadow.copy_blocks(copies)
    kv.check_invariants()
    assert copies and kv.block_fragmentation(order) == 0.0 and kv.last_compaction.num_compacted == len(reqs)
    assert all(count_runs(kv.block_table(r.request_id)) == 1 for r in reqs)
    assert all(shadow.holds(r.request_id, r.token_ids, r.num_computed_tokens) for r in reqs)
    assert [e.kind for e in rec.since(mark)] == [ev.COMPACT] * len(copies)
    # prefix entries moved with their blocks: a twin of r0 hits r0's new ids, and the K/V there is r0's
    twin = Request("twin", list(reqs[0].token_ids), max_tokens=1)
    hit = kv.find_cached_prefix(twin)
    assert [b.block_id for b in hit] == kv.block_table("r0")[:len(hit)] and len(hit) >= 3
    kv.allocate_slots(twin, twin.num_tokens - len(hit) * kv.block_size, hit)
    assert shadow.holds("twin", twin.token_ids, len(hit) * kv.block_size)
    for r in [*reqs, twin]:
        kv.free(r.request_id)
    kv.check_invariants()
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == kv.num_blocks
    assert kv.num_compactions == 1 and kv.num_compaction_copies == len(copies)


def test_shared_blocks_are_contiguous_for_their_first_holder():
    kv = KVCacheManager(64, 2)
    reqs, shadow = _fragment(kv, n=2)
    kv.fork("r0", "c0")                                          # c0 shares all of r0's blocks
    copies = kv.compact(["r0", "c0", "r1"])
    shadow.copy_blocks(copies)
    kv.check_invariants()
    assert kv.block_table("c0") == kv.block_table("r0") and count_runs(kv.block_table("r0")) == 1
    assert shadow.holds("c0", reqs[0].token_ids, reqs[0].num_computed_tokens)


def _r0_beside_a_cached_free_block():
    """r0 holds blocks [0, 2] (3 tokens, block size 2); r2's freed block 1 stays cached-free."""
    rec = Recorder()
    kv = KVCacheManager(5, 2, recorder=rec)
    shadow = ShadowKV(kv)
    r0, r2 = Request("r0", [1, 2], max_tokens=3), Request("r2", [5, 6], max_tokens=3)
    for r in (r0, r2):
        kv.allocate_slots(r, 2)
        shadow.write(r.request_id, r.token_ids, 0, 2)
        r.num_computed_tokens = 2
    r0.append_token(9)
    kv.allocate_slots(r0, 1)
    shadow.write("r0", r0.token_ids, 2, 1)
    r0.num_computed_tokens = 3
    kv.free("r2")
    return kv, shadow, rec, r0


def test_dropping_cached_free_blocks_evicts_them():
    kv, shadow, rec, r0 = _r0_beside_a_cached_free_block()
    assert kv.block_table("r0") == [0, 2] and kv.num_cached_free_blocks == 1
    assert kv.compact(["r0"]) == [(0, 3), (2, 4)]                # keeps the cached block: moves both
    kv.check_invariants()
    shadow.copy_blocks([(0, 3), (2, 4)])
    assert shadow.holds("r0", r0.token_ids, 3) and kv.num_cached_free_blocks == 1
    mark = len(rec)
    copies = kv.compact(["r0"], drop_cached=True)                # nothing to fix any more
    assert copies == [] and len(rec) == mark


def test_drop_cached_takes_the_cached_window():
    kv, shadow, rec, r0 = _r0_beside_a_cached_free_block()
    mark = len(rec)
    copies = kv.compact(["r0"], drop_cached=True)
    assert copies == [(2, 1)] and kv.last_compaction.dropped_cached == [1]
    shadow.copy_blocks(copies)
    kv.check_invariants()
    assert kv.num_cached_free_blocks == 0 and shadow.holds("r0", r0.token_ids, 3)
    assert [e.kind for e in rec.since(mark)] == [ev.EVICT, ev.COMPACT]
    assert kv.find_cached_prefix(Request("again", [5, 6, 7], max_tokens=1)) == []


def _drive(compaction: bool, seed: int, drop_cached: bool = False):
    """A random workload (shared prefixes, forks, aborts, preemption) under the scheduler; the
    shadow checks every chunk, and every running request's whole context after each plan."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    kv = KVCacheManager(-(-rng.randint(100, 200) // bs), bs, num_cpu_blocks=rng.choice([0, 64]),
                        eviction=rng.choice(["lru", "lfu"]), recorder=Recorder())
    cfg = SchedulerConfig(max_num_batched_tokens=rng.choice([16, 64]), max_num_seqs=8,
                          preemption_mode=rng.choice(["recompute", "swap"]), enable_block_compaction=compaction,
                          compaction_threshold=0.0, compaction_interval=rng.choice([1, 3]),
                          compaction_drop_cached=drop_cached)
    sched = Scheduler(kv, cfg)
    shadow = ShadowKV(kv)
    system = [rng.randrange(50) for _ in range(12)]
    reqs = [Request(f"r{i}", (system if i % 2 else []) + [rng.randrange(50) for _ in range(rng.randint(1, 30))],
                    max_tokens=rng.randint(2, 25)) for i in range(16)]
    schedule, copies, forked = [], 0, 0
    for _ in range(5_000):
        if reqs and rng.random() < 0.4:
            sched.add_request(reqs.pop())
        if not sched.has_unfinished_requests() and not reqs:
            break
        out = sched.schedule()
        shadow.apply(out)
        for r in sched.running:
            assert shadow.holds(r.request_id, r.token_ids, r.num_computed_tokens), r.request_id
        copies += out.num_compaction_copies
        schedule.append([(c.request_id, c.start, c.num_tokens) for c in out.scheduled])
        sched.update(out, {c.request_id: rng.randrange(50) for c in out.scheduled if c.samples})
        ready = [r for r in sched.running if r.num_computed_tokens == r.num_tokens - 1]
        if ready and rng.random() < 0.05:
            sched.fork(ready[0].request_id, f"{ready[0].request_id}.f{forked}", last_token=rng.randrange(50))
            forked += 1
        kv.check_invariants()
    else:
        raise AssertionError("did not finish")
    assert kv.num_used_blocks == 0 and kv.num_free_cpu_blocks == kv.num_cpu_blocks
    return schedule, copies, kv


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**20))
def test_scheduler_compaction_is_lossless_and_changes_no_decision(seed):
    on, copies, kv = _drive(True, seed)
    off, none, _ = _drive(False, seed)
    assert on == off and none == 0
    assert kv.num_compaction_copies == copies


@pytest.mark.parametrize("drop_cached", [False, True])
def test_compaction_runs_and_is_counted_in_the_plan(drop_cached):
    """Dropping cached-free blocks may cost prefix hits (a different schedule), never context."""
    schedule, copies, kv = _drive(True, 3, drop_cached)
    assert copies > 0 and kv.num_compactions > 0


@pytest.mark.parametrize("bad", [dict(compaction_interval=0), dict(compaction_threshold=1.5),
                                 dict(compaction_max_copies=0)])
def test_bad_compaction_settings_are_config_errors(bad):
    with pytest.raises(ConfigError):
        SchedulerConfig(**bad)
