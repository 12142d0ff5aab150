"""KVSnapshot / ContiguousSnapshot on small pools: states, owners, tables, CoW, swap, cached-free."""
import numpy as np

from paged.core import KVCacheManager, Request, RequestStatus
from paged.core import snapshot as S
from paged.sim.baselines import ContiguousKVCacheManager


def _req(rid, toks, max_tokens=4):
    r = Request(rid, toks, max_tokens)
    r.status = RequestStatus.RUNNING
    return r


def test_states_owner_logical_and_tables():
    kv = KVCacheManager(8, 4, num_cpu_blocks=4)
    a = _req("a", list(range(10)))
    assert kv.allocate_slots(a, 10) == []
    a.num_computed_tokens = 10
    snap = kv.snapshot({"a": a})
    assert snap.num_blocks == 8 and snap.request_ids == ["a"]
    t = snap.table("a")
    assert list(t) == kv.block_table("a")
    assert list(snap.state[t]) == [S.STATE_USED] * 3
    assert list(snap.owner[t]) == [0, 0, 0] and list(snap.logical[t]) == [0, 1, 2]
    assert list(snap.filled[t]) == [4, 4, 2]
    assert snap.hashed[t].tolist() == [True, True, False]
    assert snap.counts()["free"] == 5 and snap.num_computed[0] == 10
    assert snap.status[0] == S.STATUS_RUNNING


def test_shared_cow_writing_cached_free_and_swap():
    kv = KVCacheManager(8, 4, num_cpu_blocks=8)
    a = _req("a", list(range(6)))
    kv.allocate_slots(a, 6)
    a.num_computed_tokens = 6
    kv.fork("a", "b")
    b = _req("b", list(range(6)))
    b.num_computed_tokens = 6
    reqs = {"a": a, "b": b}
    snap = kv.snapshot(reqs, writing=kv.block_table("a")[-1:])
    t = snap.table("b")
    assert snap.state[t[0]] == S.STATE_SHARED and snap.ref_count[t[0]] == 2
    assert snap.state[t[1]] == S.STATE_WRITING
    assert snap.owner[t[0]] == 0 and sorted(snap.holders(int(t[0]))) == ["a", "b"]
    # copy-on-write: b writes into the shared partial block
    b.token_ids.append(99)
    kv.allocate_slots(b, 1)
    snap2 = kv.snapshot(reqs)
    assert snap2.table("b")[1] != snap2.table("a")[1]
    assert snap.state[t[1]] == S.STATE_WRITING  # the old snapshot did not change
    # free a: its full block 0 stays shared by b; free b -> block 0 becomes cached-free
    kv.free("a")
    kv.free("b")
    snap3 = kv.snapshot({}, with_tokens=True)
    cached = np.flatnonzero(snap3.state == S.STATE_CACHED)
    assert len(cached) == 1 and snap3.block_tokens(int(cached[0])) == (0, 1, 2, 3)
    assert snap3.hash_key[cached[0]] != 0 and snap3.request_ids == []
    # swap
    c = _req("c", list(range(100, 109)))
    kv.allocate_slots(c, 9)
    kv.swap_out("c")
    c.status = RequestStatus.SWAPPED
    snap4 = kv.snapshot({"c": c})
    assert snap4.num_cpu_used == 3 and snap4.cpu_blocks_of == {"c": 3}
    assert snap4.status[0] == S.STATUS_SWAPPED and len(snap4.table(0)) == 0


def test_tokens_and_last_use():
    kv = KVCacheManager(16, 4)
    a = _req("a", list(range(7)))
    kv.recorder.step = 3
    kv.allocate_slots(a, 7)
    last = np.zeros(16, np.int32)
    snap = kv.snapshot({"a": a}, step=5, last_use=last, with_tokens=True)
    t = snap.table(0)
    assert snap.block_tokens(int(t[1])) == (4, 5, 6)
    assert list(snap.last_use[t]) == [5, 5]


def test_large_pool_is_lazy_and_vectorised():
    kv = KVCacheManager(1 << 17, 16)
    snap = kv.snapshot()
    assert snap.num_blocks == 1 << 17 and snap.counts()["free"] == 1 << 17


def test_contiguous_snapshot_cells():
    kv = ContiguousKVCacheManager(64, "max", max_model_len=16)
    a = _req("a", list(range(5)))
    kv.allocate_slots(a, 5)
    snap = kv.snapshot()
    assert isinstance(snap, S.ContiguousSnapshot)
    assert snap.num_reserved == 16 and snap.num_filled == 5
    cells = snap.cell_states(4)
    assert list(cells[:5]) == [S.STATE_USED, S.STATE_USED, S.STATE_RESERVED, S.STATE_RESERVED, S.STATE_FREE]


def test_block_range_reads_only_that_page():
    kv = KVCacheManager(64, 4)
    a = _req("a", list(range(40)))
    kv.allocate_slots(a, 40)
    full = kv.snapshot({"a": a})
    part = kv.snapshot({"a": a}, block_range=(4, 8))
    assert np.array_equal(part.state[4:8], full.state[4:8]) and (part.ref_count[:4] == 0).all()
    assert np.array_equal(part.owner, full.owner) and np.array_equal(part.table_blocks, full.table_blocks)
