"""KV-cache storage formats: names, storage dtypes, side tensors and bytes per token.

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

from dataclasses import dataclass

import torch

from .errors import KVFormatError

__all__ = ["KVFormat", "FORMATS", "get_format", "format_for_dtype", "bytes_per_token"]

DEFAULT_INT4_GROUP = 32


@dataclass(frozen=True, slots=True)
class KVFormat:
    """Static description of one KV storage format.

    ``code`` is the integer the Triton kernels switch on (a constexpr); ``scale`` is one of
    ``None`` (no side tensor), ``"head"`` (one float32 per KV head) or ``"token"`` (float16 side
    tensors in the block layout, one per token-head group).
    """

    name: str
    code: int
    storage_dtype: torch.dtype | None  # None: the model dtype (baseline formats)
    scale: str | None
    has_zero: bool = False
    max_value: float | None = None  # largest finite code value (fp8) / code (int)
    bits: int = 16
    k_per_channel: bool = False  # int4_kivi: K scales per (block, head, channel), staging pool

    @property
    def quantized(self) -> bool:
        return self.scale is not None

    @property
    def packed(self) -> bool:
        return self.bits == 4


FORMATS: dict[str, KVFormat] = {
    "fp16": KVFormat("fp16", 0, torch.float16, None),
    "bf16": KVFormat("bf16", 0, torch.bfloat16, None),
    "fp32": KVFormat("fp32", 0, torch.float32, None, bits=32),
    "fp8_e4m3": KVFormat("fp8_e4m3", 1, torch.float8_e4m3fn, "head", max_value=448.0, bits=8),
    "fp8_e5m2": KVFormat("fp8_e5m2", 2, torch.float8_e5m2, "head", max_value=57344.0, bits=8),
    "int8": KVFormat("int8", 3, torch.int8, "token", max_value=127.0, bits=8),
    "int4": KVFormat("int4", 4, torch.uint8, "token", has_zero=True, max_value=15.0, bits=4),
    "int4_kivi": KVFormat("int4_kivi", 5, torch.uint8, "token", has_zero=True, max_value=15.0, bits=4,
                          k_per_channel=True),
}

_ALIASES = {"kivi": "int4_kivi", "float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32",
            "fp8": "fp8_e4m3", "e4m3": "fp8_e4m3", "e5m2": "fp8_e5m2"}
_DTYPE_FORMATS = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
                  torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2",
                  torch.int8: "int8"}


def get_format(name: str | KVFormat, dtype: torch.dtype | None = None) -> KVFormat:
    """Look a format up by name; ``"auto"`` (or None) means the baseline format of ``dtype``."""
    if isinstance(name, KVFormat):
        return name
    if name is None or name == "auto":
        return format_for_dtype(dtype if dtype is not None else torch.float16)
    key = _ALIASES.get(str(name).lower(), str(name).lower())
    if key not in FORMATS:
        raise KVFormatError(f"unknown kv_format {name!r}; use one of 'auto', {', '.join(map(repr, FORMATS))}")
    return FORMATS[key]


def format_for_dtype(dtype: torch.dtype) -> KVFormat:
    """The format whose data tensor has ``dtype`` (uint8 is ambiguous and is refused)."""
    if dtype not in _DTYPE_FORMATS:
        raise KVFormatError(f"cannot infer a KV format from dtype {dtype}; pass kv_format= explicitly "
                            f"(uint8 caches are 'int4')")
    return FORMATS[_DTYPE_FORMATS[dtype]]


def bytes_per_token(kv_format: str | KVFormat, num_kv_heads: int, head_dim: int, *,
                    dtype: torch.dtype = torch.float16, group_size: int = DEFAULT_INT4_GROUP,
                    block_size: int = 16) -> int:
    """Bytes one token occupies in one layer for K and V together, side tensors included.

    Per-head fp8 scales are per layer, not per token, and are not counted. ``int4_kivi`` reports
    the steady-state cost of full blocks: its per-channel K scale and zero (``4 * head_dim``
    bytes per block-head) are spread over ``block_size`` tokens (rounded up to whole bytes per
    token); the staging pool for unfilled blocks is a fixed cost per layer, counted by
    :meth:`KVCacheLayer.nbytes` and not here.
    """
    fmt = get_format(kv_format, dtype)
    if fmt.k_per_channel:
        v = head_dim // 2 + 2 * 2 * (head_dim // group_size)
        k_num = (head_dim // 2) * block_size + 2 * 2 * head_dim  # per block-head
        return num_kv_heads * v + -(-num_kv_heads * k_num // block_size)
    if fmt.bits == 4:
        per_head = head_dim // 2 + 2 * 2 * (head_dim // group_size)  # codes + fp16 scale and zero
    elif fmt.scale == "token":
        per_head = head_dim + 2  # int8 codes + one fp16 scale
    else:
        per_head = head_dim * fmt.bits // 8
    return 2 * num_kv_heads * per_head
