"""KIVI-style key quantization: int4 per channel over groups of tokens (the ``int4_kivi`` K codec).

KIVI (Liu et al., 2024) quantizes keys per channel (outliers live in a few channels) over groups
of ``group_size`` consecutive tokens, values per token, and keeps the newest tokens that do not
fill a group in full precision. Here the group plays the role of a cache block.

:func:`quantize_keys_per_channel` is the reference for error studies (per-token vs per-channel
keys, any group size). :func:`quantize_k_blocks` / :func:`dequantize_k_blocks` apply it with the
group = one cache block; they define the K codes of the ``int4_kivi`` cache format (whose
staging of unfilled blocks lives in :mod:`kernels.kivi_cache`).

Invariants: codes use the int4 formulas of :mod:`kernels.quant` (fp16 scale = (max - min) / 15,
fp16 zero = min, code = clamp(rne((x - zero) / scale), 0, 15)), taken over the token axis;
codes are packed two per byte along head_dim like the ``int4`` format.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .errors import ShapeError
from .quant import pack_int4, safe_divisor, unpack_int4

__all__ = ["KiviKeys", "quantize_keys_per_channel", "dequantize_keys_per_channel", "quantize_k_blocks",
           "dequantize_k_blocks"]


class KiviKeys(NamedTuple):
    """Quantized keys: ``data`` uint8 ``[Tq, H, D // 2]`` for the first ``Tq`` tokens (a multiple
    of the group), fp16 ``scale``/``zero`` ``[Tq // group, H, D]``, and the unquantized
    ``residual`` ``[T - Tq, H, D]``."""

    data: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    residual: torch.Tensor


def quantize_keys_per_channel(k: torch.Tensor, group_size: int = 32) -> KiviKeys:
    """Quantize keys ``[T, H, D]`` per channel over groups of ``group_size`` tokens."""
    if k.dim() != 3 or k.shape[-1] % 2:
        raise ShapeError(f"keys must be [tokens, heads, head_dim] with an even head_dim, got {tuple(k.shape)}")
    if group_size < 1:
        raise ShapeError(f"group_size must be >= 1, got {group_size}")
    t, h, d = k.shape
    tq = (t // group_size) * group_size
    x = k[:tq].float().reshape(tq // group_size, group_size, h, d)
    mn, mx = x.amin(dim=1), x.amax(dim=1)
    s = ((mx - mn) / 15.0).to(torch.float16)
    z = mn.to(torch.float16)
    q = torch.round((x - z.float()[:, None]) / safe_divisor(s.float())[:, None]).clamp(0, 15).to(torch.uint8)
    return KiviKeys(pack_int4(q.reshape(tq, h, d)), s, z, k[tq:].clone())


def dequantize_keys_per_channel(q: KiviKeys, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_keys_per_channel`: ``[T, H, D]`` in ``dtype``."""
    groups = q.scale.shape[0]
    if groups == 0:
        return q.residual.to(dtype)
    codes = unpack_int4(q.data).float()
    tq, h, d = codes.shape
    x = codes.reshape(groups, tq // groups, h, d) * q.scale.float()[:, None] + q.zero.float()[:, None]
    return torch.cat([x.reshape(tq, h, d).to(dtype), q.residual.to(dtype)])


def quantize_k_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize whole cache blocks of keys ``[n, block_size, H, D]`` per channel over the block.

    Returns ``(codes uint8 [n, block_size, H, D // 2], scale fp16 [n, H, D], zero fp16 [n, H, D])``:
    the group of :func:`quantize_keys_per_channel` is exactly one block.
    """
    if x.dim() != 4:
        raise ShapeError(f"key blocks must be [n, block_size, heads, head_dim], got {tuple(x.shape)}")
    n, bs, h, d = x.shape
    q = quantize_keys_per_channel(x.reshape(n * bs, h, d), group_size=bs)
    return q.data.view(n, bs, h, d // 2), q.scale, q.zero


def dequantize_k_blocks(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_k_blocks` for any leading shape: codes ``[..., BS, H, D // 2]``,
    scale/zero ``[..., H, D]`` -> float32 ``[..., BS, H, D]`` (``code * scale + zero`` in float32)."""
    return unpack_int4(codes).float() * scale.float().unsqueeze(-3) + zero.float().unsqueeze(-3)
