"""Split KV formats: K and V each in their own :class:`~kernels.format_table.SideFormat`.

This module is the torch reference that defines them (the Triton kernels reproduce its reads;
its writes run as torch ops on every backend, like ``int4_kivi``'s). Layout of one layer
(``NB`` blocks of ``BS`` tokens, ``H`` KV heads, ``D`` = head_dim):

* ``kivi<b>`` keys: ``k`` uint8 ``[NB, BS, H, R]`` with ``R = b * D / 8``: channel ``c`` of a
  token-head row holds ``width[h, c]`` bits at bit ``offset[h, c]`` (little-endian across bytes;
  uniform widths ``b`` = the ``int4`` packing at 4 bits); per (block, head, channel) a step and a
  zero: fp16 ``k_scale``/``k_zero`` ``[NB, H, D]``, or with ``+q8`` a uint8 step code
  (``k_scale``), an int8 zero code (``k_zero``) and fp16 super-scales ``k_super [NB, H, 2]``
  (zero unit, step unit). Value = ``code * step + zero`` (a 0-bit channel reads ``0.5 * step +
  zero``, the middle of its range). Keys are quantized per channel over the block when its
  last offset is written (*sealed*), from the block's fp16 staged rows; with ``+pre`` RoPE is
  undone first (the model's own tables) and applied again on read at each key's position.
* ``cb<b>[_g<n>]`` values: ``v`` uint8 ``[NB, BS, H, R]`` (uniform ``b``-bit codes), fp16
  ``v_scale [NB, BS, H, D / n]`` = absmax / max|level| per group; value = ``level[code] * scale``
  with the layer's codebook ``tables.v_levels``. ``+rot``: values are rotated by the Hadamard
  matrix ``H`` before quantizing; attention over them is rotated back (``out @ H^T``).
* ``fp16``/``bf16``/``fp32`` sides: the values in that dtype.
* ``staging``: fp16 rows (K, and V with a window) of the blocks still read exactly: unsealed
  KIVI blocks, and with ``@winW`` every block a query may still read within its window;
  ``sink`` (``@sinkS``): fp16 K and V of the first S tokens, one slot of S rows per first block.

Reading (:func:`attend_split`): query ``i`` reads key/value ``j`` from staging when
``j < sink`` or ``i - j < window`` (*exact*), else from the codes. Without a sink or window,
keys of unsealed blocks come from staging (they are always the newest < BS tokens) and values
from the codes. Staging invariants (slots, atomic errors, copies and swaps) are those of
:mod:`kernels.kivi_cache`; the engine releases a window block's slot once no query of its
sequence can read it exactly any more (:func:`window_out_blocks`), and every block's with
:func:`kernels.release_blocks` when the KV manager frees the block.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .errors import KVFormatError, ShapeError
from .format_table import CODE_CB, CODE_KIVI, KVFormat, SideFormat

if TYPE_CHECKING:
    from .cache import KVCacheLayer

__all__ = ["SplitTables", "rope", "unrope", "rope_tables", "hadamard", "bit_layout", "pack_bits", "unpack_bits",
           "cb_quantize", "cb_dequantize", "lloyd_levels", "normal_levels", "kivi_quantize", "kivi_dequantize",
           "uniform_widths", "write_split",
           "gather_split", "attend_split", "split_prefill_ref", "split_decode_ref", "window_out_blocks",
           "STAGING_DTYPE"]

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


def uniform_widths(num_kv_heads: int, head_dim: int, bits: int) -> torch.Tensor:
    return torch.full((num_kv_heads, head_dim), bits, dtype=torch.int32)


def bit_layout(width: torch.Tensor, bits: int) -> tuple[torch.Tensor, int]:
    """Bit offsets ``[H, D]`` of channels packed in order, and the row's bytes; every head's widths
    must sum to ``bits * D`` (what the format's row holds) and lie in 0..8."""
    w = width.to(torch.int64)
    h, d = w.shape
    if int(w.min()) < 0 or int(w.max()) > 8:
        raise KVFormatError(f"kivi channel widths must lie in 0..8 bits, got {int(w.min())}..{int(w.max())}")
    total = w.sum(-1)
    if bool((total != bits * d).any()):
        raise KVFormatError(f"kivi{bits} channel widths must sum to {bits * d} bits per head (mean {bits}); "
                            f"got {total.tolist()}: recalibrate for this format")
    off = torch.cumsum(w, -1) - w
    return off.to(torch.int32), bits * d // 8


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

def _safe(s: torch.Tensor) -> torch.Tensor:
    return torch.where(s == 0, torch.ones_like(s), s)


def cb_quantize(x: torch.Tensor, levels: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 ``[..., H, D]`` -> (int64 codes ``[..., H, D]``, fp16 scales ``[..., H, D // group]``):
    ``scale = fp16(absmax / max|level|)`` per group, code = the nearest level of ``x / scale``."""
    d = x.shape[-1]
    xg = x.reshape(*x.shape[:-1], d // group, group)
    s = (xg.abs().amax(-1) / levels.abs().max()).half()
    u = xg / _safe(s.float())[..., None]
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
        zc = torch.floor(lo / _safe(big.float())).clamp(-64, 63)
        zero32 = zc * big.float()
        step = (hi - zero32) / steps
        unit = (step.amax(-1, keepdim=True) / 255.0).half()
        sc = torch.ceil(step / _safe(unit.float())).clamp(1, 255)
        s32 = sc * unit.float()
        stored_s, stored_z = sc.to(torch.uint8), zc.to(torch.int8)
        sup = torch.cat([big, unit], -1)
    else:
        stored_s, stored_z = ((hi - lo) / steps).half(), lo.half()
        s32, zero32 = stored_s.float(), stored_z.float()
    q = torch.round((x - zero32[:, None]) / _safe(s32)[:, None]).clamp(min=0)
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


# ---- writes -------------------------------------------------------------------------------------

def _check_positions(layer: "KVCacheLayer", positions: torch.Tensor | None, n: int) -> torch.Tensor | None:
    fmt = layer.kv_format
    if not (fmt.k_side.pre_rope or fmt.sink or fmt.window):
        return None
    if positions is None:
        raise ShapeError(f"kv format {fmt.name!r} needs the tokens' positions: pass positions= to write_kv "
                         "(each token's index in its sequence)")
    if positions.shape != (n,):
        raise ShapeError(f"positions must be [{n}] (one per written token), got {tuple(positions.shape)}")
    return positions.to("cpu", torch.int64)


def _seed_k(layer: "KVCacheLayer", blocks: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """The exact-row stand-in of sealed blocks' keys (decoded, RoPE at their positions), fp16 values."""
    return _decode_k(layer, blocks.to(layer.device), start.to(layer.device)).to(STAGING_DTYPE)


def _decode_k(layer: "KVCacheLayer", blocks: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """Float32 keys of ``blocks`` (long, any shape) from their codes; ``start``: each block's first
    position (same shape), used to apply RoPE to ``+pre`` keys."""
    t, side = layer.tables, layer.kv_format.k_side
    bs = layer.block_size
    take = lambda x: x.index_select(0, blocks.reshape(-1)).view(*blocks.shape, *x.shape[1:])  # noqa: E731
    if side.exact:
        return take(layer.k).float()
    codes = unpack_bits(take(layer.k), t.k_width, t.k_offset)
    x = kivi_dequantize(codes, t.k_width, take(layer.k_scale), take(layer.k_zero),
                        take(layer.k_super) if layer.k_super is not None else None)
    if side.pre_rope:
        pos = (start.reshape(*blocks.shape, 1) + torch.arange(bs, device=x.device)).clamp(max=t.cos.shape[0] - 1)
        x = rope(x, t.cos[pos], t.sin[pos])
    return x


def _decode_v(layer: "KVCacheLayer", slots_or_blocks: torch.Tensor, *, blocks: bool) -> torch.Tensor:
    """Float32 values (rotated frame for ``+rot``) of whole ``blocks`` or of single slots."""
    side, t = layer.kv_format.v_side, layer.tables
    if blocks:
        take = lambda x: x.index_select(0, slots_or_blocks.reshape(-1)).view(  # noqa: E731
            *slots_or_blocks.shape, *x.shape[1:])
    else:
        take = lambda x: x.view(-1, *x.shape[2:]).index_select(0, slots_or_blocks)  # noqa: E731
    if side.exact:
        return take(layer.v).float()
    return cb_dequantize(unpack_bits(take(layer.v), _vw(layer), _vo(layer)), take(layer.v_scale), t.v_levels)


def _vw(layer: "KVCacheLayer") -> torch.Tensor:
    side = layer.kv_format.v_side
    return torch.full((layer.num_kv_heads, layer.head_dim), side.bits, dtype=torch.int32, device=layer.device)


def _vo(layer: "KVCacheLayer") -> torch.Tensor:
    side = layer.kv_format.v_side
    d = layer.head_dim
    return (torch.arange(d, dtype=torch.int32, device=layer.device) * side.bits).expand(layer.num_kv_heads, d)


def write_split(layer: "KVCacheLayer", key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
                positions: torch.Tensor | None) -> None:
    """Store ``key``/``value`` ``[T, H, D]`` at ``slot_mapping`` (< 0 skipped): V codes now, K codes
    when a block is sealed, exact fp16 rows in staging (see the module docstring). Raises
    StagingExhaustedError before changing anything when the pool is too small."""
    from .kivi_cache import _plan
    fmt = layer.kv_format
    ks, vs = fmt.k_side, fmt.v_side
    pos_host = _check_positions(layer, positions, key.shape[0])
    p = _plan(slot_mapping, layer.block_size)
    if p is None:
        return
    dev, bs = layer.device, layer.block_size
    keep, slots = p.rows.to(dev), p.slots.to(dev)
    kx, vx = key.index_select(0, keep).float(), value.index_select(0, keep).float()
    pool, windowed = layer.staging, bool(fmt.window or fmt.sink)
    kivi = ks.code == CODE_KIVI
    start = None
    if pos_host is not None:
        start = torch.zeros(p.blocks.numel(), dtype=torch.int64)
        start[p.inv] = pos_host[p.rows] - p.offs
    # 1. count staging (and sink) slots before changing anything
    if pool is not None:
        old = pool.slots_of(p.blocks)
        after = torch.ones_like(p.seal) if windowed else ~p.seal
        fresh, freed = after & (old < 0), ~after & (old >= 0)
        need = int(fresh.sum())
        if not pool.make_room(need - int(freed.sum())):
            raise pool.exhausted(need, f"writing {p.slots.numel()} tokens into {p.blocks.numel()} blocks")
    sink_rows = None
    if fmt.sink:
        sink_rows = torch.nonzero(pos_host[p.rows] < fmt.sink).squeeze(1)  # written tokens that are sink tokens
        sb = p.blocks[p.inv[sink_rows]].unique()
        new_sink = sb[layer.sink.slots_of(sb) < 0]
        if not layer.sink.make_room(int(new_sink.numel())):
            raise layer.sink.exhausted(int(new_sink.numel()), f"writing the sink tokens of {sb.numel()} sequences")
    # 2. values: codes now
    if vs.exact:
        layer.v.view(-1, *layer.v.shape[2:])[slots] = vx.to(layer.v.dtype)
    else:
        vr = vx @ layer.tables.hadamard if vs.rotate else vx
        codes, scale = cb_quantize(vr, layer.tables.v_levels, vs.group)
        layer.v.view(-1, *layer.v.shape[2:])[slots] = pack_bits(codes, _vw(layer), _vo(layer), layer.v.shape[-1])
        layer.v_scale.view(-1, *layer.v_scale.shape[2:])[slots] = scale
    if ks.exact:
        layer.k.view(-1, *layer.k.shape[2:])[slots] = kx.to(layer.k.dtype)
    if sink_rows is not None and sink_rows.numel():
        _write_sink(layer, p, sink_rows, pos_host, kx, vx)
    if pool is None:
        return
    kd = kx.to(STAGING_DTYPE)
    # 3. seal full KIVI blocks from their exact rows (staged before this write, or decoded) + this write's
    if kivi and bool(p.seal.any()):
        _seal(layer, p, kd, old, start)
    # 4. staging: release sealed blocks (KIVI only), give the others a slot, write the exact rows
    pool.unassign(p.blocks[freed].tolist())
    pool.assign(p.blocks[fresh].tolist())
    slot = pool.slots_of(p.blocks)
    life = after & p.has0  # a write from offset 0 begins a new life: discard old rows
    if bool(life.any()):
        pool.k[slot[life].to(dev)] = 0
        if pool.v is not None:
            pool.v[slot[life].to(dev)] = 0
    seed = fresh & ~p.has0  # reopened past offset 0: rows from the codes
    if bool(seed.any()):
        sb = p.blocks[seed]
        st = start[seed] if start is not None else torch.zeros_like(sb)
        if kivi:
            pool.k[slot[seed].to(dev)] = _seed_k(layer, sb, st)
        if pool.v is not None:
            v = _decode_v(layer, sb.to(dev), blocks=True)
            if vs.rotate:
                v = v @ layer.tables.hadamard.T
            pool.v[slot[seed].to(dev)] = v.to(STAGING_DTYPE)
            if not kivi:
                pool.k[slot[seed].to(dev)] = _decode_k(layer, sb.to(dev), st.to(dev)).to(STAGING_DTYPE)
    tok = after[p.inv]
    rows = (slot[p.inv[tok]] * bs + p.offs[tok]).to(dev)
    sel = torch.nonzero(tok).squeeze(1).to(dev)
    pool.k.view(-1, *pool.k.shape[2:])[rows] = kd[sel]
    if pool.v is not None:
        pool.v.view(-1, *pool.v.shape[2:])[rows] = vx[sel].to(STAGING_DTYPE)


def _write_sink(layer: "KVCacheLayer", p, rows: torch.Tensor, pos_host: torch.Tensor, kx: torch.Tensor,
                vx: torch.Tensor) -> None:
    """fp16 K/V of the written sink tokens (positions < S) into their first block's sink slot; a
    write of position 0 begins a new life (the slot is zeroed first)."""
    pool, dev = layer.sink, layer.device
    blocks = p.blocks[p.inv[rows]]
    pool.assign([b for b in blocks.unique().tolist() if int(pool.map_host[b]) < 0])
    first = blocks[pos_host[p.rows][rows] == 0]
    if first.numel():
        pool.k[pool.slots_of(first).to(dev)] = 0
        pool.v[pool.slots_of(first).to(dev)] = 0
    at = (pool.slots_of(blocks) * pool.k.shape[1] + pos_host[p.rows][rows]).to(dev)
    sel = rows.to(dev)
    pool.k.view(-1, *pool.k.shape[2:])[at] = kx[sel].to(STAGING_DTYPE)
    pool.v.view(-1, *pool.v.shape[2:])[at] = vx[sel].to(STAGING_DTYPE)


def _seal(layer: "KVCacheLayer", p, kd: torch.Tensor, old: torch.Tensor, start: torch.Tensor | None) -> None:
    """Quantize the KIVI blocks whose last offset this write stores (their exact rows as fp16)."""
    pool, bs, dev, t = layer.staging, layer.block_size, layer.device, layer.tables
    fmt = layer.kv_format
    sb = p.blocks[p.seal]
    buf = torch.zeros(sb.numel(), bs, *kd.shape[1:], dtype=STAGING_DTYPE, device=dev)
    staged = (old >= 0)[p.seal]
    from_stage = staged & ~p.has0[p.seal]
    from_codes = ~staged & ~p.has0[p.seal]
    st = start[p.seal] if start is not None else torch.zeros_like(sb)
    if bool(from_stage.any()):
        buf[_ix(from_stage, dev)] = pool.k[old[p.seal][from_stage].to(dev)]
    if bool(from_codes.any()):
        buf[_ix(from_codes, dev)] = _seed_k(layer, sb[from_codes], st[from_codes])
    tok = p.seal[p.inv]
    pos = torch.cumsum(p.seal.long(), 0) - 1
    buf.view(-1, *kd.shape[1:])[(pos[p.inv[tok]] * bs + p.offs[tok]).to(dev)] = kd[_ix(tok, dev)]
    x = buf.float()
    rows = st.to(dev)[:, None] + torch.arange(bs, device=dev)
    if fmt.k_side.pre_rope:
        r = rows.clamp(max=t.cos.shape[0] - 1)
        x = unrope(x, t.cos[r], t.sin[r])
    exclude = rows < fmt.sink if fmt.sink else None
    codes, step, zero, sup = kivi_quantize(x, t.k_width, fmt.k_side.compact, exclude)
    sbd = sb.to(dev)
    layer.k[sbd] = pack_bits(codes, t.k_width, t.k_offset, t.k_row_bytes)
    layer.k_scale[sbd], layer.k_zero[sbd] = step, zero
    if sup is not None:
        layer.k_super[sbd] = sup


def _ix(mask: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.nonzero(mask).squeeze(1).to(device)


def window_out_blocks(block_tables, seq_lens, fmt: KVFormat, block_size: int) -> list[int]:
    """Block ids no query of their sequence reads exactly any more after this step: block ``b`` of
    a sequence of ``L`` tokens once ``(b + 1) * BS <= L - window + 1`` (the next query, at ``L``,
    reads ``j > L - window`` exactly; sink tokens have their own pool). ``block_tables`` host
    ints ``[S, M]`` (padding past a sequence's blocks is never selected), ``seq_lens`` ``[S]`` the
    lengths after the step. Empty for formats without a window. The caller frees the slots with
    :func:`kernels.release_blocks` (after checking no other sequence shares a block)."""
    if not fmt.split or not fmt.window:
        return []
    bt = torch.as_tensor(block_tables, dtype=torch.long).cpu()
    lens = torch.as_tensor(seq_lens, dtype=torch.long).cpu()
    if bt.numel() == 0:
        return []
    n_out = ((lens - fmt.window + 1) // block_size).clamp(min=0)
    out = torch.arange(bt.shape[1])[None, :] < n_out[:, None]
    return bt[out].unique().tolist()


# ---- reads --------------------------------------------------------------------------------------

def gather_split(layer: "KVCacheLayer", blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                       torch.Tensor, torch.Tensor | None,
                                                                       torch.Tensor]:
    """For one sequence's block ids ``blocks`` ``[n]`` (long, in table order: block ``i`` holds
    positions ``i*BS ..``): float32 ``(k_codes, k_exact, v_codes, v_exact, staged)`` ``[n*BS, H, D]``
    (``v_codes`` in the rotated frame for ``+rot``; exact rows None without staging; ``staged``
    ``[n*BS]`` bool per position)."""
    n, bs = blocks.shape[0], layer.block_size
    starts = torch.arange(n, device=blocks.device) * bs
    kq = _decode_k(layer, blocks, starts).reshape(n * bs, layer.num_kv_heads, layer.head_dim)
    vq = _decode_v(layer, blocks, blocks=True).reshape(n * bs, layer.num_kv_heads, layer.head_dim)
    pool = layer.staging
    if pool is None:
        return kq, None, vq, None, torch.zeros(n * bs, dtype=torch.bool, device=blocks.device)
    st = pool.block_map.index_select(0, blocks).long()
    staged = (st >= 0).repeat_interleave(bs)
    rows = st.clamp(min=0)
    if pool.num_slots == 0:
        return kq, None, vq, None, staged
    ke = pool.k.index_select(0, rows).float().reshape(n * bs, *kq.shape[1:])
    ve = pool.v.index_select(0, rows).float().reshape(n * bs, *kq.shape[1:]) if pool.v is not None else None
    if layer.sink is not None and n:
        sk, sv = _sink_rows(layer, blocks[:1])
        ns = sk.shape[1]
        ke, ve = ke.clone(), ve.clone()
        ke[:ns], ve[:ns] = sk[0], sv[0]
    return kq, ke, vq, ve, staged


def _sink_rows(layer: "KVCacheLayer", first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 exact K/V ``[n, S, H, D]`` of the sink tokens of first blocks ``first`` ``[n]`` (0 for
    a block without a sink slot)."""
    pool = layer.sink
    st = pool.block_map.index_select(0, first).long()
    ok = (st >= 0)[:, None, None, None]
    rows = st.clamp(min=0)
    k = pool.k.index_select(0, rows).float().masked_fill(~ok, 0.0)
    v = pool.v.index_select(0, rows).float().masked_fill(~ok, 0.0)
    return k, v


def attend_split(q: torch.Tensor, qpos: torch.Tensor, kq: torch.Tensor, ke: torch.Tensor | None, vq: torch.Tensor,
                 ve: torch.Tensor | None, staged: torch.Tensor | None, fmt: KVFormat,
                 hadamard_t: torch.Tensor | None, scale: float) -> torch.Tensor:
    """One sequence: queries ``q`` ``[n, Hq, D]`` at positions ``qpos`` ``[n]`` over its first ``ctx``
    cached positions (``kq``/``vq`` decoded codes, ``ke``/``ve`` exact rows ``[ctx, H, D]``, float32).

    Key ``j`` is visible to query ``i`` iff ``j <= qpos[i]``; it is read exactly iff ``j < sink`` or
    ``qpos[i] - j < window`` (formats with a sink or window), or, without them, keys of staged
    (unsealed) blocks. ``+rot`` values: the code part of the output is multiplied by
    ``hadamard_t`` (``H^T``). Float32 out ``[n, Hq, D]``; the meaning every kernel reproduces."""
    ctx, h, d = kq.shape
    rep = q.shape[1] // h
    j = torch.arange(ctx, device=q.device)
    visible = j[None, :] <= qpos[:, None]
    if fmt.window or fmt.sink:
        exact = (j[None, :] < fmt.sink) | ((qpos[:, None] - j[None, :]) < fmt.window)
    else:
        exact = staged[None, :].expand(q.shape[0], ctx) if ke is not None else None
    if exact is not None:  # rows no query reads may hold anything (stale staging, unsealed codes): zero them
        kq = kq.masked_fill(exact.all(0)[:, None, None], 0.0)
        ke = ke.masked_fill(~exact.any(0)[:, None, None], 0.0)
        if ve is not None:
            ve = ve.masked_fill(~exact.any(0)[:, None, None], 0.0)
    qh = q.float().transpose(0, 1)                                       # [Hq, n, D]
    kk = lambda x: x.repeat_interleave(rep, 1).transpose(0, 1)            # noqa: E731  [Hq, ctx, D]
    s = torch.matmul(qh, kk(kq).transpose(1, 2))
    if exact is not None:
        s = torch.where(exact, torch.matmul(qh, kk(ke).transpose(1, 2)), s)
    p = torch.softmax((s * scale).masked_fill(~visible, -math.inf), -1)
    vex = (fmt.window or fmt.sink) and ve is not None
    pq = p.masked_fill(exact, 0.0) if vex else p
    out = torch.matmul(pq, kk(vq))
    if hadamard_t is not None:
        out = out @ hadamard_t
    if vex:
        out = out + torch.matmul(p.masked_fill(~exact, 0.0), kk(ve))
    return out.transpose(0, 1)


def _hadamard_t(layer: "KVCacheLayer") -> torch.Tensor | None:
    return layer.tables.hadamard.T if layer.kv_format.v_side.rotate else None


def split_prefill_ref(q: torch.Tensor, layer: "KVCacheLayer", block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    """The torch reference of prefill/extend over a split layer (one sequence at a time)."""
    out = torch.zeros_like(q)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    bs = layer.block_size
    for i, ctx in enumerate(lens):
        a, b = qsl[i], qsl[i + 1]
        if b == a:
            continue
        nblk = -(-ctx // bs)
        kq, ke, vq, ve, staged = gather_split(layer, block_tables[i, :nblk].long())
        cut = lambda x: None if x is None else x[:ctx]  # noqa: E731
        qpos = torch.arange(ctx - (b - a), ctx, device=q.device)
        o = attend_split(q[a:b], qpos, kq[:ctx], cut(ke), vq[:ctx], cut(ve), staged[:ctx], layer.kv_format,
                         _hadamard_t(layer), scale)
        out[a:b] = o.to(q.dtype)
    return out


def split_decode_ref(q: torch.Tensor, layer: "KVCacheLayer", block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float, need_lse: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One query per sequence (at position ``seq_len - 1``): the math of :func:`attend_split`,
    vectorized over sequences (in chunks that bound the gathered memory). A query reads each key
    either exactly or from its codes, so the two are chosen per key before one softmax."""
    if need_lse:
        raise KVFormatError("return_lse is not available for split formats; call without it")
    s, hq, d = q.shape
    out = torch.zeros_like(q)
    if s == 0:
        return out, None
    per_seq = (int(seq_lens.max()) + layer.block_size) * layer.num_kv_heads * d * 4
    step = max(1, (1 << 25) // max(1, per_seq))
    for i in range(0, s, step):
        out[i:i + step] = _decode_chunk(q[i:i + step], layer, block_tables[i:i + step], seq_lens[i:i + step], scale)
    return out, None


def _decode_chunk(q: torch.Tensor, layer: "KVCacheLayer", bt: torch.Tensor, sl: torch.Tensor, scale: float
                  ) -> torch.Tensor:
    fmt, bs, h = layer.kv_format, layer.block_size, layer.num_kv_heads
    s, hq, d = q.shape
    lens = sl.long()
    nblk = max(1, -(-int(lens.max()) // bs))
    t = nblk * bs
    blocks = bt[:, :nblk].long().clamp(0, layer.num_blocks - 1)
    starts = (torch.arange(nblk, device=q.device) * bs).expand(s, nblk)
    kq = _decode_k(layer, blocks, starts).reshape(s, t, h, d)
    vq = _decode_v(layer, blocks, blocks=True).reshape(s, t, h, d)
    j = torch.arange(t, device=q.device)
    visible = j[None, :] < lens[:, None]
    stale = ~visible[:, :, None, None]  # slots past a sequence's length may hold anything (NaN too)
    kq, vq = kq.masked_fill(stale, 0.0), vq.masked_fill(stale, 0.0)
    pool = layer.staging
    exact = None
    if pool is not None and pool.num_slots:
        st = pool.block_map.index_select(0, blocks.reshape(-1)).long().view(s, nblk)
        rows = st.clamp(min=0).reshape(-1)
        if fmt.window or fmt.sink:
            exact = (j[None, :] < fmt.sink) | ((lens[:, None] - 1 - j[None, :]) < fmt.window)
        else:
            exact = (st >= 0).repeat_interleave(bs, 1)
        ke = pool.k.index_select(0, rows).float().view(s, t, h, d)
        if layer.sink is not None:
            sk, sv = _sink_rows(layer, blocks[:, 0])
            ns = sk.shape[1]
            ke = ke.clone()
            ke[:, :ns] = sk
        kq = torch.where(exact[:, :, None, None] & visible[:, :, None, None], ke, kq)
    rep = hq // h
    qg = q.float().view(s, h, rep, d)
    sc = torch.einsum("shgd,sthd->shgt", qg, kq) * scale
    p = torch.softmax(sc.masked_fill(~visible[:, None, None, :], -math.inf), -1)
    windowed = exact is not None and pool.v is not None and bool(fmt.window or fmt.sink)
    pq = p.masked_fill(exact[:, None, None, :], 0.0) if windowed else p
    o = torch.einsum("shgt,sthd->shgd", pq, vq)
    if fmt.v_side.rotate:
        o = o @ layer.tables.hadamard.T
    if windowed:
        ve = pool.v.index_select(0, rows).float().view(s, t, h, d)
        if layer.sink is not None:
            ve = ve.clone()
            ve[:, :ns] = sv
        ve = ve.masked_fill(stale, 0.0)
        o = o + torch.einsum("shgt,sthd->shgd", p.masked_fill(~exact[:, None, None, :], 0.0), ve)
    o = torch.where((lens > 0)[:, None, None, None], o, torch.zeros_like(o))
    return o.reshape(s, hq, d).to(q.dtype)
