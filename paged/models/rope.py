"""Rotary position embeddings in the rotate-half (GPT-NeoX / HF) convention: ``inverse_frequencies``
applies the checkpoint's theta and scaling; ``RotaryEmbedding`` caches cos/sin per position.
"""
from __future__ import annotations

import math

import torch

from paged._kernels import kernels  # noqa: F401  (checks it is the workbench's package)
from kernels import native
from .config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """float32 ``[head_dim // 2]`` inverse frequencies after scaling (float32 math, as HF does)."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = cfg.rope_scaling or {}
    rt = sc.get("rope_type", "default")
    if rt == "linear":
        inv = inv / float(sc["factor"])
    elif rt == "llama3":
        factor = float(sc["factor"])
        low = float(sc.get("low_freq_factor", 1.0))
        high = float(sc.get("high_freq_factor", 4.0))
        old_ctx = float(sc["original_max_position_embeddings"])
        low_wavelen = old_ctx / low
        high_wavelen = old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    if cfg.rope_freq_factors is not None:
        inv = inv / torch.tensor(cfg.rope_freq_factors, dtype=torch.float32)
    return inv.to(torch.float32)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin table for positions ``[0, max_positions)``, grown on demand."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.reset(max_positions)

    def reset(self, max_positions: int, device: torch.device | str | None = None) -> None:
        """(Re)compute the float32 tables, e.g. after ``to_empty``/dtype casts."""
        self.register_buffer("inv_freq", inverse_frequencies(self.cfg).to(device), persistent=False)
        self._build(max_positions)

    def _build(self, n: int) -> None:
        freqs = torch.outer(torch.arange(n, dtype=torch.float32, device=self.inv_freq.device), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        h = emb.shape[-1] // 2  # rotate_half(x) * sin == roll(x, h) * [-sin_lo, sin_hi], exactly
        self.register_buffer("sin_signed", torch.cat((-self.sin[:, :h], self.sin[:, h:]), -1), persistent=False)

    def ensure(self, positions: torch.Tensor) -> None:
        """Grow the tables to cover ``positions``; call once per forward pass, before the
        layers (reading ``positions.max()`` is a host sync on a GPU)."""
        if positions.numel():
            top = int(positions.max())
            if top >= self.cos.shape[0]:
                self._build(max(top + 1, 2 * self.cos.shape[0]))

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, signed sin)`` float32 ``[T, 1, D]`` for ``positions`` ``[T]`` (which ``ensure``
        has covered): built once per forward pass and shared by every layer's :meth:`rotate`."""
        return self.cos[positions].unsqueeze(-2), self.sin_signed[positions].unsqueeze(-2)

    @staticmethod
    def rotate(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Rotate ``x`` ``[T, heads, D]`` (q and k heads side by side in one call) by ``tables``:
        ``x * cos + rotate_half(x) * sin`` in float32 (bit-identical to :meth:`forward`: the roll
        moves halves, the signed sin carries rotate_half's negation), returned in ``x``'s dtype.
        Float32 on CPU: :func:`kernels.native.rope` where built (same bits, no intermediates)."""
        cos, sin = tables
        if x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(-1) == 1 and native.available():
            t, d = x.shape[0], x.shape[-1]
            return native.rope(x, cos.reshape(t, d), sin.reshape(t, d))  # the same bits, one pass
        xf = x.float()
        return (xf * cos + xf.roll(x.shape[-1] // 2, -1) * sin).to(x.dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q ``[T, Hq, D]`` and k ``[T, Hk, D]`` by ``positions`` ``[T]``, which
        ``ensure`` has covered."""
        cos = self.cos[positions].unsqueeze(-2)
        sin = self.sin[positions].unsqueeze(-2)
        qf, kf = q.float(), k.float()
        return (qf * cos + rotate_half(qf) * sin).to(q.dtype), (kf * cos + rotate_half(kf) * sin).to(k.dtype)
