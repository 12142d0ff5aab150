"""The scheduler runs synthetic workloads to completion under tight memory.

A shadow executor applies every plan exactly as a runner must and checks, before each
chunk, that the request's cached context holds K/V computed from its own tokens.
"""
from __future__ import annotations

import random

import pytest

from paged import (ConfigError, DuplicateRequestError, InvalidRequestError, KVCacheManager, Recorder, Request,
                   RequestStatus, Scheduler, SchedulerConfig, UnknownRequestError)
from shadow import ShadowKV


def workload(n: int, seed: int, shared_prefix: bool = True) -> list[Request]:
    rng = random.Random(seed)
    system = [rng.randrange(50) for _ in range(24)]
    out = []
    for i in range(n):
        prompt = [rng.randrange(50) for _ in range(rng.randint(1, 60))]
        if shared_prefix and i % 2:
            prompt = system + prompt
        out.append(Request(f"r{i}", prompt, max_tokens=rng.randint(1, 40), arrival_time=float(i)))
    return out


def run(scheduler: Scheduler, requests, *, arrivals_per_step: int = 3, seed: int = 0, check=None):
    """Drive to completion with a token-generating shadow executor; return plans."""
    rng = random.Random(seed)
    shadow = ShadowKV(scheduler.kv)
    pending = list(requests)
    plans = []
    for _ in range(100_000):
        for _ in range(min(arrivals_per_step, len(pending))):
            scheduler.add_request(pending.pop(0))
        if not scheduler.has_unfinished_requests() and not pending:
            break
        out = scheduler.schedule()
        shadow.apply(out)
        if check:
            check(out)
        scheduler.update(out, {c.request_id: rng.randrange(50) for c in out.scheduled if c.samples})
        scheduler.kv.check_invariants()
        plans.append(out)
    else:
        raise AssertionError("workload did not finish")
    return plans


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_workload_finishes_under_memory_pressure(mode, chunked, block_size):
    budget = 128  # max_total_tokens <= 124 fits without chunking too
    kv = KVCacheManager(-(-160 // block_size), block_size, num_cpu_blocks=-(-96 // block_size),
                        recorder=Recorder())
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=16,
                                          enable_chunked_prefill=chunked, preemption_mode=mode))
    reqs = workload(40, seed=block_size)
    expected = {r.request_id: r.max_tokens for r in reqs}

    def check(out):
        assert out.num_batched_tokens <= budget
        assert len(out.scheduled) <= 16
        assert len({c.request_id for c in out.scheduled}) == len(out.scheduled)
        if not chunked:  # a prefill is never split
            assert all(c.start + c.num_tokens == c.request.num_tokens for c in out.scheduled)

    plans = run(sched, reqs, check=check)
    finished = sched.take_finished()
    assert sorted(r.request_id for r in finished) == sorted(expected)
    assert all(r.num_output_tokens == expected[r.request_id] for r in finished)
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in finished)
    assert kv.num_used_blocks == 0 and kv.num_free_cpu_blocks == kv.num_cpu_blocks
    assert sched.num_preemptions[mode] > 0, "the pool was meant to be too small"
    if mode == "recompute":
        assert sched.num_preemptions["swap"] == 0
    assert any(p.preempted for p in plans)
    if chunked:
        assert any(c.num_tokens < c.request.num_tokens - c.start for p in plans for c in p.scheduled)


def test_chunked_prefill_shares_steps_with_decodes():
    kv = KVCacheManager(256, 16)
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=64))
    sched.add_request(Request("short", [1, 2, 3], max_tokens=20))
    out = sched.schedule()
    sched.update(out, {"short": 5})
    sched.add_request(Request("long", list(range(300)), max_tokens=2))
    out = sched.schedule()
    kinds = {c.request_id: (c.num_tokens, c.is_decode) for c in out.scheduled}
    assert kinds == {"short": (1, True), "long": (63, False)}
    assert out.num_decode_tokens == 1 and out.num_prefill_tokens == 63


def test_prefix_hits_count_tokens_and_skip_compute():
    kv = KVCacheManager(64, 4)
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=512))
    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks
    sched.add_request(Request("a", prompt, max_tokens=1))
    out = sched.schedule()
    sched.update(out, {"a": 0})
    sched.add_request(Request("b", prompt, max_tokens=1))
    out = sched.schedule()
    (chunk,) = out.scheduled
    assert chunk.start == 8 and chunk.num_tokens == 2
    assert kv.prefix_cache_queries == 20 and kv.prefix_cache_hits == 8
    sched.update(out, {"b": 0})
    # a prompt that is exactly cached still computes its last token
    sched.add_request(Request("c", prompt[:8], max_tokens=1))
    (chunk,) = sched.schedule().scheduled
    assert chunk.start == 4 and chunk.num_tokens == 4


def test_priority_policy_preempts_lowest_priority():
    kv = KVCacheManager(8, 4)
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=64, policy="priority", watermark=0.0))
    sched.add_request(Request("low", [1] * 12, max_tokens=16, priority=5))
    out = sched.schedule()
    sched.update(out, {"low": 1})
    sched.add_request(Request("high", [2] * 12, max_tokens=16, priority=0))
    seen_preempt = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        seen_preempt += out.preempted
        sched.update(out, {c.request_id: 3 for c in out.scheduled if c.samples})
        if any(r.request_id == "high" for r in sched.finished):
            break
    assert seen_preempt and all(rid == "low" for rid, _ in seen_preempt)
    finished_order = [r.request_id for r in sched.finished]
    assert finished_order[0] == "high"


def test_abort_frees_everything_wherever_the_request_is():
    kv = KVCacheManager(16, 4, num_cpu_blocks=16)
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=32, preemption_mode="swap", watermark=0.0))
    for i in range(4):
        sched.add_request(Request(f"r{i}", list(range(1 + 20 * i, 14 + 20 * i)), max_tokens=30))
    for _ in range(12):
        out = sched.schedule()
        sched.update(out, {c.request_id: 1 for c in out.scheduled if c.samples})
    assert sched.swapped or len(sched.waiting)
    for rid in list(sched.requests):
        sched.abort(rid)
    assert kv.num_used_blocks == 0 and kv.num_free_cpu_blocks == 16
    assert not sched.has_unfinished_requests()
    assert all(r.status is RequestStatus.FINISHED_ABORTED for r in sched.take_finished())
    with pytest.raises(UnknownRequestError):
        sched.abort("r0")


def test_fork_shares_blocks_and_copies_on_write():
    kv = KVCacheManager(32, 4)
    sched = Scheduler(kv, SchedulerConfig())
    sched.add_request(Request("p", [1, 2, 3, 4, 5, 6], max_tokens=4))
    out = sched.schedule()
    sched.update(out, {"p": 7})
    child = sched.fork("p", "c", last_token=8)
    assert kv.block_table("c") == kv.block_table("p")
    shadow = ShadowKV(kv)
    shadow.write("p", [1, 2, 3, 4, 5, 6], 0, 6)
    out = sched.schedule()
    assert len(out.block_copies) == 1  # the shared partial block, copied once
    shadow.apply(out)
    sched.update(out, {"p": 9, "c": 9})
    assert kv.block_table("c")[0] == kv.block_table("p")[0] != None
    assert kv.block_table("c")[1] != kv.block_table("p")[1]
    assert child.token_ids[-2:] == [8, 9]
    assert shadow.holds("c", child.token_ids, 7) and shadow.holds("p", sched.requests["p"].token_ids, 7)


def test_bad_input_is_rejected_and_changes_nothing():
    kv = KVCacheManager(4, 4, max_model_len=12)
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=8, enable_chunked_prefill=False))
    sched.add_request(Request("ok", [1, 2], max_tokens=2))
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        sched.add_request(Request("long", list(range(1, 14)), max_tokens=1))
    with pytest.raises(InvalidRequestError, match="token budget"):
        sched.add_request(Request("big", list(range(1, 8)), max_tokens=3))
    with pytest.raises(DuplicateRequestError):
        sched.add_request(Request("ok", [1], max_tokens=1))
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        Request("e", [], max_tokens=1)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        Request("m", [1], max_tokens=0)
    with pytest.raises(ConfigError):
        SchedulerConfig(preemption_mode="drop")
    assert list(sched.requests) == ["ok"] and len(sched.waiting) == 1
    out = sched.schedule()
    assert [c.request_id for c in out.scheduled] == ["ok"]


@pytest.mark.parametrize("seed", range(12))
def test_random_configurations_with_aborts_and_forks(seed):
    """Random pool/budget/policy/mode; random aborts and forks; the shadow checks every step."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 8, 16])
    kv = KVCacheManager(-(-rng.randint(130, 300) // bs), bs, num_cpu_blocks=rng.choice([0, 4, 64]),
                        eviction=rng.choice(["lru", "lfu", "weighted"]), recorder=Recorder())
    cfg = SchedulerConfig(max_num_batched_tokens=rng.choice([16, 64, 256]), max_num_seqs=rng.choice([2, 8, 32]),
                          enable_chunked_prefill=True, preemption_mode=rng.choice(["recompute", "swap"]),
                          policy=rng.choice(["fcfs", "priority"]), watermark=rng.choice([0.0, 0.05]))
    sched = Scheduler(kv, cfg)
    shadow = ShadowKV(kv)
    reqs = workload(30, seed)
    for r in reqs:
        r.priority = rng.randrange(3)
    aborted, forked = set(), 0
    for _ in range(20_000):
        if reqs and rng.random() < 0.5:
            sched.add_request(reqs.pop())
        if not sched.has_unfinished_requests() and not reqs:
            break
        out = sched.schedule()
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        shadow.apply(out)
        sched.update(out, {c.request_id: rng.randrange(50) for c in out.scheduled if c.samples})
        running = [r for r in sched.running if r.num_computed_tokens == r.num_tokens - 1]
        if running and rng.random() < 0.05:
            parent = rng.choice(running)
            sched.fork(parent.request_id, f"{parent.request_id}.f{forked}", last_token=rng.randrange(50))
            forked += 1
        if sched.requests and rng.random() < 0.03:
            rid = rng.choice(sorted(sched.requests))
            sched.abort(rid)
            aborted.add(rid)
        kv.check_invariants()
    else:
        raise AssertionError("did not finish")
    finished = sched.take_finished()
    assert len(finished) == 30 + forked
    for r in finished:
        if r.request_id not in aborted:
            assert r.num_output_tokens == r.max_tokens
    assert kv.num_used_blocks == 0 and kv.num_free_cpu_blocks == kv.num_cpu_blocks


def test_watermark_never_blocks_a_request_that_fits_alone():
    kv = KVCacheManager(10, 4)
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=64, watermark=0.2))  # keeps 2 blocks free
    sched.add_request(Request("big", list(range(1, 37)), max_tokens=4))  # needs all 10 blocks
    plans = run(sched, [])
    assert [r.num_output_tokens for r in sched.take_finished()] == [4]
    assert kv.num_used_blocks == 0 and plans


@pytest.mark.parametrize("aging", [None, 20])
def test_priority_aging_prevents_starvation(aging):
    """A low-priority request among endless better-priority arrivals: strict priority
    starves it while they keep coming; with aging it is served once the requests that
    arrived within priority x aging steps (2 per step, served ~1 per step) are done."""
    kv = KVCacheManager(64, 4)
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=2, policy="priority",
                                          priority_aging_steps=aging))
    sched.add_request(Request("low", [9] * 4, max_tokens=2, priority=3))
    finished_at = None
    for step in range(400):
        for k in range(2):  # arrivals outpace service: better-priority requests always wait
            sched.add_request(Request(f"hi{step}.{k}", [1] * 4, max_tokens=2, priority=0))
        out = sched.schedule()
        sched.update(out, {c.request_id: 2 for c in out.scheduled if c.samples})
        if any(r.request_id == "low" for r in sched.take_finished()):
            finished_at = step
            break
    if aging is None:
        assert finished_at is None
    else:
        assert finished_at is not None and finished_at <= 2 * 3 * aging + 10
