"""Reading split KV formats (:mod:`kernels.split` describes the layout): gather a sequence's keys
and values (codes decoded, exact rows from staging and the sink pool) and attend over them —
the torch reference the Triton kernels reproduce (:mod:`kernels.triton_impl.split_attention`).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from .errors import KVFormatError
from .format_table import KVFormat
from .kivi_cache import take_blocks
from .split_codec import cb_dequantize, kivi_dequantize, rope, unpack_bits

if TYPE_CHECKING:
    from .cache import KVCacheLayer

__all__ = ["decode_k", "decode_v", "v_width", "v_offset", "gather_split", "attend_split", "split_prefill_ref",
           "split_decode_ref"]


# ---- decoding a layer's stored codes ---------------------------------------------------------

def decode_k(layer: "KVCacheLayer", blocks: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """Float32 keys of ``blocks`` (long, any shape) from their codes; ``start``: each block's first
    position (same shape), used to apply RoPE to ``+pre`` keys."""
    t, side = layer.tables, layer.kv_format.k_side
    bs = layer.block_size
    take = lambda x: take_blocks(x, blocks)  # noqa: E731
    if side.exact:
        return take(layer.k).float()
    codes = unpack_bits(take(layer.k), t.k_width, t.k_offset)
    x = kivi_dequantize(codes, t.k_width, take(layer.k_scale), take(layer.k_zero),
                        take(layer.k_super) if layer.k_super is not None else None)
    if side.pre_rope:
        pos = (start.reshape(*blocks.shape, 1) + torch.arange(bs, device=x.device)).clamp(max=t.cos.shape[0] - 1)
        x = rope(x, t.cos[pos], t.sin[pos])
    return x


def decode_v(layer: "KVCacheLayer", slots_or_blocks: torch.Tensor, *, blocks: bool) -> torch.Tensor:
    """Float32 values (rotated frame for ``+rot``) of whole ``blocks`` or of single slots."""
    side, t = layer.kv_format.v_side, layer.tables
    if blocks:
        take = lambda x: take_blocks(x, slots_or_blocks)  # noqa: E731
    else:
        take = lambda x: x.view(-1, *x.shape[2:]).index_select(0, slots_or_blocks)  # noqa: E731
    if side.exact:
        return take(layer.v).float()
    return cb_dequantize(unpack_bits(take(layer.v), v_width(layer), v_offset(layer)), take(layer.v_scale), t.v_levels)


def v_width(layer: "KVCacheLayer") -> torch.Tensor:
    side = layer.kv_format.v_side
    return torch.full((layer.num_kv_heads, layer.head_dim), side.bits, dtype=torch.int32, device=layer.device)


def v_offset(layer: "KVCacheLayer") -> torch.Tensor:
    side = layer.kv_format.v_side
    d = layer.head_dim
    return (torch.arange(d, dtype=torch.int32, device=layer.device) * side.bits).expand(layer.num_kv_heads, d)


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
    kq = decode_k(layer, blocks, starts).reshape(n * bs, layer.num_kv_heads, layer.head_dim)
    vq = decode_v(layer, blocks, blocks=True).reshape(n * bs, layer.num_kv_heads, layer.head_dim)
    pool = layer.staging
    if pool is None:
        return kq, None, vq, None, torch.zeros(n * bs, dtype=torch.bool, device=blocks.device)
    st = pool.block_map.index_select(0, blocks).long()
    staged = (st >= 0).repeat_interleave(bs)
    rows = st.clamp(min=0)
    if pool.num_slots == 0:
        return kq, None, vq, None, staged
    ke = pool.read("k", rows).reshape(n * bs, *kq.shape[1:])
    ve = pool.read("v", rows).reshape(n * bs, *kq.shape[1:]) if pool.v is not None else None
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
    k = pool.read("k", rows).masked_fill(~ok, 0.0)
    v = pool.read("v", rows).masked_fill(~ok, 0.0)
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
                         layer.tables.hadamard.T if layer.kv_format.v_side.rotate else None, scale)
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
    kq = decode_k(layer, blocks, starts).reshape(s, t, h, d)
    vq = decode_v(layer, blocks, blocks=True).reshape(s, t, h, d)
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
        ke = pool.read("k", rows).view(s, t, h, d)
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
        ve = pool.read("v", rows).view(s, t, h, d)
        if layer.sink is not None:
            ve = ve.clone()
            ve[:, :ns] = sv
        ve = ve.masked_fill(stale, 0.0)
        o = o + torch.einsum("shgt,sthd->shgd", p.masked_fill(~exact[:, None, None, :], 0.0), ve)
    o = torch.where((lens > 0)[:, None, None, None], o, torch.zeros_like(o))
    return o.reshape(s, hq, d).to(q.dtype)
