"""Roofline cost model and its calibration fit."""
from dataclasses import replace

import numpy as np
import pytest

from paged.sim.cost_model import CostModel, StepShape
from paged.errors import ConfigError


def test_decode_is_memory_bound_and_prefill_compute_bound():
    cm = CostModel("llama-2-13b", "a100-80gb")
    dec = cm.breakdown(StepShape.make([1] * 32, [512] * 32))
    # decode: reading 26 GB of weights at 80% of 2,039 GB/s dominates
    assert dec.linear == pytest.approx(cm.model.weight_bytes() / (2039e9 * 0.8), rel=0.02)  # embedding table is not read
    pre = cm.breakdown(StepShape.make([2048], [0]))
    assert pre.linear > 10 * dec.linear / 2  # compute bound: grows with tokens
    assert pre.total == pytest.approx(cm.step_time(StepShape.make([2048], [0])))
    # a full prefill in a decode batch stalls the decodes (Sarathi-Serve)
    mixed = cm.step_time(StepShape.make([2048] + [1] * 32, [0] + [512] * 32))
    assert mixed > 5 * dec.total


def test_step_time_monotone_and_tp():
    cm = CostModel("llama-2-7b", "h100-sxm")
    t = [cm.step_time(StepShape.make([1] * b, [1000] * b)) for b in (1, 8, 64, 256)]
    assert all(a < b for a, b in zip(t, t[1:]))
    assert cm.step_time(StepShape.make([1], [100])) < cm.step_time(StepShape.make([1], [4000]))
    cm4 = CostModel("llama-2-70b", "a100-80gb", tensor_parallel=4)
    b = cm4.breakdown(StepShape.make([1] * 16, [1000] * 16))
    assert b.comm > 0 and b.total < CostModel("llama-2-70b", "a100-80gb").step_time(StepShape.make([1] * 16, [1000] * 16))
    swap = StepShape.make([1], [10], swap_bytes=32e9)
    assert cm.step_time(swap) - cm.step_time(StepShape.make([1], [10])) == pytest.approx(1 / 0.8 / 2, rel=0.01)
    assert cm.step_time(StepShape.make([], [])) == 0.0


def _synthetic_steps(n, seed):
    rng = np.random.default_rng(seed)
    shapes = []
    for _ in range(n):
        nd, npf = int(rng.integers(0, 32)), int(rng.integers(0, 3))
        q = [1] * nd + list(rng.integers(16, 512, npf))
        c = list(rng.integers(10, 2000, nd)) + list(rng.integers(0, 200, npf))
        shapes.append(StepShape.make(q or [1], c or [5]))
    return shapes


def test_fit_recovers_coefficients_and_reports_holdout_error():
    truth = replace(CostModel("smollm2-135m", "a100-80gb"), mfu=0.05, mbu=0.3, step_overhead_s=3e-3,
                    per_seq_s=2e-5)
    shapes = _synthetic_steps(240, 1)
    y = truth.predict(shapes) * np.random.default_rng(2).lognormal(0, 0.03, len(shapes))
    rep = CostModel("smollm2-135m", "a100-80gb").fit(shapes, y, holdout_fraction=0.25, seed=0)
    assert rep.n_holdout == 60 and rep.n_train == 180
    assert rep.holdout_mape < 0.05 and rep.holdout_r2 > 0.98
    m = rep.model
    assert m.effective_flops == pytest.approx(truth.effective_flops, rel=0.1)
    assert m.effective_bandwidth == pytest.approx(truth.effective_bandwidth, rel=0.1)
    assert m.step_overhead_s == pytest.approx(3e-3, rel=0.2)
    assert set(rep.as_dict()) >= {"holdout_mape", "effective_flops", "step_overhead_s"}


def test_fit_faster_device_than_preset_and_errors():
    truth = replace(CostModel("smollm2-135m", "l4"), mfu=1.0, mbu=1.0)
    fast = truth.gpu.with_(peak_flops=4 * truth.gpu.peak_flops, hbm_bandwidth=4 * truth.gpu.hbm_bandwidth)
    truth = replace(truth, gpu=fast)
    shapes = _synthetic_steps(80, 3)
    rep = CostModel("smollm2-135m", "l4").fit(shapes, truth.predict(shapes))
    assert rep.holdout_mape < 0.02 and rep.model.mfu <= 1 and rep.model.mbu <= 1
    with pytest.raises(ConfigError, match=">= 8 steps"):
        CostModel("smollm2-135m", "l4").fit(shapes[:3], [1.0] * 3)
    with pytest.raises(ConfigError, match="same length"):
        StepShape.make([1, 2], [3])


def test_shapes_from_engine_steps():
    from types import SimpleNamespace as NS

    from paged.sim.cost_model import shapes_from_steps

    chunk = lambda start, n, samples: NS(start=start, num_tokens=n, samples=samples)  # noqa: E731
    steps = [NS(scheduled=[chunk(0, 100, True), chunk(50, 1, True)], step_time_s=0.012, num_block_copies=1,
                num_swapped_out_blocks=2, num_swapped_in_blocks=0),
             NS(scheduled=[], step_time_s=0.0001),
             NS(scheduled=[chunk(0, 64, False)], step_time_s=0.008, num_block_copies=0, num_swapped_out_blocks=0,
                num_swapped_in_blocks=0)]
    shapes, secs = shapes_from_steps(steps, block_bytes=1000.0)
    assert len(shapes) == 2 and secs.tolist() == [0.012, 0.008]
    assert shapes[0].q.tolist() == [100, 1] and shapes[0].ctx.tolist() == [0, 50] and shapes[0].num_sampled == 2
    assert shapes[0].swap_bytes == 2000.0 and shapes[0].copy_bytes == 1000.0 and shapes[1].num_sampled == 0


def test_paged_attention_efficiency_from_published_points():
    from paged.sim.cost_model import paged_attention_efficiency as eff

    assert eff(1) == pytest.approx(0.87 / 4.0) and eff(128) == pytest.approx(0.99) and eff(256) == pytest.approx(0.99)
    assert eff(1) < eff(8) < eff(16) < eff(64) < eff(128)
    slow = CostModel("llama-2-7b", "a100-80gb", kv_block_size=1).step_time(StepShape.make([1] * 64, [2000] * 64))
    fast = CostModel("llama-2-7b", "a100-80gb", kv_block_size=128).step_time(StepShape.make([1] * 64, [2000] * 64))
    assert slow > 1.5 * fast


def test_step_frame_roundtrip():
    from types import SimpleNamespace as NS

    from paged.sim.cost_model import shapes_from_frame, shapes_from_steps, calibration_frame

    chunk = lambda start, n, samples: NS(start=start, num_tokens=n, samples=samples)  # noqa: E731
    none = dict(num_block_copies=0, num_swapped_out_blocks=0, num_swapped_in_blocks=0)
    steps = [NS(scheduled=[chunk(0, 100, True), chunk(50, 1, True)], step_time_s=0.012, **none),
             NS(scheduled=[chunk(0, 64, False)], step_time_s=0.008, **none)]
    a, sa = shapes_from_steps(steps)
    b, sb = shapes_from_frame(calibration_frame(steps))
    assert sa.tolist() == sb.tolist()
    assert [(x.q.tolist(), x.ctx.tolist(), x.num_sampled) for x in a] == [(x.q.tolist(), x.ctx.tolist(), x.num_sampled) for x in b]
