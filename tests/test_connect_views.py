"""The server views (paged.viz.forest) draw what the records hold: the forest icicle, usage and
hit rate beside an engine, the miss map, and a ServerView that redraws from a live source."""
from __future__ import annotations

import pandas as pd

import paged.connect as pc
from paged.connect import misses as M
from paged.connect.forest import PrefixForest
from paged.connect.publisher import KVEventPublisher
from paged.connect.wire import BlockRemoved, BlockStored
from paged.viz import forest as V


class Tok:
    def decode(self, ids, skip_special_tokens=False):
        return " ".join(f"t{i}" for i in ids)


def small_forest():
    f = PrefixForest()
    f.apply(BlockStored((1, 2), None, (1, 2, 3, 4), 2), 0.0)
    f.apply(BlockStored((3,), 1, (5, 6), 2), 1.0)
    f.apply(BlockStored((9,), None, (7, 7), 2), 1.5)
    f.apply(BlockRemoved((2,)), 2.0)
    return f


def test_prefix_forest_icicle_has_one_cell_per_node_with_parents_and_states():
    df = small_forest().frame(now=3.0, tokenizer=Tok())
    fig = V.prefix_forest(df)
    ic = fig.data[0]
    root = V.ROOT_ID  # the cache's own row: a forest's implicit root would be an empty band
    assert list(ic.ids) == ["0", "1", "2", "3", root] and list(ic.parents) == [root, "0", "0", root, ""]
    assert list(ic.marker.colors) == [V.STATE_COLORS["live"], V.STATE_COLORS["evicted"], V.STATE_COLORS["live"],
                                      V.STATE_COLORS["live"], V.ROOT_COLOR]
    assert ic.labels[-1] == V.ROOT_LABEL
    assert ic.labels[0] == "t1 t2" and "stored 1x, removed 1x" in ic.hovertext[1]
    assert "3 live, 1 evicted" in fig.layout.title.text
    live_only = V.prefix_forest(df, show_removed=False)
    assert list(live_only.data[0].ids) == ["0", "2", "3", root]
    capped = V.prefix_forest(df, max_nodes=1)  # the newest node and its ancestors
    assert list(capped.data[0].ids) == ["3", root]


def test_server_vs_engine_draws_both_sides():
    server = pd.DataFrame({"time_s": [0.0, 1.0], "kv_cache_usage_perc": [0.1, 0.5], "live_blocks": [2, 5],
                           "hit_rate": [float("nan"), 0.4]})
    steps = pd.DataFrame({"time_s": [0.0, 0.5, 1.0], "kv_cache_usage_perc": [0.2, 0.3, 0.4],
                          "prefix_cache_queries": [0, 100, 200], "prefix_cache_hits": [0, 20, 100]})
    fig = V.server_vs_engine(server, {"ours": steps})
    names = [t.name for t in fig.data]
    assert names == ["vLLM usage", "vLLM cached blocks", "vLLM hit rate", "ours usage", "ours hit rate"]
    assert list(fig.data[4].y[1:]) == [0.2, 0.5]


def test_miss_map_colors_each_block_by_status():
    df = pd.DataFrame([
        {"request_id": "a", "admission": 1, "step": 1, "block": 0, "num_tokens": 4, "status": M.NEVER_SEEN,
         "detail": "", "event_step": None, "by_request": None},
        {"request_id": "b", "admission": 1, "step": 2, "block": 0, "num_tokens": 4, "status": M.HIT,
         "detail": "", "event_step": None, "by_request": None},
        {"request_id": "b", "admission": 1, "step": 2, "block": 1, "num_tokens": 4, "status": M.EVICTED,
         "detail": "evicted at step 1 by the lru policy to make room for a", "event_step": 1, "by_request": "a"},
    ])
    fig = V.miss_map(df)
    hm = fig.data[0]
    assert list(hm.y) == ["a", "b"] and hm.z[0][1] is None
    assert "to make room for a" in hm.text[1][1]
    assert {t.name for t in fig.data[1:]} == {M.NEVER_SEEN, M.HIT, M.EVICTED}


def test_server_view_redraws_from_a_live_source(tmp_path):
    ev = f"ipc://{tmp_path}/ev"
    with KVEventPublisher(ev) as pub, pc.connect(events=ev, background=False, tokenizer=Tok()) as src:
        view = V.ServerView(src)
        assert view.figures["forest"].data[0].ids == ()  # nothing yet
        pub.publish([BlockStored((1, 2), None, (1, 2, 3, 4), 2)])
        assert src.wait_until(lambda s: s.forest.live, 5)
        view.refresh()
        assert list(view.figures["forest"].data[0].ids) == ["0", "1", V.ROOT_ID] and view.frames == 1
        if view.plots:  # widgets present: the LivePlot holds the new figure
            assert list(view.plots["forest"].figure.data[0].ids) == ["0", "1", V.ROOT_ID]
            assert "forest_live=2" in view.status.value


def test_block_axes_have_whole_number_ticks():
    """Few cached blocks (the stand-in's 5) or few prompt blocks: no tick at 2.5 blocks (tests/figure_check.py)."""
    from figure_check import figure_problems
    server = pd.DataFrame({"time_s": [0.0, 1.0, 2.0], "kv_cache_usage_perc": [0.1, 0.5, 0.3], "live_blocks": [2, 5, 4],
                           "hit_rate": [float("nan"), 0.4, 0.5]})
    fig = V.server_vs_engine(server)
    assert figure_problems(fig) == [] and fig.layout.yaxis2.dtick == 1
    assert figure_problems(V.server_vs_engine(None)) == []
    df = pd.DataFrame([{"request_id": r, "admission": 1, "step": 1, "block": b, "num_tokens": 4, "status": M.HIT,
                        "detail": "", "event_step": None, "by_request": None} for r in "ab" for b in range(3)])
    fig = V.miss_map(df)
    assert figure_problems(fig, count_axes=["xaxis"]) == [] and fig.layout.xaxis.dtick == 1
