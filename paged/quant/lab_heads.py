"""Per-head bit allocation for the lab's KIVI keys (``SideSpec.alloc_heads``).

``alloc`` gives each channel of a head its bits by greedy rate allocation with the head's mean
fixed: every head of a layer gets the same total. Heads differ in what their key error costs
(the query energy they face), so here the greedy allocation runs over all channels of a layer at
once: a layer keeps its mean (``round(bits * H * D)`` bits), a head whose errors cost more takes
bits from one whose errors cost less.

What an error costs, measured on the calibration text: a stored-frame error ``e`` in channel
``c`` is an error ``e / a_c`` of the key (``a``: the side's channel weights, 1 without), which
moves the attention logits by ``sum_c w_c (e / a_c)^2`` on average (``w``: the second moment of
the head's queries, one value per RoPE pair). The importance of a channel is its expected range
over a group, squared, / 12 (the error at 0 bits of a uniform quantizer), times ``w_c / a_c^2``.
The weights ``a`` are normalised per head (geometric mean 1), so without this factor the heads'
importances would not be comparable.

Invariant: the per-layer total equals ``round(bits * H * D)``; per head it may be anything in
``0 .. 8 * D``.
"""
from __future__ import annotations

import torch

from paged.errors import ConfigError
from .artefact import allocate_bits

__all__ = ["pair_query_weight", "pooled_bits"]


def pair_query_weight(q2: torch.Tensor) -> torch.Tensor:
    """``q2`` ``[H, D]`` averaged over each RoPE pair ``(c, c + D/2)`` (a pre-RoPE key's channel
    meets both halves of the query as the position turns)."""
    half = q2.shape[-1] // 2
    return ((q2[..., :half] + q2[..., half:]) / 2).repeat(1, 2)


def pooled_bits(importance: torch.Tensor, q2: torch.Tensor, a: torch.Tensor | None,
                mean_bits: float) -> torch.Tensor:
    """Bits ``[H, D]`` allocated over all heads at once (module docstring); ``importance`` is the
    stored-frame error at 0 bits per channel, ``a`` the channel weights (None: 1)."""
    if importance.shape != q2.shape:
        raise ConfigError(f"importance {tuple(importance.shape)} and query moments {tuple(q2.shape)} differ")
    cost = pair_query_weight(q2) / (1.0 if a is None else a.pow(2))
    h, d = importance.shape
    return allocate_bits((importance * cost).reshape(1, h * d), mean_bits).reshape(h, d)
