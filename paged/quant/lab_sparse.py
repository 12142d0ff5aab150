"""Dense-and-sparse keys for the lab (KVQuant's outliers, on per-channel KIVI groups).

A full KIVI group of ``N`` tokens x ``D`` channels (one head) keeps its ``count`` outliers exactly:
each as an fp16 value and its position in the group, ``ceil(log2(N * D))`` bits. The rest is
quantized per channel as before, with the outliers left out of every channel's range (they are
replaced by the median of the channel's other entries before quantizing, which lies inside their
range, and put back after). So a channel with one stray value keeps the narrow range of the others.

Which entries: the ``count`` largest distances from their channel's median over the group, in
units of that channel's step, ``|z - median| / max(2**bits - 1, 1/2)`` (``bits`` the channel's
bits; a 0-bit channel, stored as its midpoint, counts as half a step): an entry is worth keeping
when it widens a coarse channel. Exact tokens (``exclude``: the sink) are never chosen.

Invariant: outliers are chosen per group and head from that group's own tokens, so a token's
stored value depends on later tokens only within its KIVI group, as without outliers.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from paged.errors import ConfigError

__all__ = ["sparse_bits", "outlier_mask", "sparse_roundtrip"]


def sparse_bits(count: int, group: int, head_dim: int) -> float:
    """Bits per value of ``count`` outliers per group x head: fp16 value + position in the group."""
    if count < 0 or count > group * head_dim:
        raise ConfigError(f"sparse outliers must be 0..{group * head_dim} per group, got {count}")
    return count * (16 + math.ceil(math.log2(group * head_dim))) / (group * head_dim)


def _median(z: torch.Tensor, exclude: torch.Tensor | None) -> torch.Tensor:
    """Per-channel median over the tokens not excluded, ``[H, D]``."""
    if exclude is not None and bool(exclude.any()) and not bool(exclude.all()):
        z = z[~exclude]
    return z.median(0).values


def outlier_mask(z: torch.Tensor, count: int, bits: "int | torch.Tensor",
                 exclude: torch.Tensor | None = None) -> torch.Tensor:
    """Bool ``[N, H, D]``: the ``count`` entries of each head kept exactly (module docstring)."""
    n, h, d = z.shape
    mask = torch.zeros_like(z, dtype=torch.bool)
    if count == 0:
        return mask
    b = torch.as_tensor(bits, dtype=torch.float32).expand(h, d)
    steps = (torch.exp2(b) - 1).clamp_min(0.5)
    score = (z - _median(z, exclude)).abs() / steps
    if exclude is not None:
        score = score.masked_fill(exclude[:, None, None], -math.inf)
    flat = score.permute(1, 0, 2).reshape(h, n * d)            # per head, all entries of the group
    k = min(count, flat.shape[1] - (0 if exclude is None else int(exclude.sum()) * d))
    if k <= 0:
        return mask
    top = flat.topk(k, dim=-1).indices
    per_head = torch.zeros(h, n * d, dtype=torch.bool).scatter_(-1, top, True)
    return per_head.reshape(h, n, d).permute(1, 0, 2).contiguous()


def sparse_roundtrip(z: torch.Tensor, count: int, bits: "int | torch.Tensor",
                     quantize: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
                     exclude: torch.Tensor | None = None) -> torch.Tensor:
    """Round trip of one full group ``z`` ``[N, H, D]``: ``quantize(z', exclude)`` of the group
    with its outliers moved to their channel's median, the outliers read back as fp16."""
    mask = outlier_mask(z, count, bits, exclude)
    if not bool(mask.any()):
        return quantize(z, exclude)
    kept = z.masked_fill(mask, math.nan)
    if exclude is not None and bool(exclude.any()) and not bool(exclude.all()):
        kept = kept[~exclude]
    fill = torch.nan_to_num(kept.nanmedian(0).values, nan=0.0)    # inside the range of what is left
    filled = torch.where(mask, fill.expand_as(z), z)
    return torch.where(mask, z.half().float(), quantize(filled, exclude))
