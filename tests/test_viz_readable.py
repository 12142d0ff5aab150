"""Every figure builder of paged.viz, run on small inputs, passes tests/figure_check.py (readable by
construction); and the checker itself finds what issue 20 saw (it fails on the old figures)."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest

from paged.core import KVCacheManager, Request, RequestStatus
from paged.runs import STEP_COLUMNS
from paged.viz import budget as BV
import figure_check as check
from paged.viz import figures as F
from paged.viz import fragmentation as FV
from paged.viz import preemption as RV
from paged.viz import prefix as PV
from paged.viz import quant as QV
from paged.viz import tiers as TV


# ---- inputs ------------------------------------------------------------------------------
def _snap(num_blocks: int = 40, requests: int = 2, tokens: int = 10, block_size: int = 4):
    kv = KVCacheManager(num_blocks, block_size)
    reqs = {}
    for i in range(requests):
        r = Request(f"r{i}", list(range(i * 1000, i * 1000 + tokens)), 4)
        r.status = RequestStatus.RUNNING
        assert kv.allocate_slots(r, tokens) is not None
        r.num_computed_tokens = tokens
        reqs[r.request_id] = r
    kv.fork("r0", "r0-copy")
    return kv.snapshot(reqs, with_tokens=True)


def _steps(n: int = 6) -> pd.DataFrame:
    rows = [{c: 0 for c in STEP_COLUMNS} for _ in range(n)]
    for i, r in enumerate(rows):
        r.update(step=i + 1, step_time_s=0.01 * (i + 1), num_prefill_tokens=3 * (i % 2), num_decode_tokens=2,
                 kv_cache_usage_perc=0.1 * i, token_usage=0.5, num_preempted=int(i == 3), num_cached_free_blocks=i % 3,
                 prefix_cache_queries=10 * i, prefix_cache_hits=4 * i)
    return pd.DataFrame(rows)


def _events() -> pd.DataFrame:
    return pd.DataFrame({"step": [1, 3, 5, 6, 8], "kind": ["allocate", "free", "allocate", "free", "evict"],
                         "request_id": ["a", "a", "b", "b", "b"], "block_id": pd.array([0, 0, 0, 0, 0], dtype="Int64"),
                         "value": pd.array([None] * 5, dtype="Int64")})


def _quant_table() -> pd.DataFrame:
    rows = []
    for ctx in (64, 128):
        for fmt, bits, kld, role in (("fp32", 32, 0.0, "base"), ("fp16", 16, 1e-6, "noise_floor"),
                                     ("int8", 8.25, 1e-3, "quantized"), ("int4", 5, 5e-2, "quantized"),
                                     ("int4_kivi", 6, 1e-2, "quantized")):
            rows.append({"context_length": ctx, "source": "all", "format": fmt, "bits_per_value": bits,
                         "tokens_per_gib": 2 ** 30 / (bits * 100), "kld_mean": kld * ctx / 64, "kld_p99": 10 * kld,
                         "delta_nll": kld, "same_top1_pct": 100 - 100 * kld, "first_div_median": 4.0, "role": role,
                         "divergence_tokens": 8, "first_div": [8, 3, 0] if role != "base" else [8, 8, 8]})
    return pd.DataFrame(rows)


def _layer_errors(formats=("int8", "int4", "int4_kivi", "int4+rot"), layers=range(30)) -> pd.DataFrame:
    return pd.DataFrame([{"format": f, "layer": l, "out_rel_err_k": 0.01 * (i + 1) * (1 + l % 3),
                          "kld_mean": 0.001 * (l + 1)} for i, f in enumerate(formats) for l in layers])


def _latency(n: int, scale: float, tail: float) -> tuple[pd.DataFrame, np.ndarray]:
    rng = np.random.default_rng(0)
    tbt = scale * rng.lognormal(0, 0.3, 200)
    tbt[:3] *= tail
    return pd.DataFrame({"ttft_s": scale * 20 * rng.lognormal(0, 1, n)}), tbt


def _builders():
    """(name, zero-argument builder) of every figure builder, on small inputs."""
    snap, st, ev = _snap(), _steps(), _events()
    big = _snap(31_678, requests=40, tokens=400, block_size=16)
    q = _quant_table()
    sim = {"no chunking": _latency(40, 0.02, 100), "chunked": _latency(40, 0.02, 5)}
    from paged.studies import fragmentation as FS
    from paged.studies import preemption as RS
    from paged.studies.compaction import compaction_snapshots
    from paged.viz.compaction import compaction_grids
    results = FS.run_allocators(FS.shared_trace("sharegpt", 30, seed=1), num_blocks=256)
    sweep = FS.block_size_sweep((1, 16, 256), trace=FS.shared_trace("sharegpt", 20, seed=2))
    est = pd.DataFrame({"block_size": [4, 4, 64, 64], "step": [1, 2, 1, 2], "num_used_blocks": [2, 3, 1, 1],
                        "token_usage": [1.0, 0.75, 0.5, 0.25], "num_running": [1, 1, 1, 1]})
    est["reserved"] = est["num_used_blocks"] * est["block_size"]
    est["held"] = est["reserved"] * est["token_usage"]
    est["contiguous_reserved"] = est["num_running"] * 512
    ctab = pd.DataFrame({"setting": ["off", "on"], "prefill_tokens_computed": [200, 120], "hit_tokens": [0, 80],
                         "hit_rate": [0.0, 0.4]})
    esweep = pd.DataFrame({"pool_tokens": [2560, 10240], "hit_rate": [0.1, 0.6], "prefix_tokens_total": [4096] * 2})
    mst = pd.DataFrame({"step": [1, 2, 3], "num_used_blocks": [4, 5, 3], "num_preempted": [0, 1, 0]})
    tiers = pd.DataFrame({"variant": ["recompute", "host tier, LRU"], "swaps": [0, 120],
                          "gpu_hit_rate": [0.46, 0.43], "host_hit_rate": [0.0, 0.03]})
    stream = pd.DataFrame({"variant": ["device only", "stream overlap int4"] * 2, "kv_fraction": [1.0, 1.0, .25, .25],
                           "context": [1024] * 4, "tbt_vs_device": [1.0, 1.08, 1.0, 1.09],
                           "throughput_vs_device": [1.0, 1.47, 1.0, 2.93]})
    share = pd.DataFrame({"kind": ["base", "pair", "pair", "k_pairs", "k_pairs"],
                          "order": [math.nan, math.nan, math.nan, "cost", "similarity"], "k": [0, 1, 1, 2, 2],
                          "share_with": [None, "{1: 0}", "{10: 9}", "{1: 0, 10: 9}", "{1: 0, 10: 9}"],
                          "memory_saved_pct": [0.0, 3.3, 3.3, 6.7, 6.7], "kld_mean": [0.0, 2.9, 0.07, 0.34, 0.34],
                          "js_head": [math.nan, 0.56, 0.54, math.nan, math.nan]})
    ch = pd.DataFrame([{"layer": l, "kv_head": h, "channel": c, "absmax": 1.0 + (c == 3) * 10}
                       for l in range(30) for h in range(2) for c in range(64)])
    return [
        ("block_grid", lambda: F.block_grid(snap, highlight="r0")),
        ("block_grid, 31,678 blocks", lambda: F.block_grid(big, highlight="r1")),
        ("block_grid, 20 blocks", lambda: F.block_grid(_snap(20))),
        ("block_tables", lambda: F.block_tables(snap)),
        ("usage_over_time", lambda: F.usage_over_time(st, contiguous=st)),
        ("usage_over_time, empty (live start)", lambda: F.usage_over_time(st.iloc[:0])),
        ("step_timeline", lambda: F.step_timeline(st)),
        ("step_timeline, empty (live start)", lambda: F.step_timeline(st.iloc[:0])),
        ("compare_step_timelines", lambda: F.compare_step_timelines({"a": st, "b": st.assign(num_prefill_tokens=400)})),
        ("latency_distributions, one run", lambda: F.latency_distributions({"x": sim["chunked"]})),
        ("latency_distributions, compared", lambda: F.latency_distributions(sim)),
        ("prefix_cache", lambda: F.prefix_cache(st, ev)),
        ("block_lifetimes", lambda: F.block_lifetimes(ev)),
        ("budget.kv_growth_figure", lambda: BV.kv_growth_figure("llama-2-70b", 4096, 8, tensor_parallel=4)),
        ("budget.kv_format_figure", lambda: BV.kv_format_figure("llama-2-70b", 4096, 8, tensor_parallel=4)),
        ("budget.waste_curve_figure", lambda: BV.waste_curve_figure(4096, 16)),
        ("budget.preallocation_figure", lambda: BV.preallocation_figure([100, 500, 900], 4096, 16)),
        ("fragmentation.reserved_vs_held_figure", lambda: FV.reserved_vs_held_figure(results)),
        ("fragmentation.token_share_figure", lambda: FV.token_share_figure(FS.token_share_table(results))),
        ("fragmentation.block_size_figure", lambda: FV.block_size_figure(sweep)),
        ("fragmentation.engine_usage_figure", lambda: FV.engine_usage_figure(est)),
        ("prefix.caching_figure", lambda: PV.caching_figure(ctab)),
        ("prefix.eviction_figure", lambda: PV.eviction_figure(esweep)),
        ("preemption.modes_figure", lambda: RV.modes_figure({"reference": mst.assign(num_preempted=0), "swap": mst})),
        ("preemption.cost_figure", lambda: RV.cost_figure(RS.cost_table("llama-2-70b", "a100-80gb", (256, 4096),
                                                                          tensor_parallel=4))),
        ("tiers.tier_figure", lambda: TV.tier_figure(tiers)),
        ("tiers.streaming_figure", lambda: TV.streaming_figure(stream)),
        ("tiers.sharing_figure", lambda: TV.sharing_figure(share)),
        ("compaction.compaction_grids", lambda: compaction_grids(compaction_snapshots(steps=30))),
        ("quant.pareto", lambda: QV.pareto(q)),
        ("quant.error_vs_context", lambda: QV.error_vs_context(q)),
        ("quant.survival_curves", lambda: QV.survival_curves(q)),
        ("quant.layer_heatmap, 4 formats", lambda: QV.layer_heatmap(_layer_errors(), "out_rel_err_k")),
        ("quant.layer_heatmap, 1 row", lambda: QV.layer_heatmap(_layer_errors(["int4"], [0, 1, 29]), "kld_mean")),
        ("quant.key_outlier_heatmap", lambda: QV.key_outlier_heatmap(ch)),
        ("quant.pareto, the shipped full 05 study", lambda: QV.pareto(_precomputed("study"), 2048)),
        ("quant.layer_heatmap, the shipped sensitivity", lambda: QV.layer_heatmap(_precomputed("sensitivity"), "kld_mean")),
        ("quant.quality_and_speed, the shipped front and cost run", lambda: QV.quality_and_speed(
            _precomputed("front").query("protocol == 'lic19' and group != 'other split formats'"),  # as notebook 05
            _precomputed("llamacpp"), _precomputed("cost"))),
        ("tiers.sharing_figure, the shipped 29 pairs", lambda: TV.sharing_figure(_precomputed("sharing", "08"))),
        ("tiers.sharing_figure, 10 labelled pairs", lambda: TV.sharing_figure(_every_third_pair(_precomputed("sharing", "08")))),
        ("tiers.tier_figure, the shipped run", lambda: TV.tier_figure(_precomputed("tiers", "08"))),
        ("tiers.streaming_figure, the shipped run", lambda: TV.streaming_figure(_precomputed("streaming", "08"))),
    ]


def _precomputed(name: str, notebook: str = "05") -> pd.DataFrame:
    from paged.studies import precomputed
    return precomputed.load(notebook, name)


def _every_third_pair(df: pd.DataFrame) -> pd.DataFrame:
    pairs = df.index[df["kind"] == "pair"]
    return df[(df["kind"] != "pair") | df.index.isin(pairs[::3])]


BUILDERS = _builders()


@pytest.mark.parametrize("build", [b for _, b in BUILDERS], ids=[n for n, _ in BUILDERS])
def test_every_figure_is_readable(build) -> None:
    fig = build()
    assert isinstance(fig, go.Figure)
    assert check.figure_problems(fig) == []


# ---- the checker finds what was seen -----------------------------------------------------
def test_checker_flags_a_flat_heatmap_and_its_colourbar() -> None:
    z = np.random.default_rng(0).random((4, 30))
    fig = go.Figure(go.Heatmap(z=z, y=["a", "b", "c", "d"])).update_layout(height=120 + 28 * 1)  # the old 05 sizing
    problems = " ".join(check.figure_problems(fig))
    assert "px tall" in problems and "heatmap rows" in problems and "colour bar" in problems


@pytest.mark.parametrize("rows,problems", [
    (25, []),                                                                   # 300 px / 25 = 12.0: at the limit
    (26, ["heatmap rows are 11.5 px tall (< 12): 26 rows in 300 px"]),         # just below it
    (50, ["heatmap rows are 6.0 px tall (< 12): 50 rows in 300 px"])])         # half of it
def test_checker_flags_heatmap_rows_just_below_12_px_and_passes_them_at_12(rows, problems) -> None:
    """A figure with room for everything else (400 px, margins 50 + 50: a 300-px plot, a full-height
    colour bar): only the px per row decides. 12 px is also the browser test's MIN_ROW_PX."""
    z = np.random.default_rng(0).random((rows, 30))
    fig = go.Figure(go.Heatmap(z=z, y=[f"r{i}" for i in range(rows)]))
    fig.update_layout(height=400, margin=dict(t=50, b=50, l=60, r=20))
    assert check.figure_problems(fig) == problems


def test_checker_flags_fractional_ticks_on_counts_and_accepts_integer_ones() -> None:
    fig = go.Figure(go.Bar(x=[1, 2, 3], y=[0, 2, 3])).update_layout(yaxis_title="blocks", xaxis_title="step")
    assert len(check.figure_problems(fig)) == 2
    from paged.viz.sizing import count_axis
    fig.update_yaxes(**count_axis(3)).update_xaxes(**count_axis(3))
    assert check.figure_problems(fig) == []
    live = go.Figure(go.Scatter(x=[], y=[])).update_yaxes(title_text="tokens in the step", **count_axis())
    assert check.figure_problems(live) == []
    assert check.figure_problems(go.Figure(go.Scatter(x=[0, 1], y=[0, 3])), count_axes=["yaxis"])


def test_checker_flags_overlaid_histograms_a_hidden_tail_and_colliding_labels() -> None:
    x = np.r_[np.zeros(500), [1e4]]
    fig = go.Figure([go.Histogram(x=x, nbinsx=40), go.Histogram(x=x + 1, nbinsx=40)]).update_layout(barmode="overlay")
    p = check.figure_problems(fig)
    assert any("overlaid" in s for s in p) and any("tail is invisible" in s for s in p)
    labels = go.Figure(go.Scatter(x=[50, 150, 200, 3200], y=[98.8, 96.3, 95.1, 21.9], mode="markers+text",
                                  text=["50: 98.8%", "150: 96.3%", "200: 95.1%", "3,200: 21.9%"],
                                  textposition="top right")).update_xaxes(type="log", range=[0, math.log10(4096)])
    p = check.figure_problems(labels.update_yaxes(range=[0, 105]))
    assert any("overlap" in s for s in p)


def test_checker_flags_wide_tables_truncated_cells_and_machine_paths() -> None:
    wide = pd.DataFrame({f"a_rather_long_column_name_{i}": [1.234567] for i in range(12)})
    assert any("px" in s for s in check.table_problems(wide))
    cut = pd.DataFrame({"claim": ["x " * 60], "where": ["/work/main/docs/swap.md"]})
    p = check.table_problems(cut)
    assert any("longer than pandas shows" in s for s in p) and any("path of this machine" in s for s in p)
    assert check.output_problems("saved /tmp/abc/02.npz") and not check.output_problems("saved artefacts/02.npz")


def test_large_pool_grid_is_one_dense_page_and_clicks_map_to_blocks() -> None:
    big = _snap(31_678, requests=40, tokens=400, block_size=16)
    d = F.grid_data(big, highlight="r1")
    rows, cols = F.grid_shape(big.num_blocks)
    assert d["dense"] and d["num_pages"] == 1 and rows * cols >= big.num_blocks
    assert d["rows"] * d["cols"] <= F.MAX_CELLS
    z = np.array([[np.nan if v is None else v for v in r] for r in d["z"]], float)
    k = d["blocks_per_cell"]
    held = (big.state >= 2).sum()
    assert np.nansum(z) * k == pytest.approx(held, abs=k)  # densities add up to the blocks holding KV
    # a click at a highlighted cell lands on a block of that request (live.Dashboard maps y * cols + int(x))
    x, y = d["hl_x"][0], d["hl_y"][0]
    block = int(y) * cols + int(x)
    assert block // k in set(big.table("r1") // k)
    fig = F.block_grid(big)
    assert fig.layout.height < 800 and not any(t.name == "reserved, empty" for t in fig.data)


def test_label_positions_keep_coincident_labels_apart() -> None:
    from paged.viz.sizing import label_positions
    pos = label_positions([5, 5, 5, 5.5, 8.25], [0.06, 0.048, 0.021, 0.016, 0.0008],
                          ["int4", "int4+rot", "kivi_g32/int4", "int4_kivi", "int8"], log_y=True)
    assert len(set(pos[:3])) == 3  # three formats at 5 bits: three different sides
    fig = go.Figure(go.Scatter(x=[5, 5, 5, 5.5, 8.25], y=[0.06, 0.048, 0.021, 0.016, 0.0008], mode="markers+text",
                               text=["int4", "int4+rot", "kivi_g32/int4", "int4_kivi", "int8"], textposition=pos))
    assert check.figure_problems(fig.update_yaxes(type="log")) == []
