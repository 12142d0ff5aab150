"""KV-cache storage formats: names, storage dtypes, side tensors and bytes per token.

The table itself lives in :mod:`kernels.format_table` (torch-free, shared with the simulator);
this module adds the torch-dtype side of the look-ups.

A format says how one token-head row of ``head_dim`` values is stored in a cache block:

========== ============================ ================================================
name       data (per token-head)         side tensors
========== ============================ ================================================
fp16/bf16/ ``head_dim`` values of that   none
fp32       dtype
fp8_e4m3   ``head_dim`` x float8_e4m3fn  scale ``[num_kv_heads]`` float32 (per head; a
fp8_e5m2   ``head_dim`` x float8_e5m2    per-tensor scale is the same value in every head)
int8       ``head_dim`` x int8           scale ``[..., num_kv_heads, 1]`` float16
           (symmetric, per token-head)
int4       ``head_dim // 2`` x uint8     scale and zero ``[..., num_kv_heads,
           (two codes per byte, element  head_dim // group_size]`` float16 (asymmetric,
           ``2j`` in the low nibble)     per token-head group along head_dim)
int4_kivi  V: as int4.                   V: as int4. K: scale and zero ``[num_blocks,
           K: ``head_dim // 2`` x uint8  num_kv_heads, head_dim]`` float16, per channel over
           (same packing)                the ``block_size`` tokens of a block; a block that is
                                         not full keeps its K in a staging pool of the model
                                         dtype (see :mod:`kernels.kivi_cache`)
========== ============================ ================================================

Invariant: dequantized value = code * scale (fp8, int8) or code * scale + zero (int4), computed in
float32. Per-token side tensors share the cache's block layout ``[num_blocks, block_size, ...]``
so that a block copy or swap moves a block's data and scales together.
"""

from __future__ import annotations

import torch

from . import format_table as _table
from .format_table import DEFAULT_INT4_GROUP, FORMATS, KVFormat, format_for_dtype

__all__ = ["KVFormat", "FORMATS", "get_format", "format_for_dtype", "bytes_per_token", "DEFAULT_INT4_GROUP"]


def get_format(name: str | KVFormat | None, dtype: torch.dtype | None = None) -> KVFormat:
    """Look a format up by name; ``"auto"`` (or None) means the baseline format of ``dtype``."""
    return _table.lookup(name, dtype)


def bytes_per_token(kv_format: str | KVFormat, num_kv_heads: int, head_dim: int, *,
                    dtype: torch.dtype = torch.float16, group_size: int | None = None,
                    block_size: int = 16) -> int:
    """Bytes one token occupies in one layer for K and V together (see
    :func:`kernels.format_table.bytes_per_token`, the one definition)."""
    return _table.bytes_per_token(kv_format, num_kv_heads, head_dim, dtype=dtype, group_size=group_size,
                                  block_size=block_size)
