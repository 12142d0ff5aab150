"""Figure builders on small data: trace kinds, fixed colour range, hover content, paging."""
import numpy as np
import pandas as pd

from paged.core import KVCacheManager, Request, RequestStatus
from paged.core import snapshot as S
from paged.runs import STEP_COLUMNS
from paged.sim.baselines import ContiguousKVCacheManager
from paged.viz import figures as F


def _snap(num_blocks=40):
    kv = KVCacheManager(num_blocks, 4)
    a = Request("a", list(range(10)), 4)
    a.status = RequestStatus.RUNNING
    kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    kv.fork("a", "b")
    return kv.snapshot({"a": a}, with_tokens=True)


def _steps(n=5):
    rows = [{c: 0 for c in STEP_COLUMNS} for _ in range(n)]
    for i, r in enumerate(rows):
        r.update(step=i + 1, step_time_s=0.01 * (i + 1), num_prefill_tokens=10 * (i % 2), num_decode_tokens=2,
                 kv_cache_usage_perc=0.1 * i, token_usage=0.5, num_preempted=int(i == 3),
                 prefix_cache_queries=10 * i, prefix_cache_hits=4 * i)
    return pd.DataFrame(rows)


def test_block_grid_is_one_heatmap_with_fixed_range_and_hover():
    snap = _snap()
    fig = F.block_grid(snap, highlight="a")
    hm = [t for t in fig.data if t.type == "heatmap"]
    assert len(hm) == 1 and hm[0].zmin == -0.5 and hm[0].zmax == len(F.STATE_COLORS) - 0.5
    z = np.array([[np.nan if v is None else v for v in row] for row in hm[0].z], float)
    assert np.nansum(z == S.STATE_SHARED) == 3 and np.isnan(z).sum() == z.size - 40
    assert "owner a" in hm[0].text[0][0] and "ref 2" in hm[0].text[0][0]
    assert len(fig.data[1].x) == 3  # highlighted blocks of request a
    assert all(t.type != "scattergl" for t in fig.data)


def test_grid_packs_large_pools_and_tokens_decode():
    kv = KVCacheManager(10_000, 16)
    d = F.grid_data(kv.snapshot())  # too many blocks for one cell each: 5 per cell, the whole pool on one page
    assert d["rows"] * d["cols"] <= F.MAX_CELLS and d["num_pages"] == 1 and d["blocks_per_cell"] == 5
    rows, cols = F.grid_shape(10_000)
    assert rows * cols >= 10_000 and cols == d["cols"] * 5

    class Tok:
        def decode(self, ids):
            return "|".join(map(str, ids))
    d = F.grid_data(_snap(), tokenizer=Tok())
    assert "0|1|2|3" in d["text"][0][0]


def test_tables_and_contiguous():
    fig = F.block_tables(_snap())
    assert fig.data[0].type == "heatmap" and fig.data[0].text[0] == ["0", "1", "2"]
    kv = ContiguousKVCacheManager(64, "max", max_model_len=16)
    r = Request("a", list(range(5)), 4)
    kv.allocate_slots(r, 5)
    assert "16 slots reserved" in F.contiguous_grid(kv.snapshot(), 4).layout.title.text


def test_series_figures():
    st = _steps()
    u = F.usage_over_time(st, contiguous=st)
    assert len(u.data) == 4 and np.allclose(u.data[1].y, 100 * st.kv_cache_usage_perc * 0.5)
    tl = F.step_timeline(st)
    assert [t.type for t in tl.data[:3]] == ["bar", "bar", "scatter"] and list(tl.data[3].x) == [4]
    pc = F.prefix_cache(st, pd.DataFrame({"step": [2, 2, 3], "kind": ["evict"] * 3}))
    assert np.isclose(pc.data[0].y[-1], 40.0) and list(pc.data[2].y) == [2, 1]
    req = pd.DataFrame({"ttft_s": [0.1, 0.2]})
    ld = F.latency_distributions({"x": (req, np.array([0.01, 0.02]))})
    assert len(ld.data) == 2 and F.latency_summary({"x": (req, np.array([0.01]))}).loc["x", "ttft_p50_ms"] == 150.0


def test_block_lifetimes_figure():
    ev = pd.DataFrame({"step": [1, 3, 5], "kind": ["allocate", "free", "allocate"], "request_id": ["a"] * 3,
                       "block_id": pd.array([0, 0, 0], dtype="Int64"), "value": pd.array([None] * 3, dtype="Int64")})
    fig = F.block_lifetimes(ev)
    assert list(fig.data[0].x) == [2.0] and list(fig.data[1].x) == [2.0]
