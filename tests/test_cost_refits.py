"""benchmarks/cost_refits.py's alternative GEMM models (no vidur data needed): with their extra
figures at neutral values each is the shipped ``KernelRoofline``, and its searches do what they say."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from paged.sim import cost_validation as cv
from paged.sim.kernel_costs import KERNEL_COSTS, KernelCosts, KernelRoofline

ROOT = Path(__file__).resolve().parents[1]
M = np.arange(1, 4097, 7, dtype=np.float64)


@pytest.fixture(scope="module")
def cr():
    spec = importlib.util.spec_from_file_location("bench_cost_refits", ROOT / "benchmarks" / "cost_refits.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        del sys.modules[spec.name]


def _base(costs: KernelCosts) -> dict:
    return {f: getattr(costs, f) for f in ("gemm_floor_s", "gemm_mfu", "gemm_mbu", "ridge_p", "m_tiles",
                                           "ew_floor_s", "ew_mbu")}


@pytest.mark.parametrize("gpu", ["a100-80gb", "h100-sxm", "a40"])
@pytest.mark.parametrize("tp", [1, 4])
def test_neutral_figures_give_the_shipped_model(cr, gpu, tp):
    c = KERNEL_COSTS[gpu]
    want = KernelRoofline("llama-2-7b", gpu, tp, c).layer_seconds(M)
    neutral = [(cr.WaveRoofline, cr.WaveCosts(**_base(c), alpha=0.0)),
               (cr.OverlapRoofline, cr.OverlapCosts(**_base(c), p1=c.ridge_p)),
               (cr.ShapeRoofline, cr.ShapeCosts(**_base(c)))]
    for cls, costs in neutral:
        np.testing.assert_allclose(cls("llama-2-7b", gpu, tp, costs).layer_seconds(M), want, rtol=1e-12)
    one_tile = KernelRoofline("llama-2-7b", gpu, tp, c.with_(m_tiles=((0, 64),))).layer_seconds(M)
    fill = cr.FillCosts(**_base(c), cands=(64,))
    ideal = cr.IdealCosts(**_base(c), cands=((64, 128),), alpha=0.0)
    for cls, costs in ((cr.FillRoofline, fill), (cr.IdealRoofline, ideal)):
        np.testing.assert_allclose(cls("llama-2-7b", gpu, tp, costs).layer_seconds(M), one_tile, rtol=1e-12)


def test_wave_quantisation_never_makes_a_gemm_cheaper(cr):
    c = KERNEL_COSTS["h100-sxm"]
    base = KernelRoofline("llama-2-70b", "h100-sxm", 2, c).layer_seconds(M)
    for alpha in (0.25, 1.0):
        wave = cr.WaveRoofline("llama-2-70b", "h100-sxm", 2, cr.WaveCosts(**_base(c), alpha=alpha))
        assert np.all(wave.layer_seconds(M) >= base * (1 - 1e-12))


def test_the_schedules_are_valid_and_distinct(cr):
    s = cr._schedules()
    assert len(s) == len(set(s)) == 201
    for tiles in s:
        KernelCosts(5e-6, 0.7, 0.85, 2.0, tiles, 1e-6, 0.5)  # raises on an invalid schedule


def test_the_searches_find_a_known_minimum(cr):
    x, fx = cr.pattern_search(lambda v: float(np.sum((v - np.array([0.3, 2.0])) ** 2)), np.array([1.0, 1.0]),
                              iterations=200)
    np.testing.assert_allclose(x, [0.3, 2.0], atol=2e-3)
    c = KERNEL_COSTS["a40"]
    best, score = cv.coordinate_search(lambda k: abs(k.gemm_mfu - 0.7) + abs(k.ew_mbu - 0.35), c,
                                       {"gemm_mfu": [0.6, 0.7, 0.8], "ew_mbu": [0.3, 0.35]})
    assert (best.gemm_mfu, best.ew_mbu, score) == (0.7, 0.35, 0.0)
