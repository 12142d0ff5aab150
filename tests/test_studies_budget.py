"""paged.studies.budget: the sizing formula, preallocation waste, and circulating figures recomputed;
its figures and panel (paged.viz.budget)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from paged.errors import ConfigError
from paged.sim.specs import get_model
from paged.studies import budget as B
from paged.viz import budget as BV


def test_formula_matches_the_package_sizing_rule() -> None:
    m = get_model("llama-2-70b")
    assert B.kv_bytes(80, 4096, 8, 128, 2) == 2 * 80 * 4096 * 8 * 128 * 2
    assert B.request_kv_bytes(m, 4096) == B.kv_bytes(m.num_layers, 4096, m.num_kv_heads, m.head_dim, 2)
    t = np.array([0, 1, 1000, 4096])
    assert np.allclose(B.request_kv_bytes(m, t), t * m.kv_bytes_per_token("fp16"))


def test_llama2_70b_4096_fp16_is_1_34_gb_per_request() -> None:
    assert B.request_kv_bytes("llama-2-70b", 4096, "fp16") / B.GB == pytest.approx(1.342, abs=1e-3)


def test_published_waste_figures_match_other_request_lengths() -> None:
    # "98.8% wasted for a 150-token request" and "95.1% for 3,200 tokens" (4,096 reserved)
    assert B.reservation_waste(150, 4096) == pytest.approx(0.963, abs=5e-4)
    assert B.reservation_waste(3200, 4096) == pytest.approx(0.219, abs=5e-4)
    assert round(B.reservation_waste(50, 4096), 3) == 0.988
    assert round(B.reservation_waste(200, 4096), 3) == 0.951
    assert round(B.tokens_for_waste(0.988, 4096)) == 49 and round(B.tokens_for_waste(0.951, 4096)) == 201


def test_kv_is_linear_not_quadratic_in_length() -> None:
    a, b = B.request_kv_bytes("llama-2-70b", 4096), B.request_kv_bytes("llama-2-70b", 8192)
    assert b / a == pytest.approx(2.0)


def test_llama65b_2048_tokens_is_5_4_gb_and_160_gb_is_30_requests() -> None:
    gb = B.request_kv_bytes(B.LLAMA_65B, 2048) / B.GB
    assert gb == pytest.approx(5.37, abs=0.01)
    assert 160 / gb == pytest.approx(29.8, abs=0.1)


def test_claims_table_has_a_verdict_for_each_claim() -> None:
    df = B.check_claims()
    assert list(df.columns) == ["claim", "published", "computed", "verdict"] and len(df) == 5
    assert df["verdict"].iloc[0].startswith("right")
    assert all(v.startswith("wrong") for v in df["verdict"].iloc[1:])
    assert "96.3%" in df["computed"].iloc[1] and "21.9%" in df["computed"].iloc[2]


def test_paged_waste_is_only_the_last_block() -> None:
    assert B.paged_waste(16, 16) == 0.0 and B.paged_waste(17, 16) == pytest.approx(15 / 32)
    assert B.paged_waste(np.array([0, 1, 150]), 16).tolist() == pytest.approx([0.0, 15 / 16, 10 / 160])
    with pytest.raises(ConfigError):
        B.reservation_waste(5000, 4096)
    with pytest.raises(ConfigError):
        B.kv_bytes(0, 10, 8, 128)


def test_figures_carry_the_numbers() -> None:
    f = BV.kv_growth_figure("llama-2-70b", 4096, batch=2)
    assert f.data[1].y[0] == pytest.approx(2 * 1.342, abs=1e-2)
    assert np.allclose(np.diff(np.diff(f.data[0].y)), 0, atol=1e-9)  # a straight line
    g = BV.kv_format_figure("llama-2-70b", 4096, formats=("fp16", "fp8"))
    assert g.data[0].y[1] == pytest.approx(g.data[0].y[0] / 2)
    w = BV.waste_curve_figure(4096, 16)
    assert max(w.data[1].y) < 100 and w.data[0].y[0] == pytest.approx(100 * (1 - 1 / 4096))
    p = BV.preallocation_figure([100, 300], max_len=1000, block_size=16)
    assert p.data[0].y[0] == 400 and p.data[1].y[0] == 1600 and p.data[1].y[1] == 16 * (7 + 19) - 400


def test_panel_redraws_on_a_slider_change() -> None:
    panel = BV.budget_panel("llama-2-70b", 4096, 1)
    growth = panel.children[3]
    before = growth.data[1].y[0]
    panel.children[1].children[1].value = 4  # batch
    assert growth.data[1].y[0] == pytest.approx(4 * before)
    sent = json.loads(growth._figure)  # what the browser was sent: the redrawn figure, as one frame
    assert sent["data"][1]["y"][0] == pytest.approx(4 * before)
    assert "× batch 4" in panel.children[2].value


def test_tensor_parallel_splits_kv_heads_and_a_bad_split_is_shown() -> None:
    one, four = B.batch_budget("llama-2-70b", 4096, 1), B.batch_budget("llama-2-70b", 4096, 1, tensor_parallel=4)
    assert four["bytes_per_request"] == pytest.approx(one["bytes_per_request"] / 4)
    assert one["kv_room_bytes"] == 0 and four["kv_room_bytes"] > 0
    panel = BV.budget_panel("llama-2-70b", 4096, 1, tensor_parallel=4)
    panel.children[0].children[0].value = "smollm2-135m"  # 3 KV heads do not split over 4 GPUs
    assert "tensor_parallel=4" in panel.children[2].value
