"""A 1-bit residual for the lab's keys after a random projection (QJL; TurboQuant's "prod" stage).

After a key ``z`` (one token-head, ``D`` values, stored frame) is quantized to ``zq``, its
residual ``r = z - zq`` is stored as ``m`` sign bits ``sign(S r)`` and one norm ``|r|``, with
``S`` an ``m x D`` Gaussian matrix (seeded per layer: the same on write and read, never stored
per token). The read-back key is ``zq + sqrt(pi/2) / m * |r| * S^T sign(S r)``, whose inner
product with any query is an unbiased estimate of ``q . r`` (Zandieh et al., QJL, 2024): the
quantizer's error is traded for zero-mean noise.

Bits per value: ``(m + norm_bits) / D``; the norm is fp16 (``norm_bits == 16``) or an 8-bit
log code ``2 ** (round(8 log2 |r|) / 8)`` (``norm_bits == 8``, relative error <= 4.4%).
"""
from __future__ import annotations

import math

import torch

from paged.errors import ConfigError

__all__ = ["qjl_bits", "qjl_matrix", "qjl_roundtrip"]


def qjl_bits(m: int, norm_bits: int, head_dim: int) -> float:
    """Bits per value of an ``m``-bit sign sketch and its norm per token-head."""
    if m < 0 or norm_bits not in (8, 16):
        raise ConfigError(f"qjl needs m >= 0 sign bits and an 8- or 16-bit norm, got m={m}, norm {norm_bits}")
    return 0.0 if m == 0 else (m + norm_bits) / head_dim


def qjl_matrix(m: int, head_dim: int, seed: int) -> torch.Tensor:
    """The seeded ``[m, D]`` standard Gaussian projection (float32)."""
    g = torch.Generator().manual_seed(7919 * seed + m)
    return torch.randn(m, head_dim, generator=g)


def _round_norm(n: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 16:
        return n.half().float()
    e = torch.round(torch.log2(n.clamp_min(1e-30)) * 8).clamp(-128, 127)
    return torch.where(n > 0, torch.exp2(e / 8), torch.zeros_like(n))


def qjl_roundtrip(z: torch.Tensor, zq: torch.Tensor, sketch: torch.Tensor, norm_bits: int) -> torch.Tensor:
    """``zq`` plus the 1-bit estimate of ``z - zq`` (``[..., D]``; ``sketch`` from :func:`qjl_matrix`)."""
    r = z - zq
    m = sketch.shape[0]
    signs = torch.where(r @ sketch.T >= 0, 1.0, -1.0)
    norm = _round_norm(r.norm(dim=-1, keepdim=True), norm_bits)
    return zq + math.sqrt(math.pi / 2) / m * norm * (signs @ sketch)
