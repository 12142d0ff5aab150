"""KV formats: round trips, exact packing, saturation, and each format's error bound (torch only).

Per-element error bounds checked here (s = the format's scale, x = input):
  fp8_e4m3: |err| <= max(2^-4 |x|, 2^-10 s)  (3 mantissa bits: half an ulp; subnormal step 2^-9 s)
  fp8_e5m2: |err| <= max(2^-3 |x|, 2^-17 s)  (2 mantissa bits; subnormal step 2^-16 s)
  int8:     |err| <= s/2 + 2^-10 absmax        (half a step, plus the fp16 rounding of the scale)
  int4:     |err| <= s/2 + 2^-10 (|min| + range) (half a step, plus fp16 rounding of scale and zero)
  fp16/bf16: one rounding to the dtype.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import dequantize_kv, pack_int4, quantize_kv, unpack_int4


def _x(seed: int, shape=(40, 3, 64)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-2, 1, shape[0]).reshape(-1, *[1] * (len(shape) - 1))
    x[0, 0] = 0.0  # a constant row (zero scale)
    x[1, 1, ..., :8] = 5.0 + torch.arange(8) * 1e-3  # a narrow range
    return x


def test_int4_pack_unpack_exact():
    codes = torch.arange(256, dtype=torch.uint8).reshape(16, 16) % 16
    assert torch.equal(unpack_int4(pack_int4(codes)), codes)
    allbytes = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(pack_int4(unpack_int4(allbytes)), allbytes)
    assert pack_int4(torch.tensor([1, 2], dtype=torch.uint8)).item() == 0x21  # element 2j in the low nibble


@pytest.mark.parametrize("fmt,eps_rel,eps_sub", [("fp8_e4m3", 2**-4, 2**-10), ("fp8_e5m2", 2**-3, 2**-17)])
@pytest.mark.parametrize("per_head", [True, False])
def test_fp8_error_bound_and_calibration(fmt, eps_rel, eps_sub, per_head):
    x = _x(1)
    s = kernels.fp8_scale(x, fmt, per_head=per_head)
    q = quantize_kv(x, fmt, scale=s)
    err = (dequantize_kv(q, fmt) - x).abs()
    bound = torch.maximum(eps_rel * x.abs(), eps_sub * s[:, None])
    assert (err <= bound).all()
    top = x.abs().amax(dim=(0, 2)) if per_head else x.abs().amax().expand(3)
    assert torch.equal(dequantize_kv(quantize_kv(top[None, :, None], fmt, scale=s), fmt).flatten(), top)


def test_fp8_saturates_and_keeps_nan():
    x = torch.tensor([1e9, -1e9, float("inf"), float("nan"), 1.0]).reshape(1, 1, 5)
    e4 = dequantize_kv(quantize_kv(x, "fp8_e4m3", scale=1.0), "fp8_e4m3").flatten()
    e5 = dequantize_kv(quantize_kv(x, "fp8_e5m2", scale=1.0), "fp8_e5m2").flatten()
    assert e4[:3].tolist() == [448.0, -448.0, 448.0] and e5[:3].tolist() == [57344.0, -57344.0, 57344.0]
    assert e4[3].isnan() and e5[3].isnan() and e4[4] == 1 and e5[4] == 1


def test_int8_error_bound():
    x = _x(2)
    q = quantize_kv(x, "int8")
    assert q.data.dtype == torch.int8 and q.scale.shape == (40, 3, 1) and q.scale.dtype == torch.float16
    assert int(q.data.abs().max()) <= 127
    err = (dequantize_kv(q, "int8") - x).abs()
    absmax = x.abs().amax(-1, keepdim=True)
    assert (err <= q.scale.float() / 2 + 2**-10 * absmax).all()


@pytest.mark.parametrize("group", [16, 32, 64])
def test_int4_error_bound(group):
    x = _x(3)
    q = quantize_kv(x, "int4", group_size=group)
    assert q.data.shape == (40, 3, 32) and q.scale.shape == (40, 3, 64 // group) == q.zero.shape
    err = (dequantize_kv(q, "int4") - x).abs().reshape(40, 3, 64 // group, group)
    xg = x.reshape(40, 3, 64 // group, group)
    lo, hi = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
    assert (err <= q.scale.float()[..., None] / 2 + 2**-10 * (lo.abs() + hi - lo)).all()
    assert (err[0, 0] == 0).all()  # constant row is exact


@pytest.mark.parametrize("fmt,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_baseline_is_a_cast(fmt, dtype):
    x = _x(4)
    assert torch.equal(dequantize_kv(quantize_kv(x, fmt), fmt), x.to(dtype).float())


def test_block_layout_round_trip():
    """Quantized data and side tensors keep the cache's block layout through dequantize_kv."""
    x = _x(5, (6, 4, 3, 64))
    for fmt in ("int8", "int4", "fp8_e4m3"):
        q = quantize_kv(x, fmt)
        assert dequantize_kv(q, fmt).shape == x.shape


def test_format_names():
    assert kernels.get_format("auto", torch.bfloat16).name == "bf16"
    assert kernels.get_format("E5M2").name == "fp8_e5m2"
    with pytest.raises(kernels.KVFormatError, match="use one of"):
        kernels.get_format("nf4")
    with pytest.raises(kernels.KVFormatError, match="pass kv_format"):
        kernels.get_format("auto", torch.uint8)


def test_kivi_keys_per_channel():
    """Per-channel keys: error within half a step per (group, channel); residual tokens exact;
    channel outliers hurt per-token int4 more than per-channel (KIVI's point)."""
    from kernels.kivi import dequantize_keys_per_channel, quantize_keys_per_channel
    g = torch.Generator().manual_seed(6)
    k = torch.randn(70, 2, 64, generator=g)
    k[..., 5] *= 20  # an outlier channel, as in real keys
    q = quantize_keys_per_channel(k, group_size=16)
    assert q.data.shape == (64, 2, 32) and q.scale.shape == (4, 2, 64) and q.residual.shape == (6, 2, 64)
    back = dequantize_keys_per_channel(q)
    assert torch.equal(back[64:], k[64:])
    kg = k[:64].reshape(4, 16, 2, 64)
    lo, hi = kg.amin(1), kg.amax(1)
    err = (back[:64].reshape(4, 16, 2, 64) - kg).abs()
    assert (err <= q.scale.float()[:, None] / 2 + 2**-10 * (lo.abs() + hi - lo)[:, None]).all()
    per_token = (dequantize_kv(quantize_kv(k, "int4"), "int4") - k).pow(2).mean()
    assert (back - k).pow(2).mean() < per_token
