"""Host-side launchers of the split-format attention kernels (:mod:`.split_attention`)."""
from __future__ import annotations

import torch

from ..cache import KVCacheLayer
from ..format_table import CODE_PLAIN
from .attention import decode_merge_kernel
from .launch import decode_geometry, dot_code, pow2, prefill_geometry
from .split_attention import split_decode_kernel, split_prefill_kernel


def _args(layer: KVCacheLayer) -> tuple[list[torch.Tensor], dict]:
    """Tensors (dummies where a side has none: never read) and constexprs of a split layer.

    Exact rows (staging and sink pool) are read as ``KROWS``/``VROWS`` bits: 16 = fp16 rows, else
    ``@krows<b>``/``@vrows<b>`` codes with their per-row fp16 scales (``sks``/``svs``/``xks``/``xvs``)."""
    fmt, t, st = layer.kv_format, layer.tables, layer.staging
    sk = layer.sink
    ks, vs = fmt.k_side, fmt.v_side
    d = layer.head_dim
    dummy = layer.k
    pick = lambda x: dummy if x is None else x  # noqa: E731
    has_rows = st is not None and st.num_slots > 0
    ptrs = [layer.k, layer.v, pick(layer.k_scale), pick(layer.k_zero), pick(layer.k_super), pick(layer.v_scale),
            pick(t.k_width), pick(t.k_offset), pick(t.v_levels), pick(t.cos), pick(t.sin), pick(t.hadamard),
            st.k if has_rows else dummy, st.v if has_rows and st.v is not None else dummy,
            st.block_map if st is not None else dummy]
    has_sink = sk is not None and sk.num_slots > 0
    ptrs += [sk.k if has_sink else dummy, sk.v if has_sink else dummy, sk.block_map if sk is not None else dummy]
    ptrs += [pick(st.k_scale) if has_rows else dummy, pick(st.v_scale) if has_rows else dummy,
             pick(sk.k_scale) if has_sink else dummy, pick(sk.v_scale) if has_sink else dummy]
    win = bool(fmt.sink or fmt.window)
    const = dict(RK=d if ks.exact else ks.row_bytes(d), RV=d if vs.exact else vs.row_bytes(d),
                 VBITS=vs.bits, VG=vs.group if not vs.exact else d, KFMT=ks.code, VFMT=vs.code,
                 COMPACT=ks.compact, PRE=ks.pre_rope, ROT=vs.rotate, WIN=win,
                 STAGED=(st is not None and not win and ks.code != CODE_PLAIN), HAS_SINK=sk is not None,
                 KROWS=fmt.k_rows, VROWS=fmt.v_rows)
    return ptrs, const


def split_decode_triton(q: torch.Tensor, layer: KVCacheLayer, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        scale: float, num_splits: int | None = None) -> torch.Tensor:
    """Two-stage split-KV decode over a split layer (the merge is the common kernel)."""
    s, hq, d = q.shape
    h, bs = layer.num_kv_heads, layer.block_size
    group, gp, block_d, block_n, nsplit, per_split = decode_geometry(q, layer, block_tables, num_splits)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if s == 0:
        return out
    mid_o = torch.empty(s, hq, nsplit, block_d, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(s, hq, nsplit, dtype=torch.float32, device=q.device)
    lse = torch.empty(s, hq, dtype=torch.float32, device=q.device)
    ptrs, const = _args(layer)
    fmt = layer.kv_format
    split_decode_kernel[(s, h, nsplit)](
        q.contiguous(), *ptrs, block_tables, seq_lens, mid_o, mid_lse, scale, block_tables.stride(0), per_split,
        nsplit, fmt.sink, fmt.window, HQ=hq, H=h, D=d, BS=bs, GROUP=group, GP=gp, BLOCK_N=block_n,
        BLOCK_D=block_d, DOT=dot_code(q.dtype, q.device), **const)
    decode_merge_kernel[(s * hq,)](mid_o, mid_lse, out, lse, nsplit, D=d, SP=max(2, pow2(nsplit)), BLOCK_D=block_d)
    return out


def split_prefill_triton(q: torch.Tensor, layer: KVCacheLayer, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                         query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    """Prefill/extend over a split layer (one host sync for the longest query)."""
    t, hq, d = q.shape
    n = block_tables.shape[0]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if t == 0 or n == 0:
        return out
    h, bs = layer.num_kv_heads, layer.block_size
    group, gp, block_q, block_n, q_blocks = prefill_geometry(hq, h, query_start_loc)
    ptrs, const = _args(layer)
    fmt = layer.kv_format
    split_prefill_kernel[(n, h, q_blocks)](
        q.contiguous(), *ptrs, block_tables, seq_lens, query_start_loc, out, scale, block_tables.stride(0),
        fmt.sink, fmt.window, HQ=hq, H=h, D=d, BS=bs, GROUP=group, GP=gp, BLOCK_Q=block_q, BLOCK_N=block_n,
        BLOCK_D=max(16, pow2(d)), DOT=dot_code(q.dtype, q.device), **const)
    return out
