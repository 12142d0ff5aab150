"""An attention backend that stores K/V in a quantization scheme and attends from what it stored.

:class:`QuantKVAttention` is a one-sequence KV cache for the study: every call appends the new
tokens' K/V (quantize-on-write through :mod:`paged.quant.codec`) and then attends from the whole
*stored* cache (dequantize-on-read), so prefill reads quantized keys and values exactly as the
paged engine does (a teacher-forced pass that attended to unquantized states would measure
nothing). Calls append: prefill a prompt, then decode one token at a time; ``reset()`` clears it.

With ``rotate`` the cache stores ``kH`` and ``vH`` for an orthonormal Hadamard ``H`` on head_dim,
queries are rotated the same way and the output is rotated back: attention is unchanged in exact
arithmetic, only the quantization error moves; with ``+vrot`` only V is rotated (and the output
rotated back), so keys keep their channels. ``layers`` limits quantization to some layers
(the others keep fp32), for one-layer-at-a-time sensitivity.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch

from .codec import KiviKeyStore, hadamard, roundtrip
from .schemes import Scheme, Side, parse_scheme

__all__ = ["QuantKVAttention", "MultiCache", "attend"]

_FP32 = Side("fp32")


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of the last ``len(q)`` positions over ``k``/``v`` ``[T, H, D]`` (float32)."""
    from kernels.reference import causal_attention
    t, n = q.shape[0], k.shape[0]
    mask = None if t == n else torch.arange(n)[None, :] <= torch.arange(n - t, n)[:, None]
    return causal_attention(q, k, v, 1.0 / math.sqrt(q.shape[-1]), mask)


class QuantKVAttention:
    """Quantize-on-write, dequantize-on-read cache of one sequence (see the module docstring).

    ``fp8_scales[layer] = (k_scale [H], v_scale [H])`` for calibrated fp8 sides (from
    :func:`paged.quant.diagnostics.calibrate_fp8`); missing entries mean scale 1.0.
    """

    def __init__(self, scheme: str | Scheme, num_layers: int, head_dim: int, *,
                 fp8_scales: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
                 layers: Iterable[int] | None = None) -> None:
        self.scheme = parse_scheme(scheme)
        self.scheme.check(head_dim)
        self.num_layers = num_layers
        self.fp8_scales = fp8_scales or {}
        self.quant_layers = set(range(num_layers)) if layers is None else set(layers)
        self.rot = hadamard(head_dim) if self.scheme.rotate_v else None
        self.reset()

    def reset(self) -> None:
        """Empty the cache (llama-perplexity clears it per chunk)."""
        self.k: list[torch.Tensor | None] = [None] * self.num_layers
        self.v: list[torch.Tensor | None] = [None] * self.num_layers
        self.kivi = [KiviKeyStore(self.scheme.k.group, compact=self.scheme.k.kind == "kiviq")
                     for _ in range(self.num_layers)]

    def truncate(self, n: int) -> None:
        """Forget every token from position ``n`` on (a prefill of ``n`` tokens would store the
        same values: every format is per token except KIVI keys, re-derived per block)."""
        for layer in range(self.num_layers):
            if self.k[layer] is None:
                continue
            kivi = self.scheme.k.per_channel and layer in self.quant_layers
            self.k[layer] = self.kivi[layer].truncate(n) if kivi else self.k[layer][:n]
            self.v[layer] = self.v[layer][:n]

    def _store(self, layer: int, x: torch.Tensor, side: Side, which: int) -> torch.Tensor:
        if side.per_channel:
            return self.kivi[layer].append(x)
        scale = self.fp8_scales[layer][which] if side.calibrated and layer in self.fp8_scales else None
        new = roundtrip(x, side, scale)
        old = (self.k if which == 0 else self.v)[layer]
        return new if old is None else torch.cat([old, new])

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dtype = q.dtype
        q, k, v = q.float(), k.float(), v.float()
        quant = layer_idx in self.quant_layers
        rot = self.rot if quant else None
        if rot is not None:
            v = v @ rot
            if self.scheme.rotate_k:
                q, k = q @ rot, k @ rot
        ks, vs = (self.scheme.k, self.scheme.v) if quant else (_FP32, _FP32)
        self.k[layer_idx] = self._store(layer_idx, k, ks, 0)
        self.v[layer_idx] = self._store(layer_idx, v, vs, 1)
        out = attend(q, self.k[layer_idx], self.v[layer_idx])
        return (out @ rot.T if rot is not None else out).to(dtype)


class MultiCache:
    """Several one-sequence caches in one batch: the packed tokens are split into equal
    consecutive segments, segment ``i`` goes to ``caches[i]`` (one decode step for all)."""

    def __init__(self, caches: list[QuantKVAttention]) -> None:
        self.caches = caches

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n = q.shape[0] // len(self.caches)
        return torch.cat([c(layer_idx, q[i * n:(i + 1) * n], k[i * n:(i + 1) * n], v[i * n:(i + 1) * n])
                          for i, c in enumerate(self.caches)])
