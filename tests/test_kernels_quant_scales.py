"""The quantizers' scales are pinned to their formulas, and errors are bounded by the *input*.

The bounds in test_kernels_quant.py read the scale from the quantizer's own output, so a scale
twice too large passes them. Here each scale is checked against its definition (and a hand
example), and each error against the input's magnitude only:

  int8: scale = fp16(absmax / 127);                 |err| <= absmax (1/254 + 2^-10)
  int4: scale = fp16((max - min) / 15), zero = fp16(min); |err| <= range/30 + 2^-10 (|min| + 2 range)
  fp8:  scale = amax / max_value (float32, per head or per tensor); the amax maps to +-max_value
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import dequantize_kv, quantize_kv, unpack_int4


def _x(seed: int, shape=(48, 3, 64)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.logspace(-2, 2, shape[0]).reshape(-1, 1, 1)


def test_int8_scale_is_absmax_over_127():
    x = torch.tensor([0.0, -2.54, 1.27, 0.5]).reshape(1, 1, 4)
    q = quantize_kv(x, "int8")
    assert q.scale.item() == torch.tensor(2.54 / 127).half().item()  # fp16(0.02)
    assert q.data.flatten().tolist() == [0, -127, 63, 25]
    x = _x(1)
    q = quantize_kv(x, "int8")
    assert torch.equal(q.scale, (x.abs().amax(-1, keepdim=True) / 127).half())
    assert torch.equal(q.data.abs().amax(-1), torch.full((48, 3), 127, dtype=torch.int8))  # the absmax is +-127


def test_int8_error_is_bounded_by_the_input():
    x = _x(2)
    err = (dequantize_kv(quantize_kv(x, "int8"), "int8") - x).abs()
    absmax = x.abs().amax(-1, keepdim=True)
    assert (err <= absmax * (1 / 254 + 2**-10)).all()


@pytest.mark.parametrize("group", [16, 32])
def test_int4_scale_and_zero_are_range_over_15_and_min(group):
    x = torch.linspace(-1.0, 2.0, 32).reshape(1, 1, 32)
    q = quantize_kv(x, "int4", group_size=32)
    assert q.scale.item() == torch.tensor(0.2).half().item() and q.zero.item() == -1.0
    codes = unpack_int4(q.data).flatten()
    assert codes[0] == 0 and codes[-1] == 15  # min -> 0, max -> 15
    x = _x(3)
    q = quantize_kv(x, "int4", group_size=group)
    xg = x.reshape(48, 3, 64 // group, group)
    lo, hi = xg.amin(-1), xg.amax(-1)
    assert torch.equal(q.scale, ((hi - lo) / 15).half()) and torch.equal(q.zero, lo.half())


@pytest.mark.parametrize("group", [16, 32, 64])
def test_int4_error_is_bounded_by_the_input(group):
    x = _x(4)
    err = (dequantize_kv(quantize_kv(x, "int4", group_size=group), "int4") - x).abs()
    xg, eg = x.reshape(48, 3, 64 // group, group), err.reshape(48, 3, 64 // group, group)
    lo, hi = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
    rng = hi - lo
    assert (eg <= rng / 30 + 2**-10 * (lo.abs() + 2 * rng)).all()


@pytest.mark.parametrize("fmt,max_value", [("fp8_e4m3", 448.0), ("fp8_e5m2", 57344.0)])
def test_fp8_scale_is_amax_over_max_value(fmt, max_value):
    x = torch.zeros(2, 3, 4)
    x[1, 0, 2], x[0, 1, 0], x[0, 2, 3] = -8.96, 4.48, 1.0
    s = kernels.fp8_scale(x, fmt)
    want = torch.tensor([8.96, 4.48, 1.0]) / max_value
    assert s.dtype == torch.float32 and torch.equal(s, want)
    assert torch.equal(kernels.fp8_scale(x, fmt, per_head=False), (torch.tensor(8.96) / max_value).expand(3))
    assert torch.equal(kernels.fp8_scale(torch.zeros(1, 3, 4), fmt), torch.ones(3))  # all-zero heads: 1
    x = _x(5)
    q = quantize_kv(x, fmt)  # calibrated: the amax of each head is stored as +-max_value
    assert torch.equal(q.scale, x.abs().amax(dim=(0, 2)) / max_value)
    assert torch.equal(q.data.float().abs().amax(dim=(0, 2)), torch.full((3,), max_value))


@pytest.mark.parametrize("fmt,eps_rel,eps_sub", [("fp8_e4m3", 2**-4, 2**-10 / 448), ("fp8_e5m2", 2**-3, 2**-17 / 57344)])
def test_fp8_error_is_bounded_by_the_input(fmt, eps_rel, eps_sub):
    x = _x(6)
    err = (dequantize_kv(quantize_kv(x, fmt), fmt) - x).abs()
    amax = x.abs().amax(dim=(0, 2)).reshape(1, 3, 1)
    assert (err <= torch.maximum(eps_rel * x.abs(), eps_sub * amax)).all()
