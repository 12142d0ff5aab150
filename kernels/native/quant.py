"""The compiled fused decode over quantized KV (``quant_decode.c``): each cached row's codes are
read and dequantized inside the attention loop (no float32 copy of K or V).

:func:`supports` says which layers it takes (every served format: fp16, bf16, fp8, int8, int4,
``int4_kivi`` and the split formats, head_dim a multiple of 8 and at most 256, on CPU);
:func:`decode` computes what :func:`kernels.reference.decode_attention_ref` (plain and
``int4_kivi``) and :func:`kernels.split_read.split_decode_ref` (split formats) compute, within
float32 rounding. The caller (:func:`kernels.paged_decode_attention`) has checked the block
tables and lengths against the layer; the layer's own invariants (staging maps, width tables,
codebook sizes: :func:`kernels.cache.check_layer`) bound every other index C reads.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from ..cache import KVCacheLayer
from ..errors import ShapeError
from ..format_table import CODE_CB, CODE_INT4, CODE_INT8, CODE_KIVI, CODE_PLAIN, FP8_CODES, KVFormat
from ..staging import StagingPool
from . import available, library

__all__ = ["supports", "decode"]

S_F32, S_F16, S_BF16, S_LUT8, S_INT8, S_INT4, S_KIVI, S_CB = range(8)
_PLAIN = {torch.float32: S_F32, torch.float16: S_F16, torch.bfloat16: S_BF16}
_p = ctypes.c_void_p


class _Side(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("code", "row_bytes", "groups", "bits", "compact", "n_pos",
                                              "safe_rows")] + \
               [(n, _p) for n in ("data", "scale", "zero", "lut", "bstep", "bzero", "bsuper", "width", "offset",
                                  "cos", "sin", "hadamard")]


class _Exact(ctypes.Structure):
    """exact_t: the staging and sink pools' rows; ``k_bits``/``v_bits`` 2..8 (``@krows``/``@vrows``)
    mean coded rows of ``*_row_bytes`` bytes with fp16 scales in both pools, 0 or 16 plain rows."""
    _fields_ = [(n, ctypes.c_int64) for n in ("dtype", "sink", "window", "windowed")] + \
               [(n, _p) for n in ("k", "v", "map", "sk", "sv", "smap")] + \
               [(n, ctypes.c_int64) for n in ("k_bits", "v_bits", "k_row_bytes", "v_row_bytes")] + \
               [(n, _p) for n in ("k_scale", "v_scale", "sk_scale", "sv_scale")]


def supports(layer: KVCacheLayer) -> bool:
    """Whether :func:`decode` takes ``layer`` (and the compiled kernels are available)."""
    d, h = layer.head_dim, layer.num_kv_heads
    fmt = layer.kv_format
    if layer.device.type != "cpu" or d % 8 or d > 256 or h > 32 or h * d > 8192 or not available():
        return False
    if fmt.split:
        if fmt.sink and not (layer.sink is not None and layer.sink.num_slots):
            return False
        return all(s.exact and s.storage_dtype in _PLAIN or s.code in (CODE_KIVI, CODE_CB)
                   for s in (fmt.k_side, fmt.v_side))
    if fmt.k_per_channel:
        return layer.staging.k.dtype in _PLAIN
    return fmt.code in (CODE_INT8, CODE_INT4, CODE_PLAIN, *FP8_CODES) and (fmt.quantized or layer.k.dtype in _PLAIN)


@functools.cache
def _fp8_values(dtype: torch.dtype) -> torch.Tensor:
    """float32 [256]: the value of every fp8 bit pattern (NaN patterns read as NaN)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _plain_side(data: torch.Tensor, d: int) -> _Side:
    return _Side(code=_PLAIN[data.dtype], row_bytes=d * data.element_size(), data=_ptr(data))


def _sides(layer: KVCacheLayer, keep: list) -> tuple[_Side, _Side, _Exact]:
    """The C descriptors of a layer; ``keep`` collects the tensors they point into (kept alive)."""
    fmt, d, h = layer.kv_format, layer.head_dim, layer.num_kv_heads
    ex = _Exact()
    if fmt.split:
        t = layer.tables
        sides = []
        for which, side in (("k", fmt.k_side), ("v", fmt.v_side)):
            data = getattr(layer, which)
            if side.exact:
                sides.append(_plain_side(data, d))
            elif side.code == CODE_CB:
                sides.append(_Side(code=S_CB, row_bytes=data.shape[-1], groups=d // side.group, bits=side.bits,
                                   data=_ptr(data), scale=_ptr(layer.v_scale), lut=_ptr(t.v_levels),
                                   hadamard=_ptr(t.hadamard) if side.rotate else None))
            else:
                uniform = not side.alloc
                # bits: the uniform width (a fractional mean has +alloc: the C code reads widths and offsets)
                s = _Side(code=S_KIVI, row_bytes=data.shape[-1], bits=int(side.bits), compact=int(side.compact),
                          data=_ptr(data), bstep=_ptr(layer.k_scale), bzero=_ptr(layer.k_zero),
                          bsuper=_ptr(layer.k_super), width=_ptr(t.k_width),
                          offset=None if uniform else _ptr(t.k_offset))
                if side.pre_rope:
                    s.cos, s.sin, s.n_pos = _ptr(t.cos), _ptr(t.sin), t.cos.shape[0]
                sides.append(s)
        ks, vs = sides
        keep.append(t)
        win = bool(fmt.sink or fmt.window)
        pool = layer.staging
        if pool is not None and pool.num_slots:
            _exact_rows(ex, fmt, pool, layer.sink, win)
        return ks, vs, ex
    if fmt.k_per_channel:  # int4_kivi: K int4 per channel over the block (staged until full), V int4
        g = layer.v_scale.shape[-1]
        w = torch.full((h, d), 4, dtype=torch.int32)
        keep.append(w)
        ks = _Side(code=S_KIVI, row_bytes=d // 2, bits=4, data=_ptr(layer.k), bstep=_ptr(layer.k_scale),
                   bzero=_ptr(layer.k_zero), width=_ptr(w))
        vs = _Side(code=S_INT4, row_bytes=d // 2, groups=g, data=_ptr(layer.v), scale=_ptr(layer.v_scale),
                   zero=_ptr(layer.v_zero))
        pool = layer.staging
        if pool.num_slots:
            ex.dtype, ex.k, ex.map = _PLAIN[pool.k.dtype], _ptr(pool.k), _ptr(pool.block_map)
        return ks, vs, ex
    out = []
    for which in ("k", "v"):
        data, scale, zero = (getattr(layer, which + n) for n in ("", "_scale", "_zero"))
        if fmt.is_fp8:
            lut = (_fp8_values(fmt.storage_dtype)[None, :] * scale.float()[:, None]).contiguous()
            keep.append(lut)
            out.append(_Side(code=S_LUT8, row_bytes=d, data=_ptr(data.view(torch.uint8)), lut=_ptr(lut)))
        elif fmt.code == CODE_INT8:
            out.append(_Side(code=S_INT8, row_bytes=d, data=_ptr(data), scale=_ptr(scale)))
        elif fmt.code == CODE_INT4:
            out.append(_Side(code=S_INT4, row_bytes=d // 2, groups=scale.shape[-1], data=_ptr(data),
                             scale=_ptr(scale), zero=_ptr(zero)))
        else:
            out.append(_plain_side(data, d))
    return out[0], out[1], ex


def _exact_rows(ex: _Exact, fmt: KVFormat, pool: StagingPool, sink: StagingPool | None, win: bool) -> None:
    """Fill ``ex`` from a split layer's staging pool (non-empty) and sink pool (None or empty: no
    sink rows); a coded side (``k_bits``/``v_bits`` < 16) carries its row bytes and both pools'
    scales. The sink pool codes its rows as the staging pool does (checked with the layer, kernels.cache)."""
    ex.k_bits, ex.v_bits = pool.k_bits, pool.v_bits
    ex.dtype = S_F16 if pool.k_bits < 16 else _PLAIN[pool.k.dtype]  # plain rows' dtype (split: fp16)
    if pool.k_bits < 16:
        ex.k_row_bytes, ex.k_scale = pool.k.shape[-1], _ptr(pool.k_scale)
    ex.k, ex.map = _ptr(pool.k), _ptr(pool.block_map)
    ex.v = _ptr(pool.v) if win else None
    if win and pool.v_bits < 16:
        ex.v_row_bytes, ex.v_scale = pool.v.shape[-1], _ptr(pool.v_scale)
    ex.windowed, ex.sink, ex.window = int(win), fmt.sink, fmt.window
    if sink is not None and sink.num_slots:
        ex.sk, ex.sv, ex.smap = _ptr(sink.k), _ptr(sink.v), _ptr(sink.block_map)
        ex.sk_scale, ex.sv_scale = _ptr(sink.k_scale), _ptr(sink.v_scale)


def decode(q: torch.Tensor, layer: KVCacheLayer, block_tables: torch.Tensor, seq_lens: torch.Tensor,
           scale: float) -> torch.Tensor:
    """One query per sequence over its first ``seq_lens[s]`` positions of ``layer`` (checked by the
    caller); ``q`` ``[S, Hq, D]`` any float dtype. Returns ``[S, Hq, D]`` in ``q.dtype``."""
    if not supports(layer):
        raise ShapeError(f"the native quantized decode does not take kv format {layer.kv_format.name!r} "
                         f"with head_dim {layer.head_dim} on {layer.device}")
    lib = library()
    qf = q.float()
    if qf.stride(2) != 1:
        qf = qf.contiguous()
    s, hq, d = qf.shape
    tables = block_tables.to(torch.int64).contiguous()
    lens = seq_lens.to(torch.int64).contiguous()
    t_max = max(1, int(lens.max())) if s else 1
    scores = torch.empty(max(1, s) * hq * t_max)
    out = torch.empty(s, hq, d)
    if s == 0:
        return out.to(q.dtype)
    keep: list = []
    ks, vs, ex = _sides(layer, keep)
    rows = layer.num_blocks * layer.block_size * layer.num_kv_heads
    for side in (ks, vs):  # rows followed by >= 16 bytes of the same tensor: read in place
        side.safe_rows = rows - -(-16 // max(1, side.row_bytes))
    lib.quant_decode_f32(qf.data_ptr(), qf.stride(0), qf.stride(1), ctypes.addressof(ks), ctypes.addressof(vs),
                         ctypes.addressof(ex), tables.data_ptr(), tables.shape[1], lens.data_ptr(), s, hq,
                         layer.num_kv_heads, d, layer.block_size, float(scale), scores.data_ptr(), t_max,
                         out.data_ptr(), torch.get_num_threads())
    return out.to(q.dtype)
