"""Torch reference quantizers for the KV formats (see :mod:`kernels.formats`).

These define what every kernel must reproduce bit for bit:

* fp8: ``code = cast(clamp(x / scale, -max, max))`` with torch's round-to-nearest-even cast;
  NaN stays NaN. ``scale`` is per KV head (float32).
* int8: symmetric per token-head; ``scale = fp16(absmax / 127)``, ``code = clamp(rne(x / s), ±127)``
  where ``s`` is the fp16 scale read back as float32 (1 when it is 0).
* int4: asymmetric per token-head group of ``group_size`` along head_dim;
  ``scale = fp16((max - min) / 15)``, ``zero = fp16(min)``, ``code = clamp(rne((x - zero) / s), 0, 15)``;
  element ``2j`` goes in the low nibble of byte ``j``, element ``2j + 1`` in the high nibble.

Quantizing with the stored (rounded) fp16 scale keeps quantize and dequantize consistent.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .errors import KVFormatError, ShapeError
from .format_table import CODE_INT8
from .formats import DEFAULT_INT4_GROUP, KVFormat, get_format

__all__ = ["QuantizedKV", "quantize_kv", "dequantize_kv", "fp8_scale", "as_head_scale", "pack_int4", "unpack_int4"]


class QuantizedKV(NamedTuple):
    """Stored codes plus their side tensors (``None`` where a format has none)."""

    data: torch.Tensor
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None


def fp8_scale(x: torch.Tensor, kv_format: str | KVFormat = "fp8_e4m3", *, per_head: bool = True) -> torch.Tensor:
    """Calibration scale ``absmax / fp8_max`` for ``x`` ``[..., num_kv_heads, head_dim]``.

    Returns float32 ``[num_kv_heads]`` (a per-tensor scale is repeated in every head).
    """
    fmt = get_format(kv_format)
    if not fmt.is_fp8:
        raise KVFormatError(f"fp8_scale needs an fp8 format, got {fmt.name!r}")
    a = x.detach().float().abs().reshape(-1, x.shape[-2], x.shape[-1])
    amax = a.amax(dim=(0, 2)) if per_head else a.amax().expand(x.shape[-2])
    return torch.where(amax > 0, amax / fmt.max_value, torch.ones_like(amax)).contiguous()


def as_head_scale(scale: torch.Tensor | float | None, num_heads: int, device: torch.device) -> torch.Tensor:
    """Normalise an fp8 scale (None, float, 0-d, [1] or [H]) to float32 ``[H]``."""
    if scale is None:
        return torch.ones(num_heads, dtype=torch.float32, device=device)
    s = torch.as_tensor(scale, dtype=torch.float32, device=device).reshape(-1)
    if s.numel() == 1:
        return s.expand(num_heads).contiguous()
    if s.numel() != num_heads:
        raise ShapeError(f"fp8 scale has {s.numel()} values; give one per tensor or one per KV head ({num_heads})")
    return s.contiguous()


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes in [0, 15] along the last dim (even length) two per byte."""
    if codes.shape[-1] % 2:
        raise ShapeError(f"int4 packing needs an even last dim, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``[..., n]`` uint8 -> ``[..., 2n]`` uint8 codes."""
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def _no_kivi(fmt: KVFormat) -> None:
    if fmt.k_per_channel:
        raise KVFormatError("int4_kivi is not a per-tensor codec: its V is kv_format='int4' and its K is "
                            "quantized per channel over a block (kernels.kivi.quantize_k_blocks)")


def safe_divisor(s32: torch.Tensor) -> torch.Tensor:
    """``s32`` with its zeros replaced by 1: a scale that is safe to divide by (a zero scale's codes are 0)."""
    return torch.where(s32 == 0, torch.ones_like(s32), s32)


def quantize_kv(x: torch.Tensor, kv_format: str | KVFormat, *, scale: torch.Tensor | float | None = None,
                group_size: int = DEFAULT_INT4_GROUP) -> QuantizedKV:
    """Quantize ``x`` ``[..., num_kv_heads, head_dim]`` into ``kv_format``.

    ``scale`` is only used by fp8 (per-tensor or per-head; default: calibrated from ``x`` with
    :func:`fp8_scale`). Baseline formats return ``x`` cast to their dtype.
    """
    fmt = get_format(kv_format, x.dtype)
    _no_kivi(fmt)
    if x.dim() < 2:
        raise ShapeError(f"quantize_kv expects [..., num_kv_heads, head_dim], got shape {tuple(x.shape)}")
    if not fmt.quantized:
        return QuantizedKV(x.to(fmt.storage_dtype))
    xf = x.float()
    if fmt.is_fp8:
        s = fp8_scale(x, fmt) if scale is None else as_head_scale(scale, x.shape[-2], x.device)
        y = (xf / s[:, None]).clamp(-fmt.max_value, fmt.max_value)
        return QuantizedKV(y.to(fmt.storage_dtype), s)
    if fmt.code == CODE_INT8:
        s = (xf.abs().amax(dim=-1, keepdim=True) / 127.0).to(torch.float16)
        q = torch.round(xf / safe_divisor(s.float())).clamp(-127, 127)
        return QuantizedKV(q.to(torch.int8), s)
    d = x.shape[-1]
    if group_size <= 0 or d % group_size or group_size % 2:
        raise ShapeError(f"int4 group_size {group_size} must be even and divide head_dim {d}")
    xg = xf.reshape(*x.shape[:-1], d // group_size, group_size)
    mn, mx = xg.amin(dim=-1), xg.amax(dim=-1)
    s = ((mx - mn) / 15.0).to(torch.float16)
    z = mn.to(torch.float16)
    q = torch.round((xg - z.float()[..., None]) / safe_divisor(s.float())[..., None]).clamp(0, 15)
    return QuantizedKV(pack_int4(q.reshape(x.shape).to(torch.uint8)), s, z)


def dequantize_kv(data: torch.Tensor | QuantizedKV, kv_format: str | KVFormat | None = None,
                  scale: torch.Tensor | None = None, zero: torch.Tensor | None = None, *,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_kv`; returns ``[..., num_kv_heads, head_dim]`` in ``dtype``.

    ``data`` may be the :class:`QuantizedKV` that :func:`quantize_kv` returned.
    """
    if isinstance(data, QuantizedKV):
        if scale is not None or zero is not None:
            raise KVFormatError("pass either a QuantizedKV or data with scale/zero, not both")
        data, scale, zero = data
    fmt = get_format(kv_format) if kv_format is not None else get_format("auto", data.dtype)
    _no_kivi(fmt)
    if not fmt.quantized:
        return data.to(dtype)
    if scale is None:
        raise KVFormatError(f"dequantizing {fmt.name} needs its scale tensor")
    if fmt.is_fp8:
        s = as_head_scale(scale, data.shape[-2], data.device)
        return (data.float() * s[:, None]).to(dtype)
    if fmt.code == CODE_INT8:
        return (data.float() * scale.float()).to(dtype)
    if zero is None:
        raise KVFormatError("dequantizing int4 needs its zero-point tensor")
    codes = unpack_int4(data).float()
    ng = scale.shape[-1]
    cg = codes.reshape(*codes.shape[:-1], ng, codes.shape[-1] // ng)
    out = cg * scale.float()[..., None] + zero.float()[..., None]
    return out.reshape(codes.shape).to(dtype)
