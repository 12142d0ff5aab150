"""Contiguous reservation managers (paged/baselines.py) on their own and under the Scheduler."""
import pytest

from paged.sim.baselines import ContiguousKVCacheManager, next_pow2
from paged.errors import ConfigError, InvalidRequestError
from paged.core.request import Request
from paged.core.scheduler import Scheduler, SchedulerConfig


def _req(rid, p, o):
    return Request(rid, list(range(1, p + 1)), o)


def test_reservation_sizes():
    r = _req("a", 100, 25)
    assert next_pow2(25) == 32 and next_pow2(1) == 1 and next_pow2(32) == 32
    assert ContiguousKVCacheManager(4096, "max", max_model_len=2048).reservation_for(r) == 2048
    assert ContiguousKVCacheManager(4096, "pow2", max_model_len=2048).reservation_for(r) == 132
    assert ContiguousKVCacheManager(4096, "oracle", max_model_len=2048).reservation_for(r) == 125
    assert ContiguousKVCacheManager(4096, "pow2", max_model_len=140).reservation_for(_req("b", 100, 33)) == 140
    with pytest.raises(ConfigError, match="reservation"):
        ContiguousKVCacheManager(10, "buddy", max_model_len=8)


def test_first_fit_external_fragmentation_and_merge():
    kv = ContiguousKVCacheManager(100, "oracle", max_model_len=100)
    a, b, c = _req("a", 20, 10), _req("b", 20, 10), _req("c", 20, 10)
    for r in (a, b, c):
        assert kv.allocate_slots(r, 20) == []
    assert kv.num_free_blocks == 10 and kv.token_usage == pytest.approx(60 / 90)
    kv.free("b")
    kv.check_invariants()
    d = _req("d", 25, 10)  # 35 slots: 40 free in total but the largest hole is 30
    assert kv.num_free_blocks == 40 and kv.largest_hole == 30
    assert kv.allocate_slots(d, 5) is None
    kv.free("a")  # holes [0,30) + [30,60) merge
    kv.check_invariants()
    assert kv.largest_hole == 60 and kv.allocate_slots(d, 5) == [] and kv.block_table("d")[0] == 0
    a.num_computed_tokens = 0
    kv.free("c")
    kv.free("d")
    kv.check_invariants()
    assert kv.num_used_blocks == 0 and kv.largest_hole == 100


def test_grows_inside_reservation_only():
    kv = ContiguousKVCacheManager(64, "oracle", max_model_len=64)
    r = _req("a", 4, 3)
    assert kv.allocate_slots(r, 4) == []
    r.num_computed_tokens = 4
    r.append_token(9)
    assert kv.allocate_slots(r, 1) == [] and kv.token_usage == pytest.approx(5 / 7)
    assert kv.blocks_needed(r, 1) == 0 and kv.find_cached_prefix(r) == [] and kv.swap_out("a") is None
    with pytest.raises(InvalidRequestError, match="reserves"):
        ContiguousKVCacheManager(64, "max", max_model_len=128).check_request(_req("z", 4, 4))


def test_scheduler_never_preempts_with_reservations():
    kv = ContiguousKVCacheManager(300, "max", max_model_len=100)
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=256, watermark=0.0))
    for i in range(7):
        sched.add_request(_req(str(i), 30, 20))
    finished, steps = [], 0
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        assert len(sched.running) <= 3 and not plan.preempted  # 3 reservations of 100 fit
        finished += sched.update(plan, {c.request_id: 5 for c in plan.scheduled if c.samples})
        kv.check_invariants()
        steps += 1
    assert len(finished) == 7 and kv.num_used_blocks == 0


def test_overrides_every_cache_method_the_scheduler_uses():
    """Guard against drift: anything the Scheduler asks of its cache is answered by the reservation logic."""
    import inspect
    import re

    import paged.core.scheduler as sch

    used = set(re.findall(r"\bkv\.(\w+)", inspect.getsource(sch)))
    inherited_ok = {"recorder", "num_blocks", "block_size", "max_model_len"}  # attributes set from its own arguments
    missing = {name for name in used - inherited_ok if name not in ContiguousKVCacheManager.__dict__}
    assert not missing, f"ContiguousKVCacheManager must override {sorted(missing)}"
