"""Plain-torch references: the meaning of every kernel, and the fast CPU path.

All math runs in float32 on dequantized values; outputs take the query's dtype. Positions at or
past a sequence's ``seq_len`` are zeroed before use, so stale or NaN slots never reach the output.
``int4_kivi`` K is gathered per block from staging or from per-channel codes
(:func:`kernels.kivi_cache.gather_k`); its writes go through :func:`kernels.kivi_cache.write_kivi`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .cache import KVCacheLayer
from .formats import get_format
from .kivi_cache import gather_k, take_blocks, write_kivi
from .quant import dequantize_kv, quantize_kv

__all__ = ["write_kv_ref", "gather_kv", "decode_attention_ref", "prefill_attention_ref", "causal_attention"]

_MAX_GATHER_ELEMS = 1 << 25  # bound on float32 elements gathered at once by the vectorized decode


def _rows(t: torch.Tensor) -> torch.Tensor:
    """View a block-layout tensor as ``[num_slots, num_kv_heads, width]`` (fp8 seen as uint8)."""
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        t = t.view(torch.uint8)
    return t.view(-1, t.shape[2], t.shape[3])


def write_kv_ref(layer: KVCacheLayer, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize-on-write ``key``/``value`` ``[num_tokens, H, D]`` into ``slot_mapping`` (slot < 0 skipped)."""
    fmt = layer.kv_format
    if fmt.k_per_channel:
        write_kivi(layer, key, value, slot_mapping)
        return
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    for x, data, scale, zero in ((key, layer.k, layer.k_scale, layer.k_zero),
                                 (value, layer.v, layer.v_scale, layer.v_zero)):
        qz = quantize_kv(x[keep], fmt, scale=scale if fmt.scale == "head" else None, group_size=layer.group_size)
        d = qz.data.view(torch.uint8) if qz.data.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else qz.data
        _rows(data)[slots] = d
        if fmt.scale == "token":
            _rows(scale)[slots] = qz.scale
        if fmt.has_zero:
            _rows(zero)[slots] = qz.zero


def gather_kv(layer: KVCacheLayer, which: str, blocks: torch.Tensor) -> torch.Tensor:
    """Dequantized float32 ``[*blocks.shape, block_size, H, D]`` for block ids ``blocks`` (long)."""
    data = getattr(layer, which)
    fmt = layer.kv_format
    if fmt.k_per_channel:
        if which == "k":
            return gather_k(layer, blocks)
        fmt = get_format("int4")  # int4_kivi's V is int4
    raw = (take_blocks(data.view(torch.uint8), blocks).view(data.dtype) if fmt.is_fp8
           else take_blocks(data, blocks))
    scale = getattr(layer, which + "_scale")
    if fmt.scale == "token":
        scale = take_blocks(scale, blocks)
    zero = getattr(layer, which + "_zero")
    zero = take_blocks(zero, blocks) if zero is not None else None
    return dequantize_kv(raw, fmt, scale, zero, dtype=torch.float32)


def _decode_chunk(q: torch.Tensor, layer: KVCacheLayer, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  scale: float, need_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    s, hq, d = q.shape
    h, bs = layer.num_kv_heads, layer.block_size
    lens = seq_lens.long()
    max_len = int(lens.max()) if s else 0
    nblk = max(1, -(-max_len // bs))
    t = nblk * bs
    bt = block_tables[:, :nblk].long().clamp(0, layer.num_blocks - 1)
    k = gather_kv(layer, "k", bt).view(s, t, h, d)
    v = gather_kv(layer, "v", bt).view(s, t, h, d)
    valid = torch.arange(t, device=q.device)[None, :] < lens[:, None]  # [S, T]
    lo = (int(lens.min()) // bs) * bs  # every position below lo is valid in every sequence
    if lo < t:  # zero stale slots (may hold NaN): a masked score does not stop 0 * NaN
        tail = ~valid[:, lo:, None, None]
        k[:, lo:].masked_fill_(tail, 0.0)
        v[:, lo:].masked_fill_(tail, 0.0)
    qf = q.float()[:, :, None]  # [S, Hq, 1, D]
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # [S, H, T, D] views
    out = F.scaled_dot_product_attention(qf, kt, vt, attn_mask=valid[:, None, None, :], scale=scale,
                                         enable_gqa=True)[:, :, 0]
    empty = lens == 0
    if bool(empty.any()):
        out[empty] = 0.0
    lse = None
    if need_lse:
        scores = torch.matmul(qf.reshape(s, h, hq // h, d), kt.transpose(2, 3)) * scale  # [S, H, G, T]
        lse = torch.logsumexp(scores.masked_fill(~valid[:, None, None, :], float("-inf")), dim=-1).view(s, hq)
    return out, lse


def decode_attention_ref(q: torch.Tensor, layer: KVCacheLayer, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                         scale: float | None = None, need_lse: bool = True
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One query per sequence over its first ``seq_lens[s]`` cached tokens.

    Returns ``(out [S, Hq, D] in q.dtype, lse [S, Hq] float32 or None without need_lse)``; an
    empty sequence gives 0 and -inf. Vectorized over sequences (gather through the block table,
    then SDPA with a length mask), in chunks that bound the gathered memory.
    """
    s, hq, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out = torch.empty(s, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(s, hq, dtype=torch.float32, device=q.device) if need_lse else None
    if s == 0:
        return out, lse
    per_seq = max(1, int(seq_lens.max()) + layer.block_size) * layer.num_kv_heads * d * 2
    step = max(1, _MAX_GATHER_ELEMS // per_seq)
    for i in range(0, s, step):
        o, l = _decode_chunk(q[i:i + step], layer, block_tables[i:i + step], seq_lens[i:i + step], scale, need_lse)
        out[i:i + step] = o
        if need_lse:
            lse[i:i + step] = l
    return out, lse


def prefill_attention_ref(q: torch.Tensor, layer: KVCacheLayer, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                          query_start_loc: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Variable-length queries over cached prefix plus causal self-attention.

    Query ``i`` of sequence ``s`` (``q_len = qsl[s+1] - qsl[s]``) sits at position
    ``seq_lens[s] - q_len + i`` and attends to cache positions ``[0, that position]``. Sequences
    with ``q_len == 1`` (decodes in a mixed batch) go through the vectorized decode; longer ones
    are processed one sequence at a time with SDPA.
    """
    t, hq, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out = torch.zeros(t, hq, d, dtype=q.dtype, device=q.device)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [qsl[i + 1] - qsl[i] for i in range(len(lens))]
    single = [i for i, n in enumerate(q_lens) if n == 1]
    if single:
        idx = torch.tensor(single, device=q.device)
        rows = query_start_loc[:-1].long()[idx]
        out[rows] = decode_attention_ref(q[rows], layer, block_tables[idx], seq_lens[idx], scale, False)[0]
    h, bs = layer.num_kv_heads, layer.block_size
    for i, n in enumerate(q_lens):
        if n <= 1:
            continue
        ctx = lens[i]
        nblk = -(-ctx // bs)
        blocks = block_tables[i, :nblk].long()
        k = gather_kv(layer, "k", blocks).reshape(nblk * bs, h, d)[:ctx]
        v = gather_kv(layer, "v", blocks).reshape(nblk * bs, h, d)[:ctx]
        qpos = torch.arange(ctx - n, ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]
        o = causal_attention(q[qsl[i]:qsl[i + 1]].float(), k, v, scale, mask)
        out[qsl[i]:qsl[i + 1]] = o.to(q.dtype)
    return out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's query rows ``q`` ``[n, Hq, D]`` over its K/V ``[ctx, H, D]`` (float32; GQA when
    ``Hq`` is a multiple of ``H``): ``mask`` bool ``[n, ctx]`` (True = visible), or when None plain
    causal attention (``n == ctx``: a fresh prompt). Returns float32 ``[n, Hq, D]``."""
    # 4-D inputs: torch's CPU flash kernel takes them (3-D ones run ~2.5x slower)
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)[0]
    return o.transpose(0, 1)
