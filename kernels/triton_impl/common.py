"""Shared Triton device functions: fp8 codecs with integer bit operations, rounding, tile loads.

Why integer bit operations: Triton's interpreter rounds float->fp8 casts wrongly (see
ANCHORS.md), and GPUs before compute capability 8.9 have no e4m3 conversions. Encoding and
decoding with integer ops gives the same bits as torch's casts everywhere.

``INTERPRETED`` records whether these kernels were defined under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from .. import format_table as _ft

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Kernel format codes (KVFormat.code, defined once in kernels.format_table), as constexprs so that
# @triton.jit functions may read them as globals; the FMT argument of every kernel is one of these.
FMT_PLAIN = tl.constexpr(_ft.CODE_PLAIN)
FMT_E4M3 = tl.constexpr(_ft.CODE_E4M3)
FMT_E5M2 = tl.constexpr(_ft.CODE_E5M2)
FMT_INT8 = tl.constexpr(_ft.CODE_INT8)
FMT_INT4 = tl.constexpr(_ft.CODE_INT4)
FMT_INT4_KIVI = tl.constexpr(_ft.CODE_INT4_KIVI)


@triton.jit
def rne(y):
    """Round float32 ``y`` to the nearest integer, ties to even (valid for ``|y| < 2**22``)."""
    return (y + 12582912.0) - 12582912.0


@triton.jit
def div_rn(a, b):
    """IEEE round-to-nearest ``a / b`` (float32); ``b`` is broadcast to ``a``'s shape.

    ``tl.div_rn`` does not broadcast (it would fail to compile on a GPU, though the interpreter
    broadcasts), and plain ``/`` is approximate on NVIDIA GPUs.
    """
    return tl.div_rn(a, tl.zeros_like(a) + b)


@triton.jit
def encode_fp8(x, MANT: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr):
    """float32 -> fp8 bit pattern (int32 in [0, 255]) with round-to-nearest-even.

    Finite values above the largest code become ``MAX_CODE`` (pass 0x7E for saturating e4m3fn,
    0x7B for saturating e5m2, 0x7C to let e5m2 overflow to inf); NaN -> sign | 0x7F.
    """
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    exp = a >> 23
    DROP: tl.constexpr = 23 - MANT
    # normal results: round away DROP mantissa bits (the carry may bump the exponent), re-bias
    rounded = a + ((1 << (DROP - 1)) - 1) + ((a >> DROP) & 1)
    normal = (rounded >> DROP) - ((127 - BIAS) << MANT)
    # subnormal results: code = rne(|x| * 2**(BIAS - 1 + MANT)) from the 24-bit significand
    mant24 = (a & 0x7FFFFF) | 0x800000
    shift = (151 - BIAS - MANT) - exp
    sh = tl.minimum(tl.maximum(shift, 1), 31)
    q = mant24 >> sh
    rem = mant24 & ((1 << sh) - 1)
    half = 1 << (sh - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    sub = tl.where((shift > 31) | (exp == 0), 0, q + up.to(tl.int32))
    code = tl.where(exp >= 128 - BIAS, normal, sub)
    code = tl.minimum(code, MAX_CODE)
    code = tl.where(a > 0x7F800000, 0x7F, code)
    return code | sign


@triton.jit
def bf16_bits_rne(x):
    """float32 -> bfloat16 bit pattern (int16), round to nearest even; NaN stays NaN.

    The interpreter's own float32->bfloat16 cast truncates, hence the integer version.
    """
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = ((bits >> 16) | 0x40)
    return tl.where((bits & 0x7FFFFFFF) > 0x7F800000, nan, rounded).to(tl.int16)


@triton.jit
def decode_fp8(c, IS_E4M3: tl.constexpr):
    """fp8 bit pattern (uint8 tensor) -> float32, exactly; e4m3fn 0x7F/0xFF -> NaN."""
    c16 = c.to(tl.uint16)
    if IS_E4M3:
        # s eeee mmm -> fp16 s 0eeee mmm0000000 is the same value times 2**-8 (normals and subnormals)
        h = ((c16 & 0x80) << 8) | ((c16 & 0x7F) << 7)
        v = h.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
        v = tl.where((c16 & 0x7F) == 0x7F, float("nan"), v)
    else:
        # e5m2 is the high byte of an fp16
        v = (c16 << 8).to(tl.float16, bitcast=True).to(tl.float32)
    return v


@triton.jit
def head_scale(scale_ptr, head, FMT: tl.constexpr):
    """The per-head fp8 scale (FMT_E4M3, FMT_E5M2); 1.0 for every other format."""
    if FMT == FMT_E4M3 or FMT == FMT_E5M2:
        return tl.load(scale_ptr + head).to(tl.float32)
    else:
        return 1.0


@triton.jit
def block_slots(bt_ptr, pos, mask, BS: tl.constexpr):
    """Slot ids (int64) of token positions ``pos`` through a block-table row; 0 where masked."""
    phys = tl.load(bt_ptr + pos // BS, mask=mask, other=0).to(tl.int64)
    return phys * BS + (pos % BS)


@triton.jit
def load_kv_tile(data_ptr, scale_ptr, zero_ptr, slots, mask_n, kvh, offs_d, mask_d, hs,
                 H: tl.constexpr, D: tl.constexpr, NG: tl.constexpr, FMT: tl.constexpr):
    """Dequantized float32 ``[BLOCK_N, BLOCK_D]`` K or V tile of KV head ``kvh`` at ``slots``.

    Masked loads give 0, so stale or NaN slots never enter the math.
    """
    m = mask_n[:, None] & mask_d[None, :]
    row = slots * H + kvh
    if FMT == FMT_INT4 or FMT == FMT_INT4_KIVI:  # int4; also int4_kivi's V
        W: tl.constexpr = D // 2
        G: tl.constexpr = D // NG
        b = tl.load(data_ptr + row[:, None] * W + offs_d[None, :] // 2, mask=m, other=0).to(tl.int32)
        code = ((b >> ((offs_d[None, :] % 2) * 4)) & 0xF).to(tl.float32)
        gi = row[:, None] * NG + offs_d[None, :] // G
        s = tl.load(scale_ptr + gi, mask=m, other=0.0).to(tl.float32)
        z = tl.load(zero_ptr + gi, mask=m, other=0.0).to(tl.float32)
        x = code * s + z
    else:
        raw = tl.load(data_ptr + row[:, None] * D + offs_d[None, :], mask=m, other=0)
        if FMT == FMT_PLAIN:
            x = raw.to(tl.float32)
        elif FMT == FMT_INT8:
            s = tl.load(scale_ptr + row, mask=mask_n, other=0.0).to(tl.float32)
            x = raw.to(tl.float32) * s[:, None]
        else:
            x = decode_fp8(raw, FMT == FMT_E4M3) * hs
    return x


@triton.jit
def load_kivi_k_tile(data_ptr, scale_ptr, zero_ptr, stage_ptr, map_ptr, slots, mask_n, kvh, offs_d, mask_d,
                     H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr):
    """int4_kivi K tile, float32 ``[BLOCK_N, BLOCK_D]``: each token's block is read from its staging
    slot (model dtype) when ``block_map[block] >= 0``, else from the int4 codes with the block's
    per-channel scale and zero. Two masked loads and a ``tl.where``, decided per token's block;
    masked lanes load 0, so NaN in unused slots, side tensors or staging never enters the math.
    """
    m = mask_n[:, None] & mask_d[None, :]
    blk = slots // BS
    off = slots % BS
    st = tl.load(map_ptr + blk, mask=mask_n, other=-1).to(tl.int64)
    staged = st >= 0
    m_st = m & staged[:, None]
    m_q = m & (st < 0)[:, None]
    srow = (tl.maximum(st, 0) * BS + off) * H + kvh
    xs = tl.load(stage_ptr + srow[:, None] * D + offs_d[None, :], mask=m_st, other=0.0).to(tl.float32)
    row = slots * H + kvh
    b = tl.load(data_ptr + row[:, None] * (D // 2) + offs_d[None, :] // 2, mask=m_q, other=0).to(tl.int32)
    code = ((b >> ((offs_d[None, :] % 2) * 4)) & 0xF).to(tl.float32)
    ci = (blk * H + kvh)[:, None] * D + offs_d[None, :]
    s = tl.load(scale_ptr + ci, mask=m_q, other=0.0).to(tl.float32)
    z = tl.load(zero_ptr + ci, mask=m_q, other=0.0).to(tl.float32)
    return tl.where(staged[:, None], xs, code * s + z)


@triton.jit
def dot_f32(a, b, DOT: tl.constexpr):
    """``a @ b`` with float32 accumulation. DOT: 0 = float32 (IEEE), 1 = fp16 inputs, 2 = bf16 inputs.

    The interpreter always uses 0 (its bf16 dot is wrong); GPUs use the model's 16-bit dtype.
    """
    if DOT == 0:
        r = tl.dot(a, b, input_precision="ieee")
    elif DOT == 1:
        r = tl.dot(a.to(tl.float16), b.to(tl.float16))
    else:
        r = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    return r


# The parts every paged attention kernel shares (kernels.triton_impl.attention, .split_attention):
# which query rows a program owns, one online-softmax update, and where its result goes.

@triton.jit
def decode_queries(q_ptr, sl_ptr, bt_ptr, bt_stride, tokens_per_split, HQ: tl.constexpr, D: tl.constexpr,
                   GROUP: tl.constexpr, GP: tl.constexpr, BLOCK_D: tl.constexpr):
    """Split-KV decode program ``(seq, kv head, split)``: the head group's query rows (float32
    ``[GP, BLOCK_D]``, rows past ``GROUP`` 0), their position (the one query token is the last one
    cached), the split's key range ``[start, end)`` and the sequence's block-table row."""
    seq = tl.program_id(0)
    split = tl.program_id(2)
    seq_len = tl.load(sl_ptr + seq)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, BLOCK_D)
    heads = tl.program_id(1) * GROUP + offs_g
    q = tl.load(q_ptr + (seq * HQ + heads)[:, None] * D + offs_d[None, :],
                mask=(offs_g < GROUP)[:, None] & (offs_d < D)[None, :], other=0.0).to(tl.float32)
    q_pos = tl.zeros([GP], tl.int32) + (seq_len - 1)
    return q, q_pos, start, end, bt_ptr + seq.to(tl.int64) * bt_stride


@triton.jit
def store_split(mid_o_ptr, mid_lse_ptr, acc, m_i, l_i, nsplit, HQ: tl.constexpr, GROUP: tl.constexpr,
                GP: tl.constexpr, BLOCK_D: tl.constexpr):
    """Write a decode program's normalised split output ``mid_o[seq, head, split, :]`` and its
    log-sum-exp ``mid_lse[seq, head, split]`` (-inf for an empty split)."""
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    heads = tl.program_id(1) * GROUP + offs_g
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    row = (tl.program_id(0) * HQ + heads) * nsplit + tl.program_id(2)
    tl.store(mid_o_ptr + row[:, None] * BLOCK_D + offs_d[None, :], out, mask=mask_g[:, None])
    tl.store(mid_lse_ptr + row, lse, mask=mask_g)


@triton.jit
def prefill_queries(q_ptr, sl_ptr, qsl_ptr, bt_ptr, bt_stride, HQ: tl.constexpr, D: tl.constexpr,
                    GROUP: tl.constexpr, GP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr):
    """Prefill program ``(seq, kv head, q tile)``: row ``r`` of its tile is query token ``r // GP``
    of the tile, head ``kvh * GROUP + r % GP``; query token ``i`` sits at position
    ``seq_len - q_len + i``. Returns the rows (float32 ``[BLOCK_Q * GP, BLOCK_D]``), their positions,
    the key range end (the tile's last query position; 0 for tiles past the query), the block-table
    row, and the rows' indices in ``q``/``out`` with their mask."""
    seq = tl.program_id(0)
    tile = tl.program_id(2)
    seq_len = tl.load(sl_ptr + seq)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    offs_m = tl.arange(0, BLOCK_Q * GP)
    offs_d = tl.arange(0, BLOCK_D)
    tok = tile * BLOCK_Q + offs_m // GP
    g = offs_m % GP
    mask_m = (tok < q_len) & (g < GROUP)
    q_rows = (q_start + tok).to(tl.int64) * HQ + tl.program_id(1) * GROUP + g
    q = tl.load(q_ptr + q_rows[:, None] * D + offs_d[None, :], mask=mask_m[:, None] & (offs_d < D)[None, :],
                other=0.0).to(tl.float32)
    kv_end = tl.where(tile * BLOCK_Q < q_len, tl.minimum(seq_len, seq_len - q_len + (tile + 1) * BLOCK_Q), 0)
    return q, seq_len - q_len + tok, kv_end, bt_ptr + seq.to(tl.int64) * bt_stride, q_rows, mask_m


@triton.jit
def store_rows(out_ptr, acc, l_i, q_rows, mask_m, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Write the normalised output rows ``acc / l`` of a prefill program to ``out[q_rows]``."""
    offs_d = tl.arange(0, BLOCK_D)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * D + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & (offs_d < D)[None, :])


@triton.jit
def softmax_update(m_i, l_i, s):
    """One online-softmax step over the masked scores ``s`` ``[ROWS, BLOCK_N]``: returns the new
    running max, the factor ``alpha`` that rescales what was accumulated, the weights ``p`` and the
    new sum. A row with nothing visible yet keeps max -inf; its scores are shifted by 0 (no NaN)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_use)
    p = tl.exp(s - m_use[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, 1)
