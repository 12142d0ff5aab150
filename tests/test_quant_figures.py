"""Figures of the quant study from a synthetic table (no model needed)."""
from __future__ import annotations

import pandas as pd

from paged.viz import quant as figures


def _table() -> pd.DataFrame:
    rows = []
    for ctx in (64, 128):
        for fmt, bits, kld, role in (("fp32", 32, 0.0, "base"), ("fp16", 16, 1e-6, "noise_floor"),
                                     ("int8", 8.25, 1e-3, "quantized"), ("int4", 5, 5e-2, "quantized"),
                                     ("int4_kivi", 5.5, 1e-2, "quantized")):
            rows.append({"context_length": ctx, "source": "all", "format": fmt, "bits_per_value": bits,
                         "tokens_per_gib": 2 ** 30 / (bits * 100), "kld_mean": kld * ctx / 64, "kld_p99": 10 * kld,
                         "delta_nll": kld, "same_top1_pct": 100 - 100 * kld, "first_div_median": 4.0, "role": role,
                         "divergence_tokens": 8, "first_div": [8, 3, 0] if role != "base" else [8, 8, 8]})
    return pd.DataFrame(rows)


def test_figures_build():
    df = _table()
    fig = figures.pareto(df)
    assert list(fig.data[0].text) == ["int4", "int4_kivi", "int8", "fp16"]  # by bits; the base (KLD 0) left out
    assert list(fig.data[1].x) == [5, 5.5, 8.25, 16]                        # each one a Pareto point here
    assert len(figures.error_vs_context(df).data) == 4
    surv = figures.survival_curves(df).data[0]
    assert list(surv.y[:2]) == [1.0, 2 / 3] and surv.y[-1] == 1 / 3
    errs = pd.DataFrame({"format": ["int4", "int4", "int8", "int8"], "layer": [0, 1, 0, 1],
                         "out_rel_err_kv": [.2, .1, .02, .01]})
    assert figures.layer_heatmap(errs).data[0].z.shape == (2, 2)
    ch = pd.DataFrame({"layer": [0, 0, 1, 1], "kv_head": [0, 1, 0, 1], "channel": [0, 0, 0, 0],
                       "absmax": [1., 3., 2., 1.]})
    assert figures.key_outlier_heatmap(ch).data[0].z.tolist() == [[3.0], [2.0]]


def test_render_marks_the_divergence():
    class Tok:
        def decode(self, ids):
            return "".join(chr(97 + i) for i in ids)
    html = figures.render(["a", "b"], ["abc", "abd"], [[0, 1, 2], [0, 1, 3]], Tok())
    assert "first difference at token 2" in html and "background" in html


def test_front_vs_llamacpp_draws_both_rotations_and_our_front():
    ours = pd.DataFrame({"format": ["kvq2", "kvq3", "kvq4", "int8"], "bits": [2.9, 3.9, 4.9, 8.25],
                         "kld_mean": [0.04, 0.005, 0.001, 0.0012], "kld_se": [0.001] * 4,
                         "group": ["front", "front", "front", "earlier"]})
    llama = pd.DataFrame({"format": ["q8_0/q8_0", "q4_0/q4_0", "q8_0/q8_0"], "bits_per_value": [8.5, 4.5, 8.5],
                          "kld_mean": [0.0047, 0.074, 0.0057], "rotation": ["on", "on", "off"]})
    fig = figures.front_vs_llamacpp(ours, llama)
    names = [t.name for t in fig.data]
    assert names == ["front", "earlier", "our Pareto front", "llama.cpp (rotation on, its default)",
                     "llama.cpp (rotation off)"]
    front = fig.data[2]
    assert list(front.x) == [2.9, 3.9, 4.9]  # int8 (8.25 bits, 0.0012) is above the 4.9-bit point: off the front
    assert list(fig.data[3].x) == [4.5, 8.5] and fig.layout.yaxis.type == "log"


def test_quality_and_speed_puts_the_step_ratios_beside_the_kld_panel():
    ours = pd.DataFrame({"format": ["kvq3", "int8"], "bits": [3.9, 8.25], "kld_mean": [0.006, 0.0013]})
    llama = pd.DataFrame({"format": ["q4_0/q4_0"], "bits_per_value": [4.5], "kld_mean": [0.074], "rotation": ["on"]})
    cost = pd.DataFrame({"tool": ["ours", "ours", "ours", "ours", "llama.cpp 0.3.36", "llama.cpp 0.3.36"],
                         "prompt": [512, 512, 512, 2048, 512, 512],
                         "format": ["auto", "kvq3", "int4_kivi", "kvq3", "f16/f16", "q4_0/q4_0"],
                         "bits_per_value": [32, 3.4, 5.0, 3.4, 16, 4.5], "x_base": [1.0, 1.4, 0.9, 1.3, 1.0, 1.6]})
    fig = figures.quality_and_speed(ours, llama, cost)
    speed = [t for t in fig.data if t.xaxis == "x2"]
    assert [t.name for t in speed] == ["ours (native C), batch x 512", "ours (native C), batch x 2048",
                                       "llama.cpp 0.3.36, batch x 512"]
    assert list(speed[0].text) == ["kvq3", "fp32"] and list(speed[0].y) == [1.4, 1.0]  # sorted by bits
    assert list(speed[0].x) == [3.9, 32]  # at the left panel's bits; int4_kivi, not on the left, left out
    assert list(speed[2].text) == ["q4_0", "f16"]
    assert len([t for t in fig.data if t.xaxis in (None, "x")]) == len(figures.front_vs_llamacpp(ours, llama).data)


def test_near_labels_take_turns_above_and_below():
    from paged.viz.quant import _label_sides
    # 2.9 and 3.0 are near (x within 25%, y within 0.05); 4.9 is not near 3.0; 5.0 is near 4.9
    assert _label_sides([2.9, 3.0, 4.9, 5.0, 8.25], [0.93, 0.95, 0.97, 0.93, 0.94]) == \
        ["top center", "bottom center", "top center", "bottom center", "top center"]
    assert _label_sides([2.9, 3.0], [0.5, 0.9]) == ["top center", "top center"]  # far apart in y
