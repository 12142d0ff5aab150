"""Paged attention over split KV formats (:mod:`kernels.split`): split-KV decode and prefill.

The tile loop reads, per key position, the K and V rows from their codes (``KFMT``: exact or
KIVI with per-channel widths, optional compact scales and RoPE on read; ``VFMT``: exact or a
per-layer codebook) and, where staged, their exact rows (``KROWS``/``VROWS``: 16 = fp16, else
``@krows<b>``/``@vrows<b>`` b-bit symmetric codes with one fp16 scale per token-head row, in the
staging and the sink pool alike: :func:`kernels.split_codec.row_quantize`); each (query row, key)
pair takes the exact row when ``j < SINK`` or ``q_pos - j < WINDOW`` (``WIN``), or, without them,
when the key's block is staged (KIVI's unsealed blocks). Two accumulators keep the value parts
apart, so that ``+rot`` values (stored rotated) are rotated back once per program (``acc_q @ H^T``)
while exact rows are not. Masked lanes load 0: stale slots, NaN side tensors or staging rows of other
blocks never enter the math. The meaning is :func:`kernels.split.attend_split`.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import (FMT_PLAIN, block_slots, decode_queries, div_rn, dot_f32, prefill_queries, softmax_update,
                     store_rows, store_split)


@triton.jit
def _unpack(data_ptr, row, byte, shift, width, R: tl.constexpr, mask):
    """Codes of ``width`` bits at bit ``byte * 8 + shift`` of each token-head row (may straddle bytes)."""
    b0 = tl.load(data_ptr + row[:, None] * R + byte[None, :], mask=mask, other=0).to(tl.int32)
    m1 = mask & (byte[None, :] + 1 < R)
    b1 = tl.load(data_ptr + row[:, None] * R + byte[None, :] + 1, mask=m1, other=0).to(tl.int32)
    word = b0 | (b1 << 8)
    return (word >> shift[None, :]) & ((1 << width[None, :]) - 1)


@triton.jit
def _exact_rows(data_ptr, scale_ptr, row, mask_n, offs_d, mask_d, D: tl.constexpr, BITS: tl.constexpr):
    """Float32 exact rows ``[BLOCK_N, BLOCK_D]`` of a staging or sink pool at token-head rows ``row``.

    ``BITS`` 16: fp16 rows ``[.., D]``. Else (2..8) uint8 codes ``[.., BITS * D / 8]``, channel ``c``
    at bit ``c * BITS`` (little-endian, may straddle bytes; 8: the byte is the code), and an fp16
    scale ``s`` per row: value = ``(2 * code - (2**BITS - 1)) * (s / (2**BITS - 1))``, as
    :func:`kernels.split_codec.row_dequantize`. Masked lanes are 0."""
    m = mask_n[:, None] & mask_d[None, :]
    if BITS == 16:
        x = tl.load(data_ptr + row[:, None] * D + offs_d[None, :], mask=m, other=0.0).to(tl.float32)
    else:
        LV: tl.constexpr = (1 << BITS) - 1
        if BITS == 8:
            code = tl.load(data_ptr + row[:, None] * D + offs_d[None, :], mask=m, other=0).to(tl.int32)
        else:
            R: tl.constexpr = BITS * D // 8
            bit = offs_d * BITS
            code = _unpack(data_ptr, row, bit // 8, bit % 8, tl.zeros_like(offs_d) + BITS, R, m)
        s = tl.load(scale_ptr + row, mask=mask_n, other=0.0).to(tl.float32)
        x = (code * 2 - LV).to(tl.float32) * div_rn(s, LV * 1.0)[:, None]
        x = tl.where(m, x, 0.0)
    return x


@triton.jit
def _k_codes(k_ptr, ks_ptr, kz_ptr, ksup_ptr, kw_ptr, ko_ptr, slots, mask_n, kvh, chan, mask_d,
             H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, RK: tl.constexpr, KFMT: tl.constexpr,
             COMPACT: tl.constexpr):
    """Float32 keys ``[BLOCK_N, BLOCK_D]`` of channels ``chan`` from their codes (KIVI) or exact data."""
    m = mask_n[:, None] & mask_d[None, :]
    row = slots * H + kvh
    if KFMT == FMT_PLAIN:
        x = tl.load(k_ptr + row[:, None] * D + chan[None, :], mask=m, other=0.0).to(tl.float32)
    else:
        w = tl.load(kw_ptr + kvh * D + chan, mask=mask_d, other=0)
        o = tl.load(ko_ptr + kvh * D + chan, mask=mask_d, other=0)
        code = _unpack(k_ptr, row, o // 8, o % 8, w, RK, m).to(tl.float32)
        code = tl.where(w[None, :] == 0, 0.5, code)
        blk = slots // BS
        ci = (blk * H + kvh)[:, None] * D + chan[None, :]
        if COMPACT:
            sup = (blk * H + kvh) * 2
            big = tl.load(ksup_ptr + sup, mask=mask_n, other=0.0).to(tl.float32)
            unit = tl.load(ksup_ptr + sup + 1, mask=mask_n, other=0.0).to(tl.float32)
            s = tl.load(ks_ptr + ci, mask=m, other=0).to(tl.float32) * unit[:, None]
            z = tl.load(kz_ptr + ci, mask=m, other=0).to(tl.float32) * big[:, None]
        else:
            s = tl.load(ks_ptr + ci, mask=m, other=0.0).to(tl.float32)
            z = tl.load(kz_ptr + ci, mask=m, other=0.0).to(tl.float32)
        x = code * s + z
    return x


@triton.jit
def split_attend(q, q_pos, n_start, n_end, k_ptr, v_ptr, ks_ptr, kz_ptr, ksup_ptr, vs_ptr, kw_ptr, ko_ptr, lv_ptr,
                 cos_ptr, sin_ptr, had_ptr, sk_ptr, sv_ptr, map_ptr, xk_ptr, xv_ptr, xmap_ptr,
                 sks_ptr, svs_ptr, xks_ptr, xvs_ptr, bt_row, kvh, offs_d, mask_d, sm_scale, SINK, WINDOW,
                 ROWS: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, RK: tl.constexpr,
                 RV: tl.constexpr, VBITS: tl.constexpr, VG: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, KFMT: tl.constexpr, VFMT: tl.constexpr, COMPACT: tl.constexpr,
                 PRE: tl.constexpr, ROT: tl.constexpr, WIN: tl.constexpr, STAGED: tl.constexpr,
                 HAS_SINK: tl.constexpr, KROWS: tl.constexpr, VROWS: tl.constexpr, DOT: tl.constexpr):
    """Online softmax of ``ROWS`` query rows over positions ``[n_start, n_end)`` of one KV head.

    Returns ``(out, m, l)`` with ``out`` the unnormalised output (code part rotated back for
    ``ROT``, exact part added), ``m`` the running max and ``l`` the sum of ``exp(score - m)``."""
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc_q = tl.zeros([ROWS, BLOCK_D], tl.float32)
    acc_e = tl.zeros([ROWS, BLOCK_D], tl.float32)
    half: tl.constexpr = D // 2
    partner = (offs_d + half) % D
    for n0 in range(n_start, n_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        mask_n = pos < n_end
        slots = block_slots(bt_row, pos, mask_n, BS)
        m2 = mask_n[:, None] & mask_d[None, :]
        kq = _k_codes(k_ptr, ks_ptr, kz_ptr, ksup_ptr, kw_ptr, ko_ptr, slots, mask_n, kvh, offs_d, mask_d,
                      H, D, BS, RK, KFMT, COMPACT)
        if PRE:
            kp = _k_codes(k_ptr, ks_ptr, kz_ptr, ksup_ptr, kw_ptr, ko_ptr, slots, mask_n, kvh, partner, mask_d,
                          H, D, BS, RK, KFMT, COMPACT)
            c = tl.load(cos_ptr + pos[:, None] * D + offs_d[None, :], mask=m2, other=0.0)
            sn = tl.load(sin_ptr + pos[:, None] * D + offs_d[None, :], mask=m2, other=0.0)
            kq = kq * c + kp * sn
        s = dot_f32(q, tl.trans(kq), DOT)
        if WIN or STAGED:
            st = tl.load(map_ptr + slots // BS, mask=mask_n, other=-1).to(tl.int64)
            staged = (st >= 0) & mask_n
            srow = (tl.maximum(st, 0) * BS + slots % BS) * H + kvh
            ke = _exact_rows(sk_ptr, sks_ptr, srow, staged, offs_d, mask_d, D, KROWS)
            if HAS_SINK:  # sink tokens: rows of the sink pool of the sequence's first block
                xs = tl.load(xmap_ptr + tl.load(bt_row)).to(tl.int64)
                insink = (pos < SINK) & mask_n & (xs >= 0)
                xrow = (tl.maximum(xs, 0) * SINK + tl.minimum(pos, tl.maximum(SINK - 1, 0))) * H + kvh
                xk = _exact_rows(xk_ptr, xks_ptr, xrow, insink, offs_d, mask_d, D, KROWS)
                ke = tl.where(insink[:, None], xk, ke)
            se = dot_f32(q, tl.trans(ke), DOT)
            if WIN:
                exact = (pos[None, :] < SINK) | ((q_pos[:, None] - pos[None, :]) < WINDOW)
            else:
                exact = staged[None, :] & (q_pos[:, None] >= 0)
            s = tl.where(exact, se, s)
        s = s * sm_scale
        s = tl.where(mask_n[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new, alpha, p, l_i = softmax_update(m_i, l_i, s)
        row = slots * H + kvh
        if VFMT == FMT_PLAIN:
            vq = tl.load(v_ptr + row[:, None] * D + offs_d[None, :], mask=m2, other=0.0).to(tl.float32)
        else:
            bit = offs_d * VBITS
            width = tl.zeros_like(offs_d) + VBITS
            code = _unpack(v_ptr, row, bit // 8, bit % 8, width, RV, m2)
            lv = tl.load(lv_ptr + code, mask=m2, other=0.0)
            sc = tl.load(vs_ptr + row[:, None] * (D // VG) + offs_d[None, :] // VG, mask=m2, other=0.0)
            vq = lv * sc.to(tl.float32)
        if WIN:
            pe = tl.where(exact, p, 0.0)
            ve = _exact_rows(sv_ptr, svs_ptr, srow, staged, offs_d, mask_d, D, VROWS)
            if HAS_SINK:
                xv = _exact_rows(xv_ptr, xvs_ptr, xrow, insink, offs_d, mask_d, D, VROWS)
                ve = tl.where(insink[:, None], xv, ve)
            acc_e = acc_e * alpha[:, None] + dot_f32(pe, ve, DOT)
            acc_q = acc_q * alpha[:, None] + dot_f32(p - pe, vq, DOT)
        else:
            acc_q = acc_q * alpha[:, None] + dot_f32(p, vq, DOT)
        m_i = m_new
    if ROT:
        ht = tl.load(had_ptr + offs_d[None, :] * D + offs_d[:, None], mask=mask_d[:, None] & mask_d[None, :],
                     other=0.0)  # H^T[a, b] = H[b, a]
        acc_q = dot_f32(acc_q, ht, DOT)
    return acc_q + acc_e, m_i, l_i


@triton.jit
def split_decode_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, kz_ptr, ksup_ptr, vs_ptr, kw_ptr, ko_ptr, lv_ptr, cos_ptr,
                        sin_ptr, had_ptr, sk_ptr, sv_ptr, map_ptr, xk_ptr, xv_ptr, xmap_ptr,
                        sks_ptr, svs_ptr, xks_ptr, xvs_ptr, bt_ptr, sl_ptr, mid_o_ptr, mid_lse_ptr,
                        sm_scale, bt_stride, tokens_per_split, nsplit, SINK, WINDOW,
                        HQ: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, RK: tl.constexpr,
                        RV: tl.constexpr, VBITS: tl.constexpr, VG: tl.constexpr, GROUP: tl.constexpr,
                        GP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, KFMT: tl.constexpr,
                        VFMT: tl.constexpr, COMPACT: tl.constexpr, PRE: tl.constexpr, ROT: tl.constexpr,
                        WIN: tl.constexpr, STAGED: tl.constexpr, HAS_SINK: tl.constexpr, KROWS: tl.constexpr,
                        VROWS: tl.constexpr, DOT: tl.constexpr):
    """Stage 1 of split-KV decode, grid ``(num_seqs, num_kv_heads, nsplit)`` (merge: the common kernel)."""
    kvh = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    q, q_pos, start, end, bt_row = decode_queries(q_ptr, sl_ptr, bt_ptr, bt_stride, tokens_per_split,
                                                  HQ, D, GROUP, GP, BLOCK_D)
    acc, m_i, l_i = split_attend(q, q_pos, start, end, k_ptr, v_ptr, ks_ptr, kz_ptr, ksup_ptr, vs_ptr, kw_ptr,
                                 ko_ptr, lv_ptr, cos_ptr, sin_ptr, had_ptr, sk_ptr, sv_ptr, map_ptr, xk_ptr, xv_ptr,
                                 xmap_ptr, sks_ptr, svs_ptr, xks_ptr, xvs_ptr, bt_row, kvh, offs_d,
                                 offs_d < D, sm_scale, SINK, WINDOW, GP, H, D, BS, RK, RV, VBITS, VG,
                                 BLOCK_N, BLOCK_D, KFMT, VFMT, COMPACT, PRE, ROT, WIN, STAGED, HAS_SINK,
                                 KROWS, VROWS, DOT)
    store_split(mid_o_ptr, mid_lse_ptr, acc, m_i, l_i, nsplit, HQ, GROUP, GP, BLOCK_D)


@triton.jit
def split_prefill_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, kz_ptr, ksup_ptr, vs_ptr, kw_ptr, ko_ptr, lv_ptr, cos_ptr,
                         sin_ptr, had_ptr, sk_ptr, sv_ptr, map_ptr, xk_ptr, xv_ptr, xmap_ptr,
                         sks_ptr, svs_ptr, xks_ptr, xvs_ptr, bt_ptr, sl_ptr, qsl_ptr, out_ptr,
                         sm_scale, bt_stride, SINK, WINDOW,
                         HQ: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, RK: tl.constexpr,
                         RV: tl.constexpr, VBITS: tl.constexpr, VG: tl.constexpr, GROUP: tl.constexpr,
                         GP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         KFMT: tl.constexpr, VFMT: tl.constexpr, COMPACT: tl.constexpr, PRE: tl.constexpr,
                         ROT: tl.constexpr, WIN: tl.constexpr, STAGED: tl.constexpr, HAS_SINK: tl.constexpr,
                         KROWS: tl.constexpr, VROWS: tl.constexpr, DOT: tl.constexpr):
    """Grid ``(num_seqs, num_kv_heads, q_tiles)``: ``BLOCK_Q`` query tokens x the head group (rows as
    in :func:`kernels.triton_impl.attention.prefill_kernel`)."""
    kvh = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    q, q_pos, kv_end, bt_row, q_rows, mask_m = prefill_queries(q_ptr, sl_ptr, qsl_ptr, bt_ptr, bt_stride,
                                                               HQ, D, GROUP, GP, BLOCK_Q, BLOCK_D)
    acc, m_i, l_i = split_attend(q, q_pos, 0, kv_end, k_ptr, v_ptr, ks_ptr, kz_ptr, ksup_ptr, vs_ptr, kw_ptr,
                                 ko_ptr, lv_ptr, cos_ptr, sin_ptr, had_ptr, sk_ptr, sv_ptr, map_ptr, xk_ptr, xv_ptr,
                                 xmap_ptr, sks_ptr, svs_ptr, xks_ptr, xvs_ptr, bt_row, kvh, offs_d,
                                 offs_d < D, sm_scale, SINK, WINDOW, BLOCK_Q * GP, H, D, BS, RK, RV, VBITS,
                                 VG, BLOCK_N, BLOCK_D, KFMT, VFMT, COMPACT, PRE, ROT, WIN, STAGED, HAS_SINK,
                                 KROWS, VROWS, DOT)
    store_rows(out_ptr, acc, l_i, q_rows, mask_m, D, BLOCK_D)
