"""The scheduler's fast paths (issue 12) change nothing but speed: the decode lane
(``KVCacheManager.append_decode_slots``, its runs appended to the plan's batch columns) gives the same plans, counts,
step shapes, tables, fills, prefix index and events as the general ``allocate_slots`` path, and
``update`` leaves every request as it was when the executor's tokens miss one."""
from __future__ import annotations

import random

import numpy as np
import pytest

from paged.sim.cost_model import plan_shape, step_shape
from paged import KVCacheManager, NullRecorder, PagedError, Recorder, Request, Scheduler, SchedulerConfig
from paged.core.plan import ScheduledChunk


def _drive(lane: bool, seed: int, block_size: int, recorder, host_tier: bool = False) -> list:
    """A workload with forks (shared blocks: copy-on-write), prefix hits, block boundaries and
    preemption (and, with ``host_tier``, demotions the lane's allocations make); returns one
    record per step of everything observable."""
    rng = random.Random(seed)
    kv = KVCacheManager(-(-200 // block_size), block_size, num_cpu_blocks=8, recorder=recorder, host_tier=host_tier)
    lane_runs = [0]
    real_lane = kv.append_decode_slots
    def counting_lane(requests, i, *rest):
        j = real_lane(requests, i, *rest)
        lane_runs[0] += j > i
        return j
    # without the lane it handles no request: the scheduler falls back to allocate_slots for every one
    kv.append_decode_slots = counting_lane if lane else (lambda requests, i, *rest: i)
    s = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=12,
                                      preemption_mode=rng.choice(["recompute", "swap"])))
    system = [rng.randrange(40) for _ in range(20)]
    reqs = [Request(f"r{i}", (system if i % 2 else []) + [rng.randrange(40) for _ in range(rng.randint(1, 30))],
                    max_tokens=rng.randint(1, 40)) for i in range(24)]
    trace, forks = [], 0
    for step in range(2000):
        if reqs and step % 2 == 0:
            s.add_request(reqs.pop(0))
        if not s.has_unfinished_requests() and not reqs:
            break
        out = s.schedule()
        a, b = plan_shape(out.batch), step_shape(out.scheduled)
        assert np.array_equal(a.q, b.q) and np.array_equal(a.ctx, b.ctx) and a.num_sampled == b.num_sampled
        counts = (out.num_seqs, out.num_batched_tokens, out.num_decode_tokens, out.is_empty)
        assert counts == (len(out.scheduled), sum(c.num_tokens for c in out.scheduled),
                          sum(c.is_decode for c in out.scheduled), not out.scheduled)
        sampled = {c.request_id: rng.randrange(40) for c in out.scheduled if c.samples}
        s.update(out, sampled)
        running = [r for r in s.running if r.num_computed_tokens < r.num_tokens]
        if running and forks < 6 and step % 7 == 3:
            forks += 1
            s.fork(running[0].request_id, f"f{forks}")
        kv.check_invariants()
        trace.append(([(c.request_id, c.start, c.num_tokens, c.samples) for c in out.scheduled], counts,
                      out.block_copies, out.swap_out, out.swap_in, out.preempted, out.freed_blocks,
                      out.finished_freed_blocks, {r: kv.block_table(r) for r in sorted(kv._tables)},
                      kv.pool.num_filled_slots, sorted(b.block_id for b in kv.pool.index.values()),
                      kv.prefix_cache_hits, out.tier_out, out.tier_in, kv.host_cache_hits))
    assert not s.has_unfinished_requests()
    assert not lane or lane_runs[0] > 0
    return trace


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_lane_equals_the_general_path(block_size, seed):
    assert _drive(True, seed, block_size, NullRecorder()) == _drive(False, seed, block_size, NullRecorder())


def test_decode_lane_equals_the_general_path_with_the_host_tier():
    lane, general = (_drive(on, 0, 4, NullRecorder(), host_tier=True) for on in (True, False))
    assert lane == general
    assert sum(len(step[-3]) for step in lane) > 0  # the workload did demote blocks to the tier


def test_decode_lane_events_equal_the_general_path():
    a, b = Recorder(), Recorder()
    assert _drive(True, 3, 4, a) == _drive(False, 3, 4, b)
    def same(events):  # latency events too (their nanoseconds differ): with a recorder the lane
        return [e[:4] if e[1] == "alloc_latency" else e for e in events]  # leaves new blocks to allocate_slots
    assert same(a.events) == same(b.events)


def test_update_with_a_missing_token_changes_nothing():
    kv = KVCacheManager(64, 4)
    s = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=64))
    for i in range(3):
        s.add_request(Request(f"r{i}", list(range(5 + i)), max_tokens=5))
    out = s.schedule()
    s.update(out, {c.request_id: 1 for c in out.scheduled})
    out = s.schedule()
    before = [(r.request_id, r.num_computed_tokens, list(r.token_ids)) for r in s.running]
    with pytest.raises(PagedError, match="no token for request 'r2'"):
        s.update(out, {"r0": 1, "r1": 2})
    assert [(r.request_id, r.num_computed_tokens, list(r.token_ids)) for r in s.running] == before
    s.update(out, {"r0": 1, "r1": 2, "r2": 3})  # and the step can still be completed
    assert [r.num_computed_tokens for r in s.running] == [n + 1 for _, n, _ in before]


def test_a_lane_chunk_that_ends_a_prompt_counts_as_prefill():
    s = Scheduler(KVCacheManager(16, 4), SchedulerConfig(max_num_batched_tokens=8))
    s.add_request(Request("p", list(range(9)), max_tokens=2))
    s.update(s.schedule(), {})  # tokens 0-7: no sample
    out = s.schedule()  # the last prompt token, through the lane
    assert out.batch.starts == [8] and out.batch.num_tokens == [1] and out.batch.samples == [True]
    assert (out.num_decode_tokens, out.num_prefill_tokens, out.num_seqs) == (0, 1, 1)
    s.update(out, {"p": 5})
    out = s.schedule()  # the first output token: a decode
    assert (out.num_decode_tokens, out.num_prefill_tokens) == (1, 0)
    assert out.scheduled == [ScheduledChunk(s.running[0], 9, 1, True)]
