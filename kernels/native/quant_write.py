"""The compiled quantize-on-write of split formats (``quant_write.c``): the new tokens' value codes
and scales, exact rows and staging rows (fp16, or ``@krows``/``@vrows`` codes with their scales),
in one pass over those rows only.

:func:`write_split` takes the blocks whose write changes no staging bookkeeping (no token at
the block's offset 0 or last offset, the block already staged where the layer stages, no sink
token) and returns the other tokens, untouched: the caller writes them with
:func:`kernels.split.write_split`, the reference whose codes these are bit for bit
(``tests/test_native_write.py``). :func:`write_plain` does the same for ``int8``, ``int4`` and
``int4_kivi`` layers (:func:`kernels.reference.write_kv_ref`; ``int4_kivi``'s seals and new blocks
stay on the reference). The Hadamard rotation of values stays a torch matmul so its
float rounding is the reference's.
"""
from __future__ import annotations

import ctypes

import torch

from ..cache import KVCacheLayer
from ..format_table import CODE_CB, CODE_INT4, CODE_INT8
from . import available, library

__all__ = ["supports", "write_split", "supports_plain", "write_plain"]

_EXACT = {torch.float32: 0, torch.float16: 1}


class _Spec(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("bs", "hkv", "d", "sink", "k_dtype", "v_dtype", "v_bits", "v_group",
                                              "v_row_bytes", "n_levels")] + \
               [("bounds", ctypes.c_void_p), ("max_level", ctypes.c_float)] + \
               [(n, ctypes.c_void_p) for n in ("k", "v", "v_scale", "map", "sk", "sv")] + \
               [(n, ctypes.c_int64) for n in ("sk_bits", "sv_bits")] + \
               [(n, ctypes.c_void_p) for n in ("sk_scale", "sv_scale")]


def supports(layer: KVCacheLayer) -> bool:
    """Whether :func:`write_split` can take writes into ``layer`` (a split format on CPU whose exact
    sides are fp32 or fp16, whose value side, if coded, is a codebook, and whose staging rows are
    fp16 or ``@krows``/``@vrows`` codes)."""
    fmt = layer.kv_format
    if not fmt.split or layer.device.type != "cpu" or not available():
        return False
    ks, vs = fmt.k_side, fmt.v_side
    k_ok = layer.k.dtype in _EXACT if ks.exact else layer.staging is not None
    v_ok = layer.v.dtype in _EXACT if vs.exact else vs.code == CODE_CB
    pool = layer.staging  # fp16 rows, or codes (@krows<b>/@vrows<b>) with fp16 scales
    pool_ok = pool is None or all(t is None or bits < 16 or t.dtype == torch.float16
                                  for t, bits in ((pool.k, pool.k_bits), (pool.v, pool.v_bits)))
    return k_ok and v_ok and pool_ok and (not fmt.sink or layer.sink is not None)


def _spec(layer: KVCacheLayer, keep: list) -> _Spec:
    fmt, t = layer.kv_format, layer.tables
    ks, vs = fmt.k_side, fmt.v_side
    s = _Spec(bs=layer.block_size, hkv=layer.num_kv_heads, d=layer.head_dim, sink=fmt.sink,
              k_dtype=_EXACT[layer.k.dtype] if ks.exact else -1, v_dtype=_EXACT[layer.v.dtype] if vs.exact else -1,
              k=layer.k.data_ptr(), v=layer.v.data_ptr())
    if not vs.exact:
        lv = t.v_levels
        bounds = ((lv[1:] + lv[:-1]) / 2).contiguous()  # cb_quantize's boundaries, the same float32 op
        keep.append(bounds)
        s.v_bits, s.v_group, s.v_row_bytes, s.n_levels = vs.bits, vs.group, layer.v.shape[-1], lv.numel()
        s.bounds, s.max_level, s.v_scale = bounds.data_ptr(), float(lv.abs().max()), layer.v_scale.data_ptr()
    pool = layer.staging
    if pool is not None:
        s.map, s.sk = pool.map_host.data_ptr(), pool.k.data_ptr()
        s.sv = pool.v.data_ptr() if pool.v is not None else None
        s.sk_bits, s.sv_bits = pool.k_bits, pool.v_bits
        s.sk_scale = pool.k_scale.data_ptr() if pool.k_scale is not None else None
        s.sv_scale = pool.v_scale.data_ptr() if pool.v is not None and pool.v_scale is not None else None
    return s


def write_split(layer: KVCacheLayer, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
                positions: torch.Tensor | None) -> torch.Tensor | None:
    """Write the tokens of ``key``/``value`` ``[T, H, D]`` at ``slot_mapping`` (< 0 skipped) whose
    blocks are on the fast path (see the module docstring); return the indices of the others
    (host int64, nothing of their blocks written), or None when every token was written.
    ``positions``: host int64 ``[T]`` (checked by the caller), needed with a sink."""
    fmt = layer.kv_format
    sm = slot_mapping.to(torch.int64).contiguous()
    if fmt.sink and positions is None:
        return torch.arange(sm.numel())
    kx = key.float().contiguous()
    vx = value.float().contiguous()
    vr = (vx @ layer.tables.hadamard).contiguous() if fmt.v_side.rotate and not fmt.v_side.exact else vx
    pos = positions.to(torch.int64).contiguous() if positions is not None else sm
    slow = torch.empty(sm.numel(), dtype=torch.uint8)
    keep: list = []
    spec = _spec(layer, keep)
    n_slow = library().split_write_f32(kx.data_ptr(), vx.data_ptr(), vr.data_ptr(), sm.data_ptr(), pos.data_ptr(),
                                       sm.numel(), ctypes.addressof(spec), slow.data_ptr())
    return torch.nonzero(slow).squeeze(1) if n_slow else None


class _PSpec(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("bs", "hkv", "d", "groups", "k_code", "v_code")] + \
               [(n, ctypes.c_void_p) for n in ("k", "v", "k_scale", "v_scale", "k_zero", "v_zero", "map", "sk")] + \
               [("stage_dtype", ctypes.c_int64)]


_PCODE = {CODE_INT8: 4, CODE_INT4: 5}


def supports_plain(layer: KVCacheLayer) -> bool:
    """Whether :func:`write_plain` takes ``layer``: ``int8``/``int4`` (per-token scales), or
    ``int4_kivi`` with fp32/fp16 staging, on CPU."""
    fmt = layer.kv_format
    if fmt.split or layer.device.type != "cpu" or not available():
        return False
    if fmt.k_per_channel:
        return layer.staging is not None and layer.staging.k.dtype in _EXACT
    return fmt.code in _PCODE and fmt.scale == "token"


def write_plain(layer: KVCacheLayer, key: torch.Tensor, value: torch.Tensor,
                slot_mapping: torch.Tensor) -> torch.Tensor | None:
    """Like :func:`write_split` for the layers :func:`supports_plain` takes: writes what it can,
    returns the indices of the tokens left to the reference (None: all written)."""
    fmt = layer.kv_format
    kx, vx = key.float().contiguous(), value.float().contiguous()
    sm = slot_mapping.to(torch.int64).contiguous()
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    kivi = fmt.k_per_channel
    s = _PSpec(bs=layer.block_size, hkv=layer.num_kv_heads, d=layer.head_dim,
               groups=layer.v_scale.shape[-1] if kivi or fmt.code == CODE_INT4 else 1,
               k_code=6 if kivi else _PCODE[fmt.code], v_code=5 if kivi else _PCODE[fmt.code],
               k=ptr(layer.k), v=ptr(layer.v), k_scale=ptr(layer.k_scale), v_scale=ptr(layer.v_scale),
               k_zero=ptr(layer.k_zero), v_zero=ptr(layer.v_zero))
    if kivi:
        s.map, s.sk, s.stage_dtype = layer.staging.map_host.data_ptr(), layer.staging.k.data_ptr(), \
            _EXACT[layer.staging.k.dtype]
    slow = torch.empty(sm.numel(), dtype=torch.uint8)
    n_slow = library().plain_write_f32(kx.data_ptr(), vx.data_ptr(), sm.data_ptr(), sm.numel(), ctypes.addressof(s),
                                       slow.data_ptr())
    return torch.nonzero(slow).squeeze(1) if n_slow else None
