"""A chunk is exactly min(remaining, budget left), in the running loop and at admission.

Chunks are listed in the order the scheduler spent its token budget (running requests,
then swapped ones resumed, then waiting ones admitted), so walking one plan with a
running budget reproduces each chunk's size.
"""
from __future__ import annotations

import pytest

from paged.core import events as ev
from paged import KVCacheManager, Recorder, Request, Scheduler, SchedulerConfig
from test_scheduler import run, workload


def assert_chunks_fill_the_budget(out, budget: int) -> None:
    left = budget
    for c in out.scheduled:
        remaining = c.request.num_tokens - c.start
        assert c.num_tokens == min(remaining, left), (c.request_id, c.start, c.num_tokens, remaining, left)
        left -= c.num_tokens


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("budget", [7, 64])
def test_every_chunk_is_min_of_remaining_and_budget_left(mode, budget):
    """Catches a running-loop chunk of `budget - 1` (or any other short chunk) and the same
    at admission or swap-in: the chunk that cannot finish its request takes all that is left."""
    kv = KVCacheManager(-(-200 // 4), 4, num_cpu_blocks=32, recorder=Recorder())
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, preemption_mode=mode))
    seen = {"partial_running": 0, "partial_admit": 0}

    def check(out):
        assert_chunks_fill_the_budget(out, budget)
        admitted = {e[2] for e in kv.recorder.events if e[0] == out.step and e[1] == ev.ADMIT}
        for c in out.scheduled:
            if c.num_tokens < c.request.num_tokens - c.start:
                seen["partial_admit" if c.request_id in admitted else "partial_running"] += 1

    run(sched, workload(30, seed=budget), check=check)
    assert seen["partial_admit"] > 0 and (budget > 60 or seen["partial_running"] > 0), seen


def test_running_loop_chunk_takes_the_whole_budget():
    """A long prompt already running continues with exactly the budget each step."""
    kv = KVCacheManager(64, 4)
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=10))
    sched.add_request(Request("long", list(range(1, 36)), max_tokens=2))
    sizes = []
    for _ in range(4):
        out = sched.schedule()
        (c,) = out.scheduled
        sizes.append((c.start, c.num_tokens))
        sched.update(out, {"long": 3} if c.samples else {})
    assert sizes == [(0, 10), (10, 10), (20, 10), (30, 5)]


def test_admission_chunk_takes_what_the_running_requests_leave():
    kv = KVCacheManager(64, 4)
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=12))
    sched.add_request(Request("a", [1, 2, 3], max_tokens=5))
    out = sched.schedule()
    sched.update(out, {"a": 9})
    sched.add_request(Request("b", list(range(1, 40)), max_tokens=1))
    out = sched.schedule()
    assert [(c.request_id, c.num_tokens) for c in out.scheduled] == [("a", 1), ("b", 11)]
