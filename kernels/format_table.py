"""The one KV-format table: names, kernel codes, storage, side tensors and bytes per token.

Both executors size the cache from this module: the engine through :func:`kernels.bytes_per_token`
(:mod:`kernels.formats` re-exports it) and the simulator through
``paged.sim.specs.ModelSpec.kv_bytes_per_token``. It imports neither torch nor triton, so the
simulator can read it without loading torch; storage dtypes are torch attribute names, resolved
only when :attr:`KVFormat.storage_dtype` is read.

Invariants:

- ``FORMATS[name].code`` is the constexpr the Triton kernels switch on; the ``CODE_*`` constants
  below are the only spelling of those integers (``triton_impl.common`` wraps them as
  ``tl.constexpr``).
- ``bytes_per_token`` is exactly what :func:`kernels.allocate_kv_cache` allocates per token and
  layer for K and V together (data plus per-token side tensors; int4_kivi's per-block K scales
  spread over the block, rounded up to whole bytes); fixed per-layer costs (fp8 per-head scales,
  int4_kivi's staging pool, the 4-byte block map) are not per token and are not counted.

Adding a format: a new ``CODE_*`` and ``FMT_*`` pair, a ``FORMATS`` row, its case in
:func:`bytes_per_token`, then the torch reference (``kernels.quant``/``kernels.reference``) and
the Triton branches keyed on ``FMT``; ``tests/test_kernels_format_table.py`` checks that the
allocator, the engine and the simulator agree on its bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import KVFormatError, ShapeError

__all__ = ["KVFormat", "FORMATS", "ALIASES", "DEFAULT_INT4_GROUP", "lookup", "format_for_dtype",
           "bytes_per_token", "int4_group", "CODE_PLAIN", "CODE_E4M3", "CODE_E5M2", "CODE_INT8", "CODE_INT4",
           "CODE_INT4_KIVI", "FP8_CODES", "INT4_CODES"]

# Kernel format codes (KVFormat.code). Plain ints here; constexpr copies in triton_impl/common.py.
CODE_PLAIN = 0       # fp16 / bf16 / fp32: the stored dtype is the value
CODE_E4M3 = 1        # float8_e4m3fn codes x per-head float32 scale
CODE_E5M2 = 2        # float8_e5m2 codes x per-head float32 scale
CODE_INT8 = 3        # int8 codes x per token-head fp16 scale
CODE_INT4 = 4        # packed int4 codes x per-group fp16 scale + zero
CODE_INT4_KIVI = 5   # V as int4; K int4 per channel over a block, unfilled blocks staged
FP8_CODES = (CODE_E4M3, CODE_E5M2)
INT4_CODES = (CODE_INT4, CODE_INT4_KIVI)

DEFAULT_INT4_GROUP = 32


def int4_group(head_dim: int, group_size: int | None = None) -> int:
    """The int4 group along head_dim: ``group_size``, or by default ``min(32, head_dim)``."""
    return min(DEFAULT_INT4_GROUP, head_dim) if group_size is None else group_size


@dataclass(frozen=True, slots=True)
class KVFormat:
    """Static description of one KV storage format.

    ``code`` is the integer the Triton kernels switch on (a constexpr); ``storage`` the torch
    dtype name of the data tensor (read :attr:`storage_dtype` for the dtype itself); ``scale`` is
    ``None`` (no side tensor), ``"head"`` (one float32 per KV head) or ``"token"`` (float16 side
    tensors in the block layout, one per token-head group).
    """

    name: str
    code: int
    storage: str
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

    @property
    def is_fp8(self) -> bool:
        return self.code in FP8_CODES

    @property
    def storage_dtype(self):
        """The torch dtype of the data tensor (imports torch)."""
        import torch
        return getattr(torch, self.storage)


FORMATS: dict[str, KVFormat] = {
    "fp16": KVFormat("fp16", CODE_PLAIN, "float16", None),
    "bf16": KVFormat("bf16", CODE_PLAIN, "bfloat16", None),
    "fp32": KVFormat("fp32", CODE_PLAIN, "float32", None, bits=32),
    "fp8_e4m3": KVFormat("fp8_e4m3", CODE_E4M3, "float8_e4m3fn", "head", max_value=448.0, bits=8),
    "fp8_e5m2": KVFormat("fp8_e5m2", CODE_E5M2, "float8_e5m2", "head", max_value=57344.0, bits=8),
    "int8": KVFormat("int8", CODE_INT8, "int8", "token", max_value=127.0, bits=8),
    "int4": KVFormat("int4", CODE_INT4, "uint8", "token", has_zero=True, max_value=15.0, bits=4),
    "int4_kivi": KVFormat("int4_kivi", CODE_INT4_KIVI, "uint8", "token", has_zero=True, max_value=15.0, bits=4,
                          k_per_channel=True),
}

ALIASES: dict[str, str] = {"kivi": "int4_kivi", "float16": "fp16", "half": "fp16", "bfloat16": "bf16",
                           "float32": "fp32", "fp8": "fp8_e4m3", "e4m3": "fp8_e4m3", "e5m2": "fp8_e5m2"}
_DTYPE_FORMATS = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float8_e4m3fn": "fp8_e4m3",
                  "float8_e5m2": "fp8_e5m2", "int8": "int8"}


def _dtype_name(dtype) -> str:
    """``torch.float16`` or ``"float16"`` -> ``"float16"``."""
    return str(dtype).removeprefix("torch.")


def lookup(name: str | KVFormat, dtype=None) -> KVFormat:
    """A format by name or alias; ``"auto"`` (or None) means the baseline format of ``dtype``
    (a torch dtype or its name; float16 when None)."""
    if isinstance(name, KVFormat):
        return name
    if name is None or name == "auto":
        return format_for_dtype("float16" if dtype is None else dtype)
    key = str(name).lower()
    key = ALIASES.get(key, key)
    if key not in FORMATS:
        raise KVFormatError(f"unknown kv_format {name!r}; use one of 'auto', {', '.join(map(repr, FORMATS))}")
    return FORMATS[key]


def format_for_dtype(dtype) -> KVFormat:
    """The format whose data tensor has ``dtype`` (uint8 is ambiguous and is refused)."""
    key = _dtype_name(dtype)
    if key not in _DTYPE_FORMATS:
        raise KVFormatError(f"cannot infer a KV format from dtype {dtype}; pass kv_format= explicitly "
                            f"(uint8 caches are 'int4')")
    return FORMATS[_DTYPE_FORMATS[key]]


def bytes_per_token(kv_format: str | KVFormat, num_kv_heads: int, head_dim: int, *, dtype=None,
                    group_size: int | None = None, block_size: int = 16) -> int:
    """Bytes one token occupies in one layer for K and V together, side tensors included.

    ``dtype`` only resolves ``"auto"``; ``group_size`` defaults to :func:`int4_group`. Per-head fp8 scales are per layer, not per token, and are
    not counted. ``int4_kivi`` reports the steady-state cost of full blocks: its per-channel K
    scale and zero (``4 * head_dim`` bytes per block-head) are spread over ``block_size`` tokens
    (rounded up to whole bytes per token); the staging pool for unfilled blocks is a fixed cost
    per layer, counted by ``KVCacheLayer.nbytes`` and not here.
    """
    fmt = lookup(kv_format, dtype)
    group_size = int4_group(head_dim, group_size)
    if fmt.packed and (group_size < 2 or group_size % 2 or head_dim % group_size):
        raise ShapeError(f"{fmt.name} groups of {group_size} values must be even and divide head_dim {head_dim}; "
                         f"pick a group_size that divides {head_dim}, or another kv format")
    if fmt.k_per_channel:
        v = head_dim // 2 + 2 * 2 * (head_dim // group_size)
        k_num = (head_dim // 2) * block_size + 2 * 2 * head_dim  # per block-head
        return num_kv_heads * v + -(-num_kv_heads * k_num // block_size)
    if fmt.packed:
        per_head = head_dim // 2 + 2 * 2 * (head_dim // group_size)  # codes + fp16 scale and zero
    elif fmt.scale == "token":
        per_head = head_dim + 2  # int8 codes + one fp16 scale
    else:
        per_head = head_dim * fmt.bits // 8
    return 2 * num_kv_heads * per_head
