"""Split KV formats' constants and codecs (:mod:`kernels.split` describes the layout): per-layer
tables (RoPE rows, KIVI channel widths, value codebooks), bit packing, and the KIVI key and
codebook value quantizers. Pure torch on tensors; no cache layer, no state.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
import torch

from .errors import KVFormatError, ShapeError
from .quant import safe_divisor

__all__ = ["SplitTables", "rope", "unrope", "rope_tables", "hadamard", "bit_layout", "pack_bits", "unpack_bits",
           "cb_quantize", "cb_dequantize", "lloyd_levels", "normal_levels", "kivi_quantize", "kivi_dequantize",
           "kivi_step_zero", "uniform_widths", "STAGING_DTYPE"]

STAGING_DTYPE = torch.float16

# ---- per-layer constants ------------------------------------------------------------------------

@dataclass(slots=True)
class SplitTables:
    """A split layer's constants (on the cache's device; never moved by block copies or swaps).

    ``k_width``/``k_offset`` int32 ``[H, D]``: KIVI bits and bit offset per channel;
    ``v_levels`` float32 ``[2**b]`` sorted: the CB codebook; ``cos``/``sin`` float32 ``[P, D]``:
    RoPE rows (``sin`` signed as ``paged.models.rope``'s ``sin_signed``) for ``+pre`` keys;
    ``hadamard`` float32 ``[D, D]`` for ``+rot`` values.
    """

    k_width: torch.Tensor | None = None
    k_offset: torch.Tensor | None = None
    k_row_bytes: int = 0
    v_levels: torch.Tensor | None = None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    hadamard: torch.Tensor | None = None

    def to(self, device: torch.device) -> "SplitTables":
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return SplitTables(mv(self.k_width), mv(self.k_offset), self.k_row_bytes, mv(self.v_levels), mv(self.cos),
                           mv(self.sin), mv(self.hadamard))


def rope_tables(head_dim: int, positions: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, signed sin)`` ``[positions, D]`` of plain RoPE (rotate-half), for caches built without
    a model (tests); the engine passes the model's own tables."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    f = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
    emb = torch.cat((f, f), -1)
    h = head_dim // 2
    return emb.cos(), torch.cat((-emb.sin()[:, :h], emb.sin()[:, h:]), -1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of ``x`` ``[..., T, H, D]`` with rows ``cos``/``sin`` ``[..., T, D]`` (``sin`` signed)."""
    return x * cos.unsqueeze(-2) + x.roll(x.shape[-1] // 2, -1) * sin.unsqueeze(-2)


def unrope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The inverse rotation of :func:`rope` (same rows, angle negated)."""
    return x * cos.unsqueeze(-2) - x.roll(x.shape[-1] // 2, -1) * sin.unsqueeze(-2)


def hadamard(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Orthonormal Sylvester-Hadamard matrix ``[n, n]`` (``H @ H.T = I``); n a power of two."""
    if n < 1 or n & (n - 1):
        raise ShapeError(f"a Hadamard rotation needs a power-of-two head_dim, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).to(device)


def lloyd_levels(x: torch.Tensor, n: int, iters: int = 60) -> torch.Tensor:
    """Lloyd-Max (1-D k-means) levels ``[n]`` (sorted float32) of samples ``x``, started at the
    quantiles; an empty cell keeps its level."""
    xs = x.double().flatten().sort().values
    lv = torch.quantile(xs[:: max(1, xs.numel() // 100000)], (torch.arange(n, dtype=torch.float64) + 0.5) / n)
    for _ in range(iters):
        cell = torch.bucketize(xs, (lv[1:] + lv[:-1]) / 2)
        cnt = torch.bincount(cell, minlength=n).double()
        tot = torch.bincount(cell, weights=xs, minlength=n)
        new = torch.where(cnt > 0, tot / cnt.clamp_min(1), lv)
        if torch.allclose(new, lv, atol=1e-9, rtol=0):
            break
        lv = new.sort().values
    return lv.float()


def normal_levels(bits: int, group: int, samples: int = 1 << 18) -> torch.Tensor:
    """Codebook of a rotated vector without calibration: Lloyd-Max levels of ``x / absmax(x)`` over
    Gaussian vectors of ``group`` values, rescaled so the largest magnitude is 1 (seeded)."""
    g = torch.Generator().manual_seed(1234 + bits * 1000 + group)
    z = torch.randn(samples // group, group, generator=g, dtype=torch.float64)
    lv = lloyd_levels((z / z.abs().amax(-1, keepdim=True)).flatten(), 1 << bits)
    return lv / lv.abs().max()


def uniform_widths(num_kv_heads: int, head_dim: int, bits: int | float) -> torch.Tensor:
    """Every channel ``bits`` wide; a fractional mean spreads its extra bits evenly (channel ``c``
    gets ``floor(bits) + 1`` where ``floor((c + 1) f) > floor(c f)``, ``f`` the fraction), summing to
    ``bits * head_dim`` per head."""
    base = int(bits)
    extra = round(bits * head_dim) - base * head_dim
    c = torch.arange(head_dim)
    w = base + ((c + 1) * extra // head_dim - c * extra // head_dim)
    return w.to(torch.int32).expand(num_kv_heads, head_dim).contiguous()


def bit_layout(width: torch.Tensor, bits: int | float) -> tuple[torch.Tensor, int]:
    """Bit offsets ``[H, D]`` of channels packed in order, and the row's bytes; every head's widths
    must sum to ``bits * D`` (what the format's row holds) and lie in 0..8."""
    w = width.to(torch.int64)
    h, d = w.shape
    if int(w.min()) < 0 or int(w.max()) > 8:
        raise KVFormatError(f"kivi channel widths must lie in 0..8 bits, got {int(w.min())}..{int(w.max())}")
    total = w.sum(-1)
    if bool((total != bits * d).any()):
        raise KVFormatError(f"kivi{bits:g} channel widths must sum to {bits * d:g} bits per head (mean {bits:g}); "
                            f"got {total.tolist()}: recalibrate for this format")
    off = torch.cumsum(w, -1) - w
    return off.to(torch.int32), int(bits * d) // 8


def pack_bits(codes: torch.Tensor, width: torch.Tensor, offset: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """Codes ``[..., H, D]`` (each < 2**width) -> uint8 rows ``[..., H, row_bytes]`` (see the module
    docstring; a code may straddle two bytes)."""
    lead = codes.shape[:-2]
    h, d = codes.shape[-2:]
    off = offset.to(codes.device, torch.int64)
    v = codes.to(torch.int64) << (off % 8)
    idx = (off // 8).clamp(max=row_bytes - 1).expand(*lead, h, d)  # a 0-bit channel may sit at the row's end
    out = torch.zeros(*lead, h, row_bytes + 1, dtype=torch.int64, device=codes.device)
    out.scatter_add_(-1, idx, v & 0xFF)
    out.scatter_add_(-1, idx + 1, (v >> 8) & 0xFF)
    return out[..., :row_bytes].to(torch.uint8)


def unpack_bits(data: torch.Tensor, width: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: uint8 ``[..., H, R]`` -> int64 codes ``[..., H, D]``."""
    lead = data.shape[:-2]
    h, d = width.shape
    off = offset.to(data.device, torch.int64)
    padded = torch.cat([data, torch.zeros(*lead, h, 1, dtype=torch.uint8, device=data.device)], -1).to(torch.int64)
    idx = (off // 8).clamp(max=data.shape[-1] - 1).expand(*lead, h, d)
    word = padded.gather(-1, idx) | (padded.gather(-1, idx + 1) << 8)
    return (word >> (off % 8)) & ((1 << width.to(data.device, torch.int64)) - 1)


# ---- codecs -------------------------------------------------------------------------------------

def cb_quantize(x: torch.Tensor, levels: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 ``[..., H, D]`` -> (int64 codes ``[..., H, D]``, fp16 scales ``[..., H, D // group]``):
    ``scale = fp16(absmax / max|level|)`` per group, code = the nearest level of ``x / scale``."""
    d = x.shape[-1]
    xg = x.reshape(*x.shape[:-1], d // group, group)
    s = (xg.abs().amax(-1) / levels.abs().max()).half()
    u = xg / safe_divisor(s.float())[..., None]
    code = torch.bucketize(u.contiguous(), ((levels[1:] + levels[:-1]) / 2).contiguous())
    return code.reshape(x.shape), s


def cb_dequantize(codes: torch.Tensor, scale: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Float32 ``level[code] * scale`` ``[..., H, D]``."""
    d, g = codes.shape[-1], scale.shape[-1]
    x = levels[codes].reshape(*codes.shape[:-1], g, d // g) * scale.float()[..., None]
    return x.reshape(codes.shape)


def kivi_quantize(x: torch.Tensor, width: torch.Tensor, compact: bool, exclude: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Blocks of keys ``[n, BS, H, D]`` (float32) -> ``(codes, step, zero, super)`` per channel over
    the block: int64 codes ``[n, BS, H, D]``; fp16 step and zero ``[n, H, D]`` (super None), or
    with ``compact`` a uint8 step code, an int8 zero code and fp16 ``super [n, H, 2]``.

    ``width`` ``[H, D]`` bits per channel (0: no code; the range's middle is read);
    ``exclude`` ``[n, BS]`` bool: rows left out of the range (exact sink tokens; a block whose
    rows are all excluded uses all of them). Rule: step = (max - zero) / (levels - 1) with
    levels = max(2, 2**width); fp16: zero = min; compact: zero = floor(min / Z) * Z with
    ``Z = fp16(max|min| / 63)`` per (block, head), step = ceil(step / U) * U with
    ``U = fp16(max step / 255)``; code = clamp(round((x - zero) / step), 0, 2**width - 1)."""
    if exclude is not None and bool(exclude.any()):
        ex = exclude & ~exclude.all(-1, keepdim=True)
        m = ex[:, :, None, None]
        lo, hi = x.masked_fill(m, math.inf).amin(1), x.masked_fill(m, -math.inf).amax(1)
    else:
        lo, hi = x.amin(1), x.amax(1)
    w = width.to(x.device, torch.int64)
    steps = (torch.clamp(1 << w, min=2) - 1).float()
    sup = None
    if compact:
        big = (lo.abs().amax(-1, keepdim=True) / 63.0).half()
        zc = torch.floor(lo / safe_divisor(big.float())).clamp(-64, 63)
        zero32 = zc * big.float()
        step = (hi - zero32) / steps
        unit = (step.amax(-1, keepdim=True) / 255.0).half()
        sc = torch.ceil(step / safe_divisor(unit.float())).clamp(1, 255)
        s32 = sc * unit.float()
        stored_s, stored_z = sc.to(torch.uint8), zc.to(torch.int8)
        sup = torch.cat([big, unit], -1)
    else:
        stored_s, stored_z = ((hi - lo) / steps).half(), lo.half()
        s32, zero32 = stored_s.float(), stored_z.float()
    q = torch.round((x - zero32[:, None]) / safe_divisor(s32)[:, None]).clamp(min=0)
    q = torch.minimum(q, ((1 << w) - 1).float())
    return q.to(torch.int64), stored_s, stored_z, sup


def kivi_step_zero(step: torch.Tensor, zero: torch.Tensor, sup: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 step and zero ``[..., H, D]`` from what :func:`kivi_quantize` stored."""
    if sup is None:
        return step.float(), zero.float()
    s = sup.float()
    return step.float() * s[..., 1:2], zero.float() * s[..., 0:1]


def kivi_dequantize(codes: torch.Tensor, width: torch.Tensor, step: torch.Tensor, zero: torch.Tensor,
                    sup: torch.Tensor | None) -> torch.Tensor:
    """Float32 keys ``[..., BS, H, D]`` = ``code * step + zero`` (0-bit channels: ``0.5 * step + zero``)."""
    s, z = kivi_step_zero(step, zero, sup)
    c = torch.where(width.to(codes.device) == 0, 0.5, codes.float())
    return c * s.unsqueeze(-3) + z.unsqueeze(-3)


def row_quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact rows kept as codes (``@krows<b>``/``@vrows<b>``): float ``[..., H, D]`` -> (uint8 rows
    ``[..., H, b * D / 8]``, fp16 scale ``[..., H]``). Symmetric, every code a level: ``n = 2**b``
    levels evenly spaced on ``[-s, s]`` with ``s = fp16(absmax)`` per token-head, ``code =
    clamp(round((x / s + 1) * (n - 1) / 2), 0, n - 1)``, packed like uniform ``b``-bit KIVI rows."""
    n, d = 1 << bits, x.shape[-1]
    s = x.float().abs().amax(-1).half()
    u = x.float() / safe_divisor(s.float())[..., None]
    code = torch.round((u + 1.0) * ((n - 1) / 2)).clamp(0, n - 1).to(torch.int64)
    if bits == 8:
        return code.to(torch.uint8), s
    h = x.shape[-2]
    width = torch.full((h, d), bits, dtype=torch.int32, device=x.device)
    return pack_bits(code, width, _row_offsets(h, d, bits, x.device), bits * d // 8), s


def row_dequantize(data: torch.Tensor, scale: torch.Tensor, bits: int, head_dim: int) -> torch.Tensor:
    """Float32 ``[..., H, D]`` from :func:`row_quantize`'s rows: ``(2 * code - (n - 1)) * (s / (n - 1))``."""
    n = 1 << bits
    if bits == 8:
        code = data.to(torch.int64)
    else:
        h = data.shape[-2]
        width = torch.full((h, head_dim), bits, dtype=torch.int32, device=data.device)
        code = unpack_bits(data, width, _row_offsets(h, head_dim, bits, data.device))
    return (code.float() * 2.0 - (n - 1)) * (scale.float() / (n - 1))[..., None]


def _row_offsets(h: int, d: int, bits: int, device) -> torch.Tensor:
    return (torch.arange(d, dtype=torch.int32, device=device) * bits).expand(h, d)
