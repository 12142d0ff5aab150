"""Host-side launchers: pick tile sizes and split counts, then run the Triton kernels.

Shared by the ``triton`` (CUDA) and ``interpreter`` (CPU) backends; the only difference is the
dot dtype (float32 in the interpreter, whose bf16 dot is wrong; the model's 16-bit dtype on GPUs).
"""

from __future__ import annotations

import math

import torch
import triton

from ..cache import KVCacheLayer
from ..errors import ShapeError
from .attention import decode_merge_kernel, decode_split_kernel, prefill_kernel
from .common import INTERPRETED
from .write import copy_blocks_kernel, write_kv_kernel

MIN_TOKENS_PER_SPLIT = 256  # below this a split's fixed cost dominates
MAX_SPLITS = 32


def pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1): Triton block shapes."""
    return 1 << max(0, (int(n) - 1).bit_length())


def dot_code(dtype: torch.dtype, device: torch.device) -> int:
    """How kernels cast ``tl.dot`` operands: 0 keep fp32 (interpreter, CPU, fp32), 1 fp16, 2 bf16."""
    if INTERPRETED or device.type != "cuda" or dtype == torch.float32:
        return 0
    return 2 if dtype == torch.bfloat16 else 1


def _side(layer: KVCacheLayer) -> tuple:
    """(k data, v data, k scale, v scale, k zero, v zero, k staging, staging map) with dummies for
    absent tensors."""
    k, v = layer.k, layer.v
    if layer.kv_format.is_fp8:
        k, v = k.view(torch.uint8), v.view(torch.uint8)
    dummy = k  # never read: the format's constexpr branch does not touch it
    st = layer.staging
    return (k, v, layer.k_scale if layer.k_scale is not None else dummy,
            layer.v_scale if layer.v_scale is not None else dummy,
            layer.k_zero if layer.k_zero is not None else dummy,
            layer.v_zero if layer.v_zero is not None else dummy,
            st.k if st is not None and st.num_slots else dummy,  # an empty pool is never read (map is -1)
            st.block_map if st is not None else dummy)


def _num_groups(layer: KVCacheLayer) -> int:
    return layer.v_scale.shape[-1] if layer.kv_format.packed else 1


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_len: int, device: torch.device) -> int:
    """Enough programs to fill the GPU (about 2 per SM), each with at least ``MIN_TOKENS_PER_SPLIT``."""
    by_len = max(1, math.ceil(max_len / MIN_TOKENS_PER_SPLIT))
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    by_occupancy = max(1, math.ceil(2 * sms / max(1, num_seqs * num_kv_heads)))
    return max(1, min(by_len, by_occupancy, MAX_SPLITS))


def decode_geometry(q: torch.Tensor, layer: KVCacheLayer, block_tables: torch.Tensor,
                    num_splits: int | None) -> tuple[int, int, int, int, int, int]:
    """A split-KV decode's launch shape: (query heads per KV head, its power-of-two padding,
    head_dim padding, keys per inner step, splits, keys per split). The split size comes from
    the block-table width (no host sync)."""
    s, hq, d = q.shape
    h = layer.num_kv_heads
    group = hq // h
    block_n = 16 if INTERPRETED else 64
    max_len = block_tables.shape[1] * layer.block_size
    if num_splits is not None and int(num_splits) < 1:
        raise ShapeError(f"num_splits must be >= 1 (or None to choose), got {num_splits}")
    nsplit = int(num_splits) if num_splits is not None else choose_num_splits(s, h, max_len, q.device)
    per_split = max(block_n, math.ceil(max(1, max_len) / nsplit / block_n) * block_n)
    return group, max(16, pow2(group)), max(16, pow2(d)), block_n, nsplit, per_split


def decode_triton(q: torch.Tensor, layer: KVCacheLayer, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  scale: float | None, num_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Two-stage split-KV decode. The split size comes from the block-table width (no host sync)."""
    s, hq, d = q.shape
    h, bs = layer.num_kv_heads, layer.block_size
    group, gp, block_d, block_n, nsplit, per_split = decode_geometry(q, layer, block_tables, num_splits)
    mid_o = torch.empty(s, hq, nsplit, block_d, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(s, hq, nsplit, dtype=torch.float32, device=q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous even when q is a view
    lse = torch.empty(s, hq, dtype=torch.float32, device=q.device)
    if s == 0:
        return out, lse
    sm_scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    qc = q.contiguous()
    decode_split_kernel[(s, h, nsplit)](
        qc, *_side(layer), block_tables, seq_lens, mid_o, mid_lse, sm_scale, block_tables.stride(0), per_split,
        nsplit, HQ=hq, H=h, D=d, NG=_num_groups(layer), BS=bs, GROUP=group, GP=gp, BLOCK_N=block_n,
        BLOCK_D=block_d, FMT=layer.kv_format.code, DOT=dot_code(q.dtype, q.device))
    decode_merge_kernel[(s * hq,)](mid_o, mid_lse, out, lse, nsplit, D=d, SP=max(2, pow2(nsplit)), BLOCK_D=block_d)
    return out, lse


def prefill_geometry(hq: int, h: int, query_start_loc: torch.Tensor) -> tuple[int, int, int, int, int]:
    """A prefill's launch shape: (query heads per KV head, its power-of-two padding, queries per
    program (at least 16 rows with the padding), keys per inner step, query blocks of the longest
    query). Reading the longest query is the launch's one host sync."""
    group = hq // h
    gp = pow2(group)
    block_q = max(1, (16 if INTERPRETED else 64) // gp)
    if block_q * gp < 16:
        block_q = 16 // gp
    max_q = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    return group, gp, block_q, 16 if INTERPRETED else 64, triton.cdiv(max_q, block_q)


def prefill_triton(q: torch.Tensor, layer: KVCacheLayer, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   query_start_loc: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Prefill/extend over a variable-length batch (one host sync for the longest query)."""
    t, hq, d = q.shape
    n = block_tables.shape[0]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous even when q is a view
    if t == 0 or n == 0:
        return out
    h, bs = layer.num_kv_heads, layer.block_size
    group, gp, block_q, block_n, q_blocks = prefill_geometry(hq, h, query_start_loc)
    sm_scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    prefill_kernel[(n, h, q_blocks)](
        q.contiguous(), *_side(layer), block_tables, seq_lens, query_start_loc, out, sm_scale,
        block_tables.stride(0), HQ=hq, H=h, D=d, NG=_num_groups(layer), BS=bs, GROUP=group, GP=gp,
        BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_D=max(16, pow2(d)), FMT=layer.kv_format.code,
        DOT=dot_code(q.dtype, q.device))
    return out


def write_kv_triton(layer: KVCacheLayer, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """One program per token-head; quantize-on-write for the quantized formats."""
    t, h, d = key.shape
    if t == 0:
        return
    ng = _num_groups(layer)
    side = list(_side(layer))[:6]
    bf16 = layer.k.dtype == torch.bfloat16
    if bf16:  # store RNE-rounded bits ourselves (the interpreter's bf16 cast truncates)
        side[0], side[1] = layer.k.view(torch.int16), layer.v.view(torch.int16)
    write_kv_kernel[(t, h)](key, value, slot_mapping, *side, H=h, D=d, NG=ng, NGP=pow2(ng),
                            HGP=pow2(max(1, d // ng // 2)), BLOCK_D=pow2(d), FMT=layer.kv_format.code, BF16=bf16)


def copy_blocks_triton(tensors: list[torch.Tensor], mapping: torch.Tensor) -> None:
    """Copy whole blocks of each tensor (viewed as 32-bit words when the block size allows)."""
    m = mapping.to(torch.int64).contiguous()
    for t in tensors:
        flat = t.view(torch.uint8).view(t.shape[0], -1)
        if flat.shape[1] % 4 == 0:
            flat = flat.view(torch.int32)
        row = flat.shape[1]
        block = min(1024, pow2(row))
        copy_blocks_kernel[(m.shape[0], triton.cdiv(row, block))](flat, m, ROW=row, BLOCK=block)
