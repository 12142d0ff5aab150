"""Round trips through a KV side's storage: what the cache hands back after quantize-on-write.

Every codec here except the study-only ``int4sym`` calls the kernels' reference quantizers (:func:`kernels.quantize_kv`,
:func:`kernels.kivi.quantize_keys_per_channel`), the definitions the engine's kernels reproduce,
so the study measures the engine's formats, not look-alikes.

Invariant: ``roundtrip(x, side)`` is a per-token map (each token-head row quantized on its own,
as the engine writes it) except for ``kivi`` keys, which :class:`KiviKeyStore` quantizes per
channel once a 16-token block is full.
"""
from __future__ import annotations

import torch

from kernels.quant import safe_divisor
from kernels.split_codec import hadamard  # the engine's rotation (re-exported for the study)

from .schemes import KIVI_BLOCK, Side

__all__ = ["roundtrip", "int4sym_roundtrip", "kiviq_roundtrip", "hadamard", "KiviKeyStore"]

_TORCH = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def roundtrip(x: torch.Tensor, side: Side, scale: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``[T, H, D]`` -> the float32 values the cache returns for ``side`` (not kivi).

    ``scale``: fp8 per-head scales ``[H]`` (None = 1.0, vLLM's uncalibrated default).
    """
    from kernels import dequantize_kv, quantize_kv
    if side.kind in _TORCH:
        return x.to(_TORCH[side.kind]).float()
    if side.kind in ("fp8_e4m3", "fp8_e5m2"):
        s = torch.ones(x.shape[-2]) if scale is None else scale
        return dequantize_kv(quantize_kv(x, side.kind, scale=s), side.kind)
    if side.kind in ("int8", "int4"):  # int8 has no groups (one scale per token-head)
        return dequantize_kv(quantize_kv(x, side.kind, group_size=side.group), side.kind)
    if side.kind == "int4sym":
        return int4sym_roundtrip(x, side.group)
    raise ValueError(f"roundtrip does not take {side.kind!r}; kivi keys go through KiviKeyStore")


def int4sym_roundtrip(x: torch.Tensor, group: int) -> torch.Tensor:
    """Symmetric int4 with one fp16 scale per ``group`` values (llama.cpp's q4_0 layout at 32):
    ``d = m / -8`` with ``m`` the group's value of largest magnitude (kept with its sign), codes
    ``clamp(round(x / d), -8, 7)``, read back as ``code * d``. The extreme value is exact (code
    -8); the other side stops at code 7, so a value near ``-m`` clips to ``7|d| = 7|m|/8``.
    Study only: no kernel stores it. ``x`` float ``[..., D]`` with ``D % group == 0``."""
    d_model = x.shape[-1]
    if group < 2 or d_model % group:
        raise ValueError(f"int4sym group {group} must divide the last dimension {d_model}")
    xg = x.float().reshape(*x.shape[:-1], d_model // group, group)
    idx = xg.abs().argmax(-1, keepdim=True)
    d = (xg.gather(-1, idx) / -8.0).to(torch.float16).float()
    q = torch.round(xg / safe_divisor(d)).clamp(-8, 7)
    return (q * d).reshape(x.shape)


def kiviq_roundtrip(k: torch.Tensor) -> torch.Tensor:
    """KIVI keys of one full group ``[N, H, D]`` with compressed scales (study only): per (head,
    channel) the zero is ``zc * Z`` with a 7-bit code ``zc = floor(min / Z)`` (so zero <= min) and
    ``Z = max|min| / 63`` in fp16 per head; the step is ``sc * S`` with an 8-bit code ``sc =
    ceil(((max - zero) / 15) / S)`` and ``S = max step / 255`` in fp16 per head, so the 16 codes
    still cover [min, max] up to the fp16 rounding of ``S``. Codes as in kernels.kivi."""
    x = k.float()
    lo, hi = x.amin(0), x.amax(0)                                        # [H, D]
    big = (lo.abs().amax(-1, keepdim=True) / 63.0).half().float()
    z = torch.floor(lo / safe_divisor(big)).clamp(-64, 63) * big
    step = (hi - z) / 15.0
    sup = (step.amax(-1, keepdim=True) / 255.0).half().float()
    s = torch.ceil(step / safe_divisor(sup)).clamp(1, 255) * sup
    return torch.round((x - z) / safe_divisor(s)).clamp(0, 15) * s + z


class KiviKeyStore:
    """KIVI keys of one layer of one sequence: full 16-token blocks int4 per channel, the
    newest unfilled block kept as written (the engine's staging pool)."""

    def __init__(self, group: int = KIVI_BLOCK, compact: bool = False) -> None:
        self.group = group
        self.compact = compact  # kiviq: compressed scales (kiviq_roundtrip)
        self.done: list[torch.Tensor] = []   # dequantized full blocks
        self.tail: torch.Tensor | None = None
        self.raw: list[torch.Tensor] = []    # keys as written (for truncate)

    def truncate(self, n: int) -> torch.Tensor:
        """Keep the first ``n`` tokens, as if only they had been written; return the stored keys."""
        raw = torch.cat(self.raw)[:n]
        full = (n // self.group) * self.group
        self.done = [torch.cat(self.done)[:full]] if self.done else []
        self.tail, self.raw = raw[full:], [raw]
        return torch.cat([*self.done, self.tail])

    def append(self, k: torch.Tensor) -> torch.Tensor:
        """Add keys ``[t, H, D]``; return every stored key as the cache reads it ``[T, H, D]``."""
        from kernels.kivi import dequantize_keys_per_channel, quantize_keys_per_channel
        self.raw.append(k)
        tail = k if self.tail is None else torch.cat([self.tail, k])
        full = (tail.shape[0] // self.group) * self.group
        if full and self.compact:
            self.done += [kiviq_roundtrip(g) for g in tail[:full].split(self.group)]
        elif full:
            q = quantize_keys_per_channel(tail[:full], group_size=self.group)
            self.done.append(dequantize_keys_per_channel(q))
        self.tail = tail[full:]
        return torch.cat([*self.done, self.tail])
