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

**Split formats** store K and V in their own :class:`SideFormat` (``code == CODE_SPLIT``; the
kernels switch on each side's code). A name is ``K/V`` with optional ``@sinkS`` and ``@winW``
(:func:`parse_split`), each side one of::

    fp16 | bf16 | fp32                       exact (the model's values in that dtype)
    kivi<b>[+pre][+alloc][+q8]               keys only: per channel over each block (KIVI),
                                             b bits (mean bits per channel with +alloc: widths
                                             from a calibration artefact; a fractional mean such
                                             as kivi2.5 needs +alloc and whole bytes per row,
                                             b x head_dim a multiple of 8), keys stored before
                                             RoPE with +pre (RoPE applied on read), step and zero
                                             as 8- and 7-bit codes under two fp16 per-(block,
                                             head) scales with +q8 (else fp16 step and zero)
    cb<b>[_g<n>][+rot]                        per token: b-bit codes into a per-layer codebook
                                             (calibration artefact), one fp16 absmax scale per
                                             n values (64); +rot: a Hadamard rotation of
                                             head_dim (values: the output is rotated back)

``@sinkS``: the first S tokens of a sequence are read exactly (rows in a sink pool, one slot of S
rows per first block); ``@winW``: each query reads the keys and values of the W positions ending
at it exactly (rows in a staging pool of fp16 blocks). Both are a fixed cost per sequence, not
per token (:func:`staging_tokens_per_seq`). ``@krowsB``/``@vrowsB`` (B = 2..8, with a window): those
exact rows are B-bit codes with an fp16 scale per token-head (:func:`kernels.split_codec.row_quantize`).
``FRONT`` names the formats of the study's Pareto front (aliases ``kvq*``, measured at block size 32).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import KVFormatError, ShapeError

__all__ = ["KVFormat", "SideFormat", "FORMATS", "FRONT", "FRONT_BLOCK_SIZE", "ALIASES", "DEFAULT_INT4_GROUP",
           "lookup", "format_for_dtype", "bytes_per_token", "int4_group", "parse_split", "side_bytes",
           "staging_tokens_per_seq", "CODE_PLAIN", "CODE_E4M3", "CODE_E5M2", "CODE_INT8", "CODE_INT4",
           "CODE_INT4_KIVI", "CODE_KIVI", "CODE_CB", "CODE_SPLIT", "FP8_CODES", "INT4_CODES"]

# Kernel format codes (KVFormat.code). Plain ints here; constexpr copies in triton_impl/common.py.
CODE_PLAIN = 0       # fp16 / bf16 / fp32: the stored dtype is the value
CODE_E4M3 = 1        # float8_e4m3fn codes x per-head float32 scale
CODE_E5M2 = 2        # float8_e5m2 codes x per-head float32 scale
CODE_INT8 = 3        # int8 codes x per token-head fp16 scale
CODE_INT4 = 4        # packed int4 codes x per-group fp16 scale + zero
CODE_INT4_KIVI = 5   # V as int4; K int4 per channel over a block, unfilled blocks staged
CODE_KIVI = 6        # split side (K): per channel over a block, per-channel bit widths, staged until full
CODE_CB = 7          # split side: per-token codes into a per-layer codebook, fp16 absmax scale per group
CODE_SPLIT = 8       # a KVFormat whose K and V sides carry their own codes (KVFormat.k_side / v_side)
FP8_CODES = (CODE_E4M3, CODE_E5M2)
INT4_CODES = (CODE_INT4, CODE_INT4_KIVI)

DEFAULT_INT4_GROUP = 32


def int4_group(head_dim: int, group_size: int | None = None) -> int:
    """The int4 group along head_dim: ``group_size``, or by default ``min(32, head_dim)``."""
    return min(DEFAULT_INT4_GROUP, head_dim) if group_size is None else group_size


@dataclass(frozen=True, slots=True)
class SideFormat:
    """How one side (K or V) of a split format is stored; see the module docstring for names.

    ``code``: CODE_PLAIN (exact, ``storage`` dtype), CODE_KIVI or CODE_CB; ``bits``: code bits per
    value (the mean over channels with ``alloc``: an int, or a float only for a fractional KIVI
    mean, which ``alloc`` requires). ``group``: CB values per scale.
    """

    name: str
    code: int
    bits: int | float
    storage: str = "uint8"
    group: int = 64
    alloc: bool = False
    compact: bool = False
    pre_rope: bool = False
    rotate: bool = False

    @property
    def exact(self) -> bool:
        return self.code == CODE_PLAIN

    @property
    def calibrated(self) -> bool:
        """Whether the side needs per-layer tables from a calibration artefact (widths, codebook)."""
        return self.alloc or self.code == CODE_CB

    @property
    def storage_dtype(self):
        """The torch dtype of an exact side's data (imports torch)."""
        import torch
        return getattr(torch, self.storage)

    def row_bytes(self, head_dim: int) -> int:
        """Bytes of one token-head's data (codes packed along head_dim, or the exact values)."""
        return int(head_dim * self.bits) // 8


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
    k_side: SideFormat | None = None  # split formats (code CODE_SPLIT) only
    v_side: SideFormat | None = None
    sink: int = 0                # split: first tokens read exactly (from staging)
    window: int = 0              # split: each query reads its last `window` positions exactly
    k_rows: int = 16             # split: bits of the exact (sink and window) key rows: 16 fp16, else codes
    v_rows: int = 16             # split: the same for the exact value rows

    @property
    def split(self) -> bool:
        return self.code == CODE_SPLIT

    @property
    def staged(self) -> bool:
        """Whether layers of this format carry a staging pool (int4_kivi; split with KIVI keys,
        a sink or a window)."""
        return self.k_per_channel or (self.split and (self.k_side.code == CODE_KIVI or self.sink > 0
                                                       or self.window > 0))

    @property
    def calibrated(self) -> bool:
        """Whether a layer needs per-layer tables from a calibration artefact."""
        return self.split and (self.k_side.calibrated or self.v_side.calibrated)

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

_SPLIT_SIDE = re.compile(
    r"^(?:(fp16|bf16|fp32)|kivi(\d(?:\.\d+)?)((?:\+(?:pre|alloc|q8))*)|cb(\d)(?:_g(\d+))?((?:\+rot)?))$")
_SPLIT_HELP = ("a split KV format is 'K/V[@sinkS][@winW][@krowsB][@vrowsB]' with K one of fp16, bf16, fp32, "
               "kivi<b>[+pre][+alloc][+q8] and V one of fp16, bf16, fp32, cb<b>[_g<n>][+rot] (b = 2..8 bits; kivi's a mean such as 2.5 with "
               "+alloc), e.g. 'kivi4+pre+alloc+q8/cb4+rot@sink4@win32'")


def _side(text: str, which: str, whole: str) -> SideFormat:
    m = _SPLIT_SIDE.match(text)
    if not m:
        raise KVFormatError(f"unknown kv format {whole!r}: {which} side {text!r} is not a side format; {_SPLIT_HELP}")
    plain, kb, kflags, cb, grp, rot = m.groups()
    if plain:
        return SideFormat(plain, CODE_PLAIN, 32 if plain == "fp32" else 16,
                          {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}[plain])
    if kb is not None:
        flags = [f for f in kflags.split("+") if f]
        if which != "K":
            raise KVFormatError(f"kv format {whole!r}: kivi is a key format (per channel over a block); "
                                f"use cb<b>[+rot] or fp16 for values")
        if len(set(flags)) != len(flags):
            raise KVFormatError(f"kv format {whole!r}: a flag repeats in {text!r}")
        bits = float(kb)
        if not 2 <= bits <= 8:
            raise KVFormatError(f"kv format {whole!r}: kivi bits must be 2..8, got {kb}")
        if bits != int(bits) and "alloc" not in flags:
            raise KVFormatError(f"kv format {whole!r}: kivi{kb} is a mean over channels of whole-bit widths; "
                                f"add +alloc (the widths come from a calibration artefact), e.g. 'kivi{kb}+alloc'")
        bits = int(bits) if bits == int(bits) else bits
        order = "+".join(f for f in ("pre", "alloc", "q8") if f in flags)
        return SideFormat(f"kivi{bits:g}" + (f"+{order}" if order else ""), CODE_KIVI, bits, alloc="alloc" in flags,
                          compact="q8" in flags, pre_rope="pre" in flags)
    if which != "V":
        raise KVFormatError(f"kv format {whole!r}: cb (per-token codebook) is a value format here; use "
                            f"kivi<b>[+pre][+alloc][+q8] or fp16 for keys")
    bits, group = int(cb), int(grp) if grp else 64
    if not 2 <= bits <= 8:
        raise KVFormatError(f"kv format {whole!r}: cb bits must be 2..8, got {bits}")
    name = f"cb{bits}" + (f"_g{group}" if group != 64 else "") + ("+rot" if rot else "")
    return SideFormat(name, CODE_CB, bits, group=group, rotate=bool(rot))


def parse_split(name: str) -> KVFormat:
    """``'kivi3+pre+alloc+q8/cb3+rot@sink4@win32'`` -> a split :class:`KVFormat` (see the module
    docstring); a KVFormatError says which part is wrong."""
    text = str(name).strip().lower()
    body, *opts = text.split("@")
    opt = {"sink": 0, "win": 0, "krows": 16, "vrows": 16}
    for o in opts:
        m = re.fullmatch(r"(sink|win|krows|vrows)(\d+)", o)
        if not m:
            raise KVFormatError(f"unknown kv format {name!r}: option '@{o}' is not @sink<S>, @win<W>, @krows<b> or "
                                f"@vrows<b>; {_SPLIT_HELP}")
        opt[m.group(1)] = int(m.group(2))
    sink, window, k_rows, v_rows = opt["sink"], opt["win"], opt["krows"], opt["vrows"]
    for which, b in (("krows", k_rows), ("vrows", v_rows)):
        if b != 16 and not (2 <= b <= 8 and window):
            raise KVFormatError(f"kv format {name!r}: @{which}{b} keeps the rows a window reads exactly as 2..8-bit "
                                f"codes (fp16: leave @{which} out); it needs b in 2..8 and a window: add @win<W>")
    parts = body.split("/")
    if len(parts) != 2:
        raise KVFormatError(f"unknown kv format {name!r}; {_SPLIT_HELP}")
    k, v = _side(parts[0], "K", name), _side(parts[1], "V", name)
    if k.exact and v.exact and not (sink or window):
        raise KVFormatError(f"kv format {name!r} stores nothing quantized; use kv_cache_dtype={k.name!r}")
    canon = (f"{k.name}/{v.name}" + (f"@sink{sink}" if sink else "") + (f"@win{window}" if window else "")
             + (f"@krows{k_rows}" if k_rows != 16 else "") + (f"@vrows{v_rows}" if v_rows != 16 else ""))
    return KVFormat(canon, CODE_SPLIT, "uint8", "token", k_side=k, v_side=v, sink=sink, window=window, bits=0,
                    k_rows=k_rows, v_rows=v_rows)


# The Pareto front of the study's split formats (docs/quant.md, "The front"), measured at block_size 32
# with prefix caching off: kvqKV = KIVI keys at K bits, codebook values at V bits, 4 sink tokens, a
# 32-token window (3.91 bits per value for kvq3 at 2k context, staging included)
FRONT: dict[str, str] = {
    "kvq4": "kivi4+pre+alloc+q8/cb4+rot@sink4@win32",
    "kvq34": "kivi3+pre+alloc+q8/cb4+rot@sink4@win32",
    "kvq3": "kivi3+pre+alloc+q8/cb3+rot@sink4@win32",
    "kvq32": "kivi3+pre+alloc+q8/cb2+rot@sink4@win32",
    "kvq2": "kivi2+pre+alloc+q8/cb2+rot@sink4@win32",
    # <= 3.0 bits (2.99 at 2k context): window and sink rows as 8-bit K / 6-bit V codes (docs/quant.md)
    "kvq25": "kivi2.5+pre+alloc+q8/cb2+rot@sink4@win64@krows8@vrows6",
}
FRONT_BLOCK_SIZE = 32

ALIASES: dict[str, str] = {**FRONT,"kivi": "int4_kivi", "float16": "fp16", "half": "fp16", "bfloat16": "bf16",
                           "float32": "fp32", "fp8": "fp8_e4m3", "e4m3": "fp8_e4m3", "e5m2": "fp8_e5m2"}
_DTYPE_FORMATS = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float8_e4m3fn": "fp8_e4m3",
                  "float8_e5m2": "fp8_e5m2", "int8": "int8"}


def lookup(name: str | KVFormat, dtype=None) -> KVFormat:
    """A format by name or alias; ``"auto"`` (or None) means the baseline format of ``dtype``
    (a torch dtype or its name; float16 when None); ``K/V[@...]`` names a split format."""
    if isinstance(name, KVFormat):
        return name
    if name is None or name == "auto":
        return format_for_dtype("float16" if dtype is None else dtype)
    key = str(name).strip().lower()
    key = ALIASES.get(key, key)
    if key in FORMATS:
        return FORMATS[key]
    if "/" in key or "@" in key:
        return parse_split(key)
    raise KVFormatError(f"unknown kv_format {name!r}; use one of 'auto', {', '.join(map(repr, FORMATS))}, "
                        f"or a split format: {_SPLIT_HELP}")


def format_for_dtype(dtype) -> KVFormat:
    """The format whose data tensor has ``dtype`` (uint8 is ambiguous and is refused)."""
    key = str(dtype).removeprefix("torch.")  # torch.float16 or "float16" -> "float16"
    if key not in _DTYPE_FORMATS:
        raise KVFormatError(f"cannot infer a KV format from dtype {dtype}; pass kv_format= explicitly "
                            f"(uint8 caches are 'int4')")
    return FORMATS[_DTYPE_FORMATS[key]]


def bytes_per_token(kv_format: str | KVFormat, num_kv_heads: int, head_dim: int, *, dtype=None,
                    group_size: int | None = None, block_size: int = 16) -> int:
    """Bytes one token occupies in one layer for K and V together, side tensors included.

    ``dtype`` only resolves ``"auto"``; ``group_size`` defaults to :func:`int4_group`. Split formats: see
    :func:`split_bytes_per_token`. Per-head fp8 scales are per layer, not per token, and are
    not counted. ``int4_kivi`` reports the steady-state cost of full blocks: its per-channel K
    scale and zero (``4 * head_dim`` bytes per block-head) are spread over ``block_size`` tokens
    (rounded up to whole bytes per token); the staging pool for unfilled blocks is a fixed cost
    per layer, counted by ``KVCacheLayer.nbytes`` and not here.
    """
    fmt = lookup(kv_format, dtype)
    if fmt.split:
        return split_bytes_per_token(fmt, num_kv_heads, head_dim, block_size)
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


def check_split(fmt: KVFormat, head_dim: int, block_size: int) -> None:
    """ShapeError unless a split format fits this cache geometry (groups divide head_dim, codes
    fill whole bytes, a window is at least one block, the sink fits in the first block)."""
    for side in (fmt.k_side, fmt.v_side):
        if side.code == CODE_CB and (head_dim % side.group or side.group < 2):
            raise ShapeError(f"kv format {fmt.name!r}: {side.name} groups of {side.group} values must divide head_dim "
                             f"{head_dim}; use one of {[g for g in (8, 16, 32, 64, 128) if head_dim % g == 0]}")
        if not side.exact and (head_dim * side.bits) % 8:
            fix = ("use a head_dim that is a multiple of 8" if side.bits == int(side.bits) else
                   f"use a mean that is a multiple of {8 / head_dim:g} bits for head_dim {head_dim}")
            raise ShapeError(f"kv format {fmt.name!r}: {side.bits:g}-bit codes of head_dim {head_dim} do not fill "
                             f"whole bytes ({head_dim * side.bits:g} bits per row); {fix}")
        if side.rotate and head_dim & (head_dim - 1):
            raise ShapeError(f"kv format {fmt.name!r}: +rot needs a power-of-two head_dim, got {head_dim}")
    if fmt.sink and not fmt.window:
        raise ShapeError(f"kv format {fmt.name!r}: a sink is read exactly beside a window; add @win<W>, e.g. @win32")
    if fmt.window and fmt.window < block_size:
        raise ShapeError(f"kv format {fmt.name!r}: the window ({fmt.window}) must be at least one block "
                         f"({block_size} tokens); use @win{block_size} or a smaller block_size")
    if any(b != 16 and head_dim * b % 8 for b in (fmt.k_rows, fmt.v_rows)):
        raise ShapeError(f"kv format {fmt.name!r}: @krows/@vrows codes of head_dim {head_dim} do not fill whole "
                         f"bytes; use 8 bits or a head_dim that is a multiple of 8")
    if fmt.sink > block_size:
        raise ShapeError(f"kv format {fmt.name!r}: the sink ({fmt.sink} tokens) must fit in the first block "
                         f"({block_size}); use @sink{block_size} or less, or a larger block_size")


def side_bytes(side: SideFormat, num_kv_heads: int, head_dim: int, block_size: int) -> tuple[int, int]:
    """``(bytes per token, bytes per block)`` of one side in one layer, side tensors included:
    CB: codes + an fp16 scale per group per token-head; KIVI: codes per token-head, and per
    block-head step and zero per channel (fp16 each, or a uint8 step code + an int8 zero code with
    two fp16 super-scales)."""
    h, d = num_kv_heads, head_dim
    if side.exact:
        return h * d * side.bits // 8, 0
    if side.code == CODE_CB:
        return h * (side.row_bytes(d) + 2 * (d // side.group)), 0
    per_block = h * (2 * d + 4) if side.compact else h * 4 * d
    return h * side.row_bytes(d), per_block


def split_bytes_per_token(fmt: KVFormat, num_kv_heads: int, head_dim: int, block_size: int) -> int:
    """Steady-state bytes per token of a split format: per-token bytes plus per-block bytes spread
    over the block (rounded up to whole bytes per token); the staging pool is not counted."""
    check_split(fmt, head_dim, block_size)
    (tk, bk), (tv, bv) = (side_bytes(s, num_kv_heads, head_dim, block_size) for s in (fmt.k_side, fmt.v_side))
    return tk + tv + -(-(bk + bv) // block_size)


def staging_tokens_per_seq(fmt: str | KVFormat, block_size: int) -> int:
    """Token rows one running sequence holds in steady state in its layer's staging and sink
    pools: the blocks a window overlaps (``ceil(window / block) + 1``; KIVI keys alone: the one
    unfilled block) and the sink tokens. Each row holds K and V (split formats with a sink or
    window), else K."""
    f = lookup(fmt)
    if not f.staged:
        return 0
    blocks = (-(-f.window // block_size) + 1) if f.window else 1
    return blocks * block_size + f.sink
