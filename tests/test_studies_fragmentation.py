"""paged.studies.fragmentation: allocators on one trace, token shares vs the paper; its figures
(paged.viz.fragmentation) carry the data."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from paged.errors import ConfigError
from paged.studies import fragmentation as F
from paged.viz import fragmentation as FF


@pytest.fixture(scope="module")
def results():
    return F.run_allocators(F.shared_trace("sharegpt", 60, seed=1), num_blocks=256)  # 4,096 slots: a queue forms


def test_same_memory_and_trace_for_every_allocator(results) -> None:
    caps = {r.summary["kv_capacity_tokens"] for r in results.values()}
    assert len(caps) == 1
    assert all(r.summary["requests_finished"] == 60 for r in results.values())
    with pytest.raises(ConfigError):
        F.run_allocators(F.shared_trace("sharegpt", 2), ("buddy",))


def test_paging_holds_most_tokens_and_max_the_fewest(results) -> None:
    t = F.token_share_table(results).set_index("allocator")
    share = t["token_share_of_pool"]
    assert share.iloc[-1] > 0.85 and share.iloc[0] < 0.3  # paged vs contiguous-max
    assert share.is_monotonic_increasing  # max < pow2 < oracle < paged
    assert t["paged_speedup"].iloc[0] > 2 and t["paged_speedup"].iloc[-1] == pytest.approx(1.0)
    assert t["paper_token_share"].tolist() == [0.204, 0.268, 0.382, 0.963]
    assert np.allclose(t["difference_pts"], 100 * (share - t["paper_token_share"]))


def test_pool_share_is_held_over_pool_while_requests_wait() -> None:
    st = pd.DataFrame({"num_waiting": [1, 1, 0], "step_time_s": [1.0, 3.0, 5.0],
                       "kv_cache_usage_perc": [1.0, 0.5, 0.2], "token_usage": [0.5, 1.0, 1.0]})
    assert F.pool_share_under_load(st) == pytest.approx((0.5 * 1 + 0.5 * 3) / 4)
    assert np.isnan(F.pool_share_under_load(st.assign(num_waiting=0)))


def test_figures_carry_the_numbers(results) -> None:
    fig = FF.reserved_vs_held_figure(results)
    assert len(fig.data) == 2 * len(results)
    r = results["paged"]
    d = FF.held_and_reserved(r.steps, r.summary["kv_capacity_tokens"])
    assert (d["held"] <= d["reserved"] + 1e-9).all()
    table = F.token_share_table(results)
    bars = FF.token_share_figure(table)
    assert list(bars.data[1].y) == pytest.approx([20.4, 26.8, 38.2, 96.3])


def test_block_size_sweep_fragmentation_grows_with_block_size() -> None:
    sw = F.block_size_sweep((1, 16, 256), trace=F.shared_trace("sharegpt", 40, seed=2))
    frag = sw["internal_fragmentation"].to_numpy()
    assert frag[0] == pytest.approx(0.0) and frag[0] < frag[1] < frag[2]
    assert len(FF.block_size_figure(sw).data) == 2


def test_engine_tables_from_step_rows() -> None:
    st = pd.DataFrame({"block_size": [4, 4, 64, 64], "step": [1, 2, 1, 2], "num_used_blocks": [2, 3, 1, 1],
                       "token_usage": [1.0, 0.75, 0.5, 0.25], "num_running": [1, 1, 1, 1]})
    st["reserved"] = st["num_used_blocks"] * st["block_size"]
    st["held"] = st["reserved"] * st["token_usage"]
    st["contiguous_reserved"] = st["num_running"] * 512
    t = F.engine_share_table(st).set_index("block_size")
    assert t.loc[4, "token_share_paged"] == pytest.approx(17 / 20)
    assert t.loc[64, "token_share_contiguous_max"] == pytest.approx(48 / 1024)
    assert len(FF.engine_usage_figure(st).data) == 3
