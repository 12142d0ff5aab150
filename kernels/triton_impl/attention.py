"""Paged attention kernels: split-KV decode (two stages) and prefill/extend.

Both pack one KV head's group of query heads into the rows of a tile, so each K/V tile is loaded
(and dequantized) once per group. K/V are gathered token by token through the block table, which
makes any block size (1 included) work; loads are masked at ``seq_len``. ``int4_kivi``
(``FMT_INT4_KIVI``) reads K per block from staging or from per-channel int4 (``kst_ptr``/``map_ptr``:
staging rows and block -> slot map; dummies for the other formats, never read) and V as int4.

Both kernels run the same online-softmax loop, :func:`attend`: one definition of the tile math,
including the guard for rows that see no key yet (their running max stays -inf).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (FMT_INT4_KIVI, block_slots, decode_queries, dot_f32, head_scale, load_kivi_k_tile, load_kv_tile,
                     prefill_queries, softmax_update, store_rows, store_split)


@triton.jit
def attend(q, q_pos, n_start, n_end, k_ptr, v_ptr, ks_ptr, vs_ptr, kz_ptr, vz_ptr, kst_ptr, map_ptr, bt_row, kvh,
           offs_d, mask_d, sm_scale,
           ROWS: tl.constexpr, H: tl.constexpr, D: tl.constexpr, NG: tl.constexpr, BS: tl.constexpr,
           BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, FMT: tl.constexpr, DOT: tl.constexpr):
    """Online softmax of ``ROWS`` query rows ``q`` (float32 ``[ROWS, BLOCK_D]``, at positions
    ``q_pos`` ``[ROWS]``) over the cache positions ``[n_start, n_end)`` of one KV head.

    Returns ``(acc, m, l)``: the unnormalised output ``[ROWS, BLOCK_D]``, the running max and the
    sum of ``exp(score - m)`` per row. Row ``r`` sees position ``p`` iff ``p < n_end`` and
    ``p <= q_pos[r]``; a row that has seen nothing keeps ``m = -inf``, ``l = 0``, ``acc = 0``
    (scores are shifted by 0 instead of -inf for it, so no NaN appears).
    """
    k_hs = head_scale(ks_ptr, kvh, FMT)
    v_hs = head_scale(vs_ptr, kvh, FMT)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for n0 in range(n_start, n_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        mask_n = pos < n_end
        slots = block_slots(bt_row, pos, mask_n, BS)
        if FMT == FMT_INT4_KIVI:
            k = load_kivi_k_tile(k_ptr, ks_ptr, kz_ptr, kst_ptr, map_ptr, slots, mask_n, kvh, offs_d, mask_d, H, D, BS)
        else:
            k = load_kv_tile(k_ptr, ks_ptr, kz_ptr, slots, mask_n, kvh, offs_d, mask_d, k_hs, H, D, NG, FMT)
        s = dot_f32(q, tl.trans(k), DOT) * sm_scale
        s = tl.where(mask_n[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new, alpha, p, l_i = softmax_update(m_i, l_i, s)
        v = load_kv_tile(v_ptr, vs_ptr, vz_ptr, slots, mask_n, kvh, offs_d, mask_d, v_hs, H, D, NG, FMT)
        acc = acc * alpha[:, None] + dot_f32(p, v, DOT)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def decode_split_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, kz_ptr, vz_ptr, kst_ptr, map_ptr, bt_ptr, sl_ptr, mid_o_ptr, mid_lse_ptr,
                        sm_scale, bt_stride, tokens_per_split, nsplit,
                        HQ: tl.constexpr, H: tl.constexpr, D: tl.constexpr, NG: tl.constexpr, BS: tl.constexpr,
                        GROUP: tl.constexpr, GP: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_D: tl.constexpr, FMT: tl.constexpr, DOT: tl.constexpr):
    """Stage 1, grid ``(num_seqs, num_kv_heads, nsplit)``: attention over one split of the context.

    Writes the split's normalised output ``mid_o[seq, head, split, :]`` and its log-sum-exp
    ``mid_lse[seq, head, split]`` (-inf for an empty split).
    """
    kvh = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    q, q_pos, start, end, bt_row = decode_queries(q_ptr, sl_ptr, bt_ptr, bt_stride, tokens_per_split,
                                                  HQ, D, GROUP, GP, BLOCK_D)
    acc, m_i, l_i = attend(q, q_pos, start, end, k_ptr, v_ptr, ks_ptr, vs_ptr, kz_ptr, vz_ptr, kst_ptr, map_ptr,
                           bt_row, kvh, offs_d, offs_d < D, sm_scale, GP, H, D, NG, BS, BLOCK_N, BLOCK_D, FMT, DOT)
    store_split(mid_o_ptr, mid_lse_ptr, acc, m_i, l_i, nsplit, HQ, GROUP, GP, BLOCK_D)


@triton.jit
def decode_merge_kernel(mid_o_ptr, mid_lse_ptr, out_ptr, lse_ptr, nsplit, D: tl.constexpr, SP: tl.constexpr,
                        BLOCK_D: tl.constexpr):
    """Stage 2, grid ``(num_seqs * num_q_heads,)``: merge the ``nsplit <= SP`` splits by log-sum-exp.

    The split count is a runtime argument so that batches of different sizes reuse one compiled kernel.
    """
    row = tl.program_id(0)
    offs_s = tl.arange(0, SP)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < nsplit
    lse = tl.load(mid_lse_ptr + row * nsplit + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)
    total = tl.sum(w, 0)
    o = tl.load(mid_o_ptr + (row * nsplit + offs_s)[:, None] * BLOCK_D + offs_d[None, :],
                mask=mask_s[:, None], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * D + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < D)
    tl.store(lse_ptr + row, tl.where(total > 0, m_safe + tl.log(tl.where(total > 0, total, 1.0)), float("-inf")))


@triton.jit
def prefill_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, kz_ptr, vz_ptr, kst_ptr, map_ptr, bt_ptr, sl_ptr, qsl_ptr, out_ptr,
                   sm_scale, bt_stride,
                   HQ: tl.constexpr, H: tl.constexpr, D: tl.constexpr, NG: tl.constexpr, BS: tl.constexpr,
                   GROUP: tl.constexpr, GP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, FMT: tl.constexpr, DOT: tl.constexpr):
    """Grid ``(num_seqs, num_kv_heads, q_tiles)``: ``BLOCK_Q`` query tokens x the head group.

    Row ``r`` of the tile is token ``r // GP``, head ``kvh * GROUP + r % GP``. Query token ``i``
    sits at position ``seq_len - q_len + i`` and sees cache positions ``<=`` that position.
    """
    kvh = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    q, q_pos, kv_end, bt_row, q_rows, mask_m = prefill_queries(q_ptr, sl_ptr, qsl_ptr, bt_ptr, bt_stride,
                                                               HQ, D, GROUP, GP, BLOCK_Q, BLOCK_D)
    acc, m_i, l_i = attend(q, q_pos, 0, kv_end, k_ptr, v_ptr, ks_ptr, vs_ptr, kz_ptr, vz_ptr, kst_ptr, map_ptr,
                           bt_row, kvh, offs_d, offs_d < D, sm_scale, BLOCK_Q * GP, H, D, NG, BS, BLOCK_N, BLOCK_D,
                           FMT, DOT)
    store_rows(out_ptr, acc, l_i, q_rows, mask_m, D, BLOCK_D)
