"""KV write ("reshape and cache") with quantize-on-write, and block copy.

Divisions use ``div_rn`` (IEEE round-to-nearest) because plain ``/`` on float32 compiles to an
approximate division on NVIDIA GPUs; with it the stored codes equal torch's bit for bit.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import FMT_E4M3, FMT_E5M2, FMT_INT4, FMT_PLAIN, bf16_bits_rne, div_rn, encode_fp8, head_scale, rne


@triton.jit
def _store_row(x, data_ptr, scale_ptr, zero_ptr, row, ok, hs, offs_d,
               D: tl.constexpr, BLOCK_D: tl.constexpr, FMT: tl.constexpr, BF16: tl.constexpr):
    """Quantize one token-head row ``x`` ``[BLOCK_D]`` (float32, 0 past D) and store it at ``row``.

    ``BF16``: the data pointer is a bfloat16 cache viewed as int16; store RNE-rounded bits.
    """
    mask = (offs_d < D) & ok
    if BF16:
        tl.store(data_ptr + row * D + offs_d, bf16_bits_rne(x), mask=mask)
    elif FMT == FMT_PLAIN:
        tl.store(data_ptr + row * D + offs_d, x.to(data_ptr.dtype.element_ty), mask=mask)
    elif FMT == FMT_E4M3:
        tl.store(data_ptr + row * D + offs_d, encode_fp8(div_rn(x, hs), 3, 7, 0x7E).to(tl.uint8), mask=mask)
    elif FMT == FMT_E5M2:
        tl.store(data_ptr + row * D + offs_d, encode_fp8(div_rn(x, hs), 2, 15, 0x7B).to(tl.uint8), mask=mask)
    else:  # int8, symmetric per token-head, fp16 scale
        s = div_rn(tl.max(tl.abs(x), 0), 127.0).to(tl.float16)
        s32 = s.to(tl.float32)
        q = tl.minimum(tl.maximum(rne(div_rn(x, tl.where(s32 == 0, 1.0, s32))), -127.0), 127.0)
        tl.store(data_ptr + row * D + offs_d, q.to(tl.int8), mask=mask)
        tl.store(scale_ptr + row, s, mask=ok)


@triton.jit
def _store_row_int4(src_ptr, data_ptr, scale_ptr, zero_ptr, row, ok,
                    D: tl.constexpr, NG: tl.constexpr, NGP: tl.constexpr, HGP: tl.constexpr):
    """int4: groups of ``D // NG`` along head_dim, fp16 scale and zero, even/odd codes packed in a byte."""
    HG: tl.constexpr = D // NG // 2  # byte pairs per group
    gi = tl.arange(0, NGP)[:, None]
    j = tl.arange(0, HGP)[None, :]
    m = (gi < NG) & (j < HG)
    idx = gi * (2 * HG) + 2 * j
    xe = tl.load(src_ptr + idx, mask=m, other=0.0).to(tl.float32)
    xo = tl.load(src_ptr + idx + 1, mask=m, other=0.0).to(tl.float32)
    inf = float("inf")
    mn = tl.minimum(tl.min(tl.where(m, xe, inf), 1), tl.min(tl.where(m, xo, inf), 1))
    mx = tl.maximum(tl.max(tl.where(m, xe, -inf), 1), tl.max(tl.where(m, xo, -inf), 1))
    real = tl.arange(0, NGP) < NG  # padding groups (NG not a power of two) get 0 instead of inf - inf
    mn = tl.where(real, mn, 0.0)
    mx = tl.where(real, mx, 0.0)
    s = div_rn(mx - mn, 15.0).to(tl.float16)
    z = mn.to(tl.float16)
    s32 = s.to(tl.float32)
    safe = tl.where(s32 == 0, 1.0, s32)[:, None]
    z32 = z.to(tl.float32)[:, None]
    qe = tl.minimum(tl.maximum(rne(div_rn(xe - z32, safe)), 0.0), 15.0).to(tl.int32)
    qo = tl.minimum(tl.maximum(rne(div_rn(xo - z32, safe)), 0.0), 15.0).to(tl.int32)
    byte = (qe | (qo << 4)).to(tl.uint8)
    tl.store(data_ptr + row * (D // 2) + gi * HG + j, byte, mask=m & ok)
    g1 = tl.arange(0, NGP)
    tl.store(scale_ptr + row * NG + g1, s, mask=(g1 < NG) & ok)
    tl.store(zero_ptr + row * NG + g1, z, mask=(g1 < NG) & ok)


@triton.jit
def write_kv_kernel(key_ptr, value_ptr, slot_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, kz_ptr, vz_ptr,
                    H: tl.constexpr, D: tl.constexpr, NG: tl.constexpr, NGP: tl.constexpr, HGP: tl.constexpr,
                    BLOCK_D: tl.constexpr, FMT: tl.constexpr, BF16: tl.constexpr):
    """Grid ``(num_tokens, num_kv_heads)``: store one token-head of K and V at its slot (skip slot < 0)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    ok = slot >= 0
    row = tl.maximum(slot, 0) * H + h
    src = (t.to(tl.int64) * H + h) * D
    if FMT == FMT_INT4:
        _store_row_int4(key_ptr + src, k_ptr, ks_ptr, kz_ptr, row, ok, D, NG, NGP, HGP)
        _store_row_int4(value_ptr + src, v_ptr, vs_ptr, vz_ptr, row, ok, D, NG, NGP, HGP)
    else:
        offs_d = tl.arange(0, BLOCK_D)
        md = offs_d < D
        k_hs = head_scale(ks_ptr, h, FMT)
        v_hs = head_scale(vs_ptr, h, FMT)
        kx = tl.load(key_ptr + src + offs_d, mask=md, other=0.0).to(tl.float32)
        _store_row(kx, k_ptr, ks_ptr, kz_ptr, row, ok, k_hs, offs_d, D, BLOCK_D, FMT, BF16)
        vx = tl.load(value_ptr + src + offs_d, mask=md, other=0.0).to(tl.float32)
        _store_row(vx, v_ptr, vs_ptr, vz_ptr, row, ok, v_hs, offs_d, D, BLOCK_D, FMT, BF16)


@triton.jit
def copy_blocks_kernel(ptr, map_ptr, ROW: tl.constexpr, BLOCK: tl.constexpr):
    """Grid ``(num_pairs, cdiv(ROW, BLOCK))``: copy ``ROW`` elements of block ``src`` to block ``dst``."""
    pair = tl.program_id(0)
    chunk = tl.program_id(1)
    src = tl.load(map_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(map_ptr + 2 * pair + 1).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    m = offs < ROW
    tl.store(ptr + dst * ROW + offs, tl.load(ptr + src * ROW + offs, mask=m), mask=m)
