"""The layouts study and its figures, the budget study on today's layouts, and the simulator on a hybrid pool."""
from __future__ import annotations

import numpy as np
import pytest

from paged.errors import ConfigError
from paged.sim.config import SimConfig
from paged.sim.simulator import Simulator
from paged.sim.workload import synthetic_trace
from paged.studies import budget as B
from paged.studies import layouts as L
from paged.viz import budget as BV
from paged.viz import layouts as LV


def test_layout_table_rows():
    t = L.layout_table(["llama-3-70b", "deepseek-v3", "gemma-3-27b"]).set_index("model")
    assert t.loc["llama-3-70b", "saved_128k"] == 0 and t.loc["deepseek-v3", "groups"] == 1
    # Gemma 3 at 128k: 8576 pages of 1,310,720 bytes vs 62 layers x 131072 x 8192 bytes
    assert t.loc["gemma-3-27b", "pool_gb_128k"] == pytest.approx(8576 * 1_310_720 / 1e9)
    assert t.loc["gemma-3-27b", "saved_128k"] == pytest.approx(1 - 8576 * 1_310_720 / (62 * 131072 * 8192))
    assert "window 1,024" in t.loc["gemma-3-27b", "layout"]


def test_budget_is_layout_aware():
    # a sliding layer stops growing at its window: Gemma 3's KV from 4k to 128k grows by the 10 full layers only
    grow = B.request_kv_bytes("gemma-3-27b", 131072) - B.request_kv_bytes("gemma-3-27b", 4096)
    assert grow == 10 * (131072 - 4096) * 2 * 16 * 128 * 2
    arr = B.request_kv_bytes("gemma-3-27b", np.array([4096, 131072]))
    assert list(arr) == [B.request_kv_bytes("gemma-3-27b", 4096), B.request_kv_bytes("gemma-3-27b", 131072)]
    b = B.batch_budget("deepseek-v3", 4096, 2, "bf16", "h200", 8)
    assert b["bytes_per_request"] == 4096 * 61 * 576 * 2 and "MLA" in BV.formula_text(b)
    assert B.request_kv_bytes("llama-2-70b", 4096) == 4096 * 80 * 2 * 8 * 128 * 2  # unchanged for LLaMA
    fig = BV.kv_format_figure("deepseek-v3", 4096)  # int8/int4 have no MLA size: left out, not an error
    assert list(fig.data[0].x) == ["fp32", "fp16", "fp8"]


def test_figures_build():
    fig = LV.request_bytes_figure(["llama-3-70b", "gemma-3-27b"], max_tokens=8192)
    assert len(fig.data) == 2 and fig.data[1].y[-1] < fig.data[0].y[-1]
    growth = BV.kv_growth_figure("gpt-oss-120b", 4096, 1, max_tokens=8192)
    y = np.asarray(growth.data[0].y)
    assert y[-1] < 2 * y[len(y) // 2] * 1.01  # bends: the sliding half stops at 128 tokens


def test_hybrid_pool_in_the_simulator_beside_every_layer_full():
    trace = synthetic_trace("sharegpt", 24, max_model_len=8192, num_prefixes=2, prefix_tokens=600)
    df = L.hybrid_vs_full(trace, "gpt-oss-120b", "h100-sxm", kv_cache_memory_bytes=1 << 28, max_model_len=8192).set_index("variant")
    assert (df["blocks_in_use_at_end"] == 0).all()
    # the same bytes hold twice the pages (18 of 36 layers per page) ...
    page = 16 * 18 * 2 * 8 * 64 * 2
    assert df.loc["hybrid pool", "page_bytes"] * 2 == df.loc["every layer full", "page_bytes"] == 2 * page
    assert df.loc["hybrid pool", "num_kv_pages"] == (1 << 28) // page == 455
    # ... and more requests run at once, as windows free their blocks
    assert df.loc["hybrid pool", "mean_running"] > df.loc["every layer full", "mean_running"]


def test_simulator_checks_hybrid_pools():
    sim = Simulator(SimConfig(model="gemma-3-27b", gpu="h100-sxm", num_blocks=2000, max_model_len=4096))
    assert sim.kv.layout.is_hybrid and len(sim.kv.layout.groups) == 7
    sim.run(synthetic_trace("sharegpt", 12, max_model_len=4096))
    sim.kv.check_invariants()
    assert sim.kv.num_used_blocks == 0
    with pytest.raises(ConfigError, match="use allocator='paged'"):
        Simulator(SimConfig(model="gemma-3-27b", gpu="h100-sxm", allocator="contiguous-max", num_blocks=100))
