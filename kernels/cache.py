"""``KVCacheLayer``: one layer's paged K/V cache with its format's side tensors.

Layout (the contract with ``paged/``): ``k`` and ``v`` are ``[num_blocks, block_size,
num_kv_heads, head_dim]`` (``head_dim // 2`` bytes for packed int4); token slot
``= block_id * block_size + offset``. Per-token side tensors (int8/int4 scales, int4 zeros) share
the leading ``[num_blocks, block_size, num_kv_heads]`` layout; fp8 scales are float32
``[num_kv_heads]``. ``int4_kivi`` K scales/zeros are per block ``[num_blocks, num_kv_heads,
head_dim]`` and the layer carries a staging pool for blocks that are not full (see
:mod:`kernels.kivi_cache`). Split formats (K and V in their own side formats) are laid out as
:mod:`kernels.split` says and carry their per-layer constants in ``tables``. All tensors are
contiguous and on one device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .errors import KVFormatError, ShapeError
from .format_table import int4_group
from .formats import KVFormat, get_format

if TYPE_CHECKING:
    from .split_codec import SplitTables
from .quant import as_head_scale
from .staging import StagingPool, default_num_staging_blocks

__all__ = ["KVCacheLayer", "allocate_kv_cache", "as_layer"]


@dataclass(slots=True)
class KVCacheLayer:
    """One layer's K and V cache in one :class:`~kernels.formats.KVFormat`.

    ``dtype`` is the compute (model) dtype: what dequantized values and attention outputs use
    when nothing else says so (and ``int4_kivi``'s staging dtype). Build it with
    :func:`allocate_kv_cache` or :func:`as_layer`. ``staging`` is the ``int4_kivi`` pool of
    unfilled blocks' K (None for the other formats).
    """

    k: torch.Tensor
    v: torch.Tensor
    kv_format: KVFormat
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    k_zero: torch.Tensor | None = None
    v_zero: torch.Tensor | None = None
    dtype: torch.dtype = torch.float16
    staging: StagingPool | None = None  # int4_kivi, and split formats with KIVI keys, a sink or a window
    k_super: torch.Tensor | None = None  # split kivi+q8 keys: fp16 [num_blocks, H, 2] super-scales
    tables: "SplitTables | None" = None  # split formats: per-layer constants (widths, codebook, RoPE, H)
    split_head_dim: int = 0              # split formats: head_dim (their data rows are packed bytes)
    sink: StagingPool | None = None      # split formats with @sinkS: fp16 K/V of each first block's S tokens

    @property
    def num_blocks(self) -> int:
        return self.k.shape[0]

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.split_head_dim or self.k.shape[3] * (2 if self.kv_format.packed else 1)

    @property
    def group_size(self) -> int:
        """Values per int4 scale group (head_dim for the other formats)."""
        return self.head_dim // self.v_scale.shape[-1] if self.kv_format.packed else self.head_dim

    @property
    def device(self) -> torch.device:
        return self.k.device

    def block_tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by block id (data and per-token side tensors), for copy and swap."""
        out = [self.k, self.v]
        if self.kv_format.split:
            return out + [t for t in (self.k_scale, self.k_zero, self.k_super, self.v_scale) if t is not None]
        if self.kv_format.scale == "token":
            out += [self.k_scale, self.v_scale]
        if self.kv_format.has_zero:
            out += [self.k_zero, self.v_zero]
        return out

    def nbytes(self) -> int:
        """Bytes held by this layer, side tensors and the int4_kivi staging pool included."""
        ts = [self.k, self.v, self.k_scale, self.v_scale, self.k_zero, self.v_zero, self.k_super]
        extra = sum(p.nbytes() for p in (self.staging, self.sink) if p is not None)
        return sum(t.numel() * t.element_size() for t in ts if t is not None) + extra


def allocate_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      kv_format: str | KVFormat = "auto", *, dtype: torch.dtype = torch.float16,
                      device: torch.device | str = "cpu", group_size: int | None = None,
                      k_scale: torch.Tensor | float | None = None,
                      v_scale: torch.Tensor | float | None = None,
                      num_staging_blocks: int | None = None, grow_staging: bool = False,
                      tables: "SplitTables | None" = None) -> KVCacheLayer:
    """Allocate one zero-filled layer. ``kv_format="auto"`` stores ``dtype`` itself.

    fp8 scales default to 1.0 per head (set ``layer.k_scale[:]`` after calibration);
    ``group_size`` is the int4 group along head_dim (V's group for ``int4_kivi``; default
    ``min(32, head_dim)``, as :func:`kernels.bytes_per_token` assumes).
    ``num_staging_blocks`` (``int4_kivi`` only; default ``min(num_blocks, 256)``) is the number
    of blocks that may be unfilled at once (their K is kept in ``dtype``); with ``grow_staging``
    it is only the initial size, and the pool grows when more blocks are unfilled at once.
    Split formats (:mod:`kernels.split`) take their per-layer constants in ``tables`` (default:
    :func:`default_tables`, uncalibrated: uniform widths, a Gaussian codebook, plain RoPE); their
    staging holds fp16 rows and is sized like ``int4_kivi``'s.
    """
    fmt = get_format(kv_format, dtype)
    for name, val in (("num_blocks", num_blocks), ("block_size", block_size),
                      ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if int(val) < 1:
            raise ShapeError(f"{name} must be >= 1, got {val}")
    if fmt.split:
        return _allocate_split(fmt, num_blocks, block_size, num_kv_heads, head_dim, dtype, torch.device(device),
                               num_staging_blocks, grow_staging, tables)
    group_size = int4_group(int(head_dim), group_size)
    if fmt.packed and (head_dim % group_size or group_size % 2):
        raise ShapeError(f"int4 group_size {group_size} must be even and divide head_dim {head_dim}")
    device = torch.device(device)
    lead = (num_blocks, block_size, num_kv_heads)
    width = head_dim // 2 if fmt.packed else head_dim
    new = lambda shape, dt: torch.zeros(shape, dtype=dt, device=device)  # noqa: E731
    layer = KVCacheLayer(new(lead + (width,), fmt.storage_dtype), new(lead + (width,), fmt.storage_dtype),
                         fmt, dtype=dtype)
    if (num_staging_blocks is not None or grow_staging) and not fmt.staged:
        raise KVFormatError(f"num_staging_blocks is an int4_kivi setting; kv_format {fmt.name!r} has no staging")
    if fmt.k_per_channel:
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise KVFormatError(f"int4_kivi stages unfilled blocks in the model dtype; pass dtype=float16, "
                                f"bfloat16 or float32, got {dtype}")
        groups = head_dim // group_size
        layer.v_scale, layer.v_zero = new(lead + (groups,), torch.float16), new(lead + (groups,), torch.float16)
        per_block = (num_blocks, num_kv_heads, head_dim)
        layer.k_scale, layer.k_zero = new(per_block, torch.float16), new(per_block, torch.float16)
        n = default_num_staging_blocks(num_blocks) if num_staging_blocks is None else num_staging_blocks
        layer.staging = StagingPool(num_blocks, n, block_size, num_kv_heads, head_dim, dtype, device,
                                    growable=grow_staging)
    elif fmt.scale == "head":
        layer.k_scale = as_head_scale(k_scale, num_kv_heads, device).clone()
        layer.v_scale = as_head_scale(v_scale, num_kv_heads, device).clone()
    elif fmt.scale == "token":
        groups = head_dim // group_size if fmt.packed else 1
        layer.k_scale, layer.v_scale = new(lead + (groups,), torch.float16), new(lead + (groups,), torch.float16)
        if fmt.has_zero:
            layer.k_zero, layer.v_zero = new(lead + (groups,), torch.float16), new(lead + (groups,), torch.float16)
    return layer


def as_layer(k_cache: torch.Tensor | KVCacheLayer, v_cache: torch.Tensor | None, *,
             kv_format: str | KVFormat | None = None, k_scale=None, v_scale=None, k_zero=None, v_zero=None,
             dtype: torch.dtype | None = None) -> KVCacheLayer:
    """Wrap loose cache tensors (or pass a layer through) and check that they fit together."""
    if isinstance(k_cache, KVCacheLayer):
        if v_cache is not None or any(x is not None for x in (kv_format, k_scale, v_scale, k_zero, v_zero)):
            raise ShapeError("when k_cache is a KVCacheLayer, pass v_cache=None and no kv_format/scales: "
                             "the layer carries them")
        layer = k_cache
    elif kv_format is not None and get_format(kv_format).k_per_channel:
        raise KVFormatError("int4_kivi caches carry a staging pool: allocate them with "
                            "kernels.allocate_kv_cache(..., kv_format='int4_kivi') and pass the layer")
    else:
        if not isinstance(k_cache, torch.Tensor) or not isinstance(v_cache, torch.Tensor):
            raise ShapeError("pass k_cache and v_cache as tensors, or a KVCacheLayer as k_cache with v_cache=None")
        if kv_format is None:
            fmt = get_format("int4") if (k_cache.dtype == torch.uint8 and k_zero is not None) \
                else get_format("auto", k_cache.dtype)
        else:
            fmt = get_format(kv_format, k_cache.dtype)
        if fmt.scale == "head":
            k_scale = as_head_scale(k_scale, k_cache.shape[2] if k_cache.dim() == 4 else 1, k_cache.device)
            v_scale = as_head_scale(v_scale, k_cache.shape[2] if k_cache.dim() == 4 else 1, k_cache.device)
        layer = KVCacheLayer(k_cache, v_cache, fmt, k_scale, v_scale, k_zero, v_zero,
                             dtype or (k_cache.dtype if not fmt.quantized else torch.float16))
    check_layer(layer)
    return layer


def check_layer(layer: KVCacheLayer) -> None:
    """Raise :class:`ShapeError`/:class:`KVFormatError` unless the layer's tensors fit its format."""
    fmt, k, v = layer.kv_format, layer.k, layer.v
    if k.dim() != 4:
        raise ShapeError(f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(k.shape)}")
    if not fmt.split and (v.shape != k.shape or v.dtype != k.dtype or v.device != k.device):
        raise ShapeError(f"v_cache {tuple(v.shape)} {v.dtype} must match k_cache {tuple(k.shape)} {k.dtype}")
    if not fmt.split and k.dtype != fmt.storage_dtype:
        raise KVFormatError(f"kv_format {fmt.name!r} stores {fmt.storage_dtype}, but the cache is {k.dtype}; "
                            f"allocate it with kernels.allocate_kv_cache(..., kv_format={fmt.name!r})")
    if not (k.is_contiguous() and v.is_contiguous()):
        raise ShapeError("k_cache and v_cache must be contiguous (kernels index them by slot)")
    lead = tuple(k.shape[:3])
    if fmt.k_per_channel:
        _check_kivi(layer)
        return
    if fmt.split:
        _check_split(layer)
        return
    if fmt.scale == "head":
        for n, s in (("k_scale", layer.k_scale), ("v_scale", layer.v_scale)):
            if s is None or s.shape != (k.shape[2],) or s.dtype != torch.float32 or s.device != k.device:
                raise ShapeError(f"{fmt.name} needs {n} as float32 [{k.shape[2]}] on {k.device}")
    elif fmt.scale == "token":
        groups = 1
        if fmt.packed:
            groups = layer.k_scale.shape[-1] if layer.k_scale is not None else 0
            if groups < 1 or (2 * k.shape[3]) % groups or ((2 * k.shape[3]) // groups) % 2:
                raise ShapeError(f"int4 scale last dim {groups} must divide head_dim {2 * k.shape[3]} into even groups")
        names = ("k_scale", "v_scale", "k_zero", "v_zero") if fmt.has_zero else ("k_scale", "v_scale")
        for n in names:
            s = getattr(layer, n)
            if s is None or tuple(s.shape) != lead + (groups,) or s.dtype != torch.float16 \
                    or s.device != k.device or not s.is_contiguous():
                got = None if s is None else (tuple(s.shape), s.dtype)
                raise ShapeError(f"{fmt.name} needs {n} as contiguous float16 {lead + (groups,)}, got {got}")
    elif any(x is not None for x in (layer.k_scale, layer.v_scale, layer.k_zero, layer.v_zero)):
        raise KVFormatError(f"kv_format {fmt.name!r} takes no scales or zero points")


def _check_kivi(layer: KVCacheLayer) -> None:
    """int4_kivi: V side tensors as int4, K's per block ``[NB, H, D]``, a staging pool that fits."""
    k = layer.k
    nb, bs, h, w = k.shape
    d = 2 * w
    vs = layer.v_scale
    groups = vs.shape[-1] if vs is not None and vs.dim() == 4 else 0
    if groups < 1 or d % groups or (d // groups) % 2:
        raise ShapeError(f"int4_kivi v_scale last dim {groups} must divide head_dim {d} into even groups")
    want = {"v_scale": (nb, bs, h, groups), "v_zero": (nb, bs, h, groups), "k_scale": (nb, h, d), "k_zero": (nb, h, d)}
    for n, shape in want.items():
        s = getattr(layer, n)
        if s is None or tuple(s.shape) != shape or s.dtype != torch.float16 or s.device != k.device \
                or not s.is_contiguous():
            got = None if s is None else (tuple(s.shape), s.dtype)
            raise ShapeError(f"int4_kivi needs {n} as contiguous float16 {shape}, got {got}")
    st = layer.staging
    if st is None or tuple(st.k.shape[1:]) != (bs, h, d) or st.k.dtype != layer.dtype or st.k.device != k.device \
            or tuple(st.block_map.shape) != (nb,) or not st.k.is_contiguous():
        raise ShapeError(f"int4_kivi needs a staging pool of {layer.dtype} [slots, {bs}, {h}, {d}] on {k.device} "
                         f"(allocate the layer with kernels.allocate_kv_cache)")


def default_tables(fmt: KVFormat, num_kv_heads: int, head_dim: int, device: torch.device | str = "cpu", *,
                   k_width: torch.Tensor | None = None, v_levels: torch.Tensor | None = None,
                   rope: tuple[torch.Tensor, torch.Tensor] | None = None, max_positions: int = 4096) -> "SplitTables":
    """Per-layer constants of a split layer: ``k_width`` (default uniform), ``v_levels`` (default
    the Lloyd-Max levels of a Gaussian vector over its absmax), ``rope`` = the model's ``(cos,
    signed sin)`` rows (default plain RoPE over ``max_positions``)."""
    from .split_codec import SplitTables, bit_layout, hadamard, normal_levels, rope_tables, uniform_widths
    t = SplitTables()
    ks, vs = fmt.k_side, fmt.v_side
    if not ks.exact:
        w = uniform_widths(num_kv_heads, head_dim, ks.bits) if k_width is None else k_width.to(torch.int32)
        if tuple(w.shape) != (num_kv_heads, head_dim):
            raise ShapeError(f"kivi channel widths must be [{num_kv_heads}, {head_dim}], got {tuple(w.shape)}")
        t.k_width = w
        t.k_offset, t.k_row_bytes = bit_layout(w, ks.bits)
        if ks.pre_rope:
            t.cos, t.sin = rope if rope is not None else rope_tables(head_dim, max_positions)
    if not vs.exact:
        lv = normal_levels(vs.bits, vs.group) if v_levels is None else v_levels.float()
        if lv.shape != (1 << vs.bits,) or bool((lv[1:] <= lv[:-1]).any()):
            raise KVFormatError(f"{vs.name} needs {1 << vs.bits} increasing codebook levels, got {tuple(lv.shape)}")
        t.v_levels = lv
        if vs.rotate:
            t.hadamard = hadamard(head_dim)
    return t.to(torch.device(device))


def _allocate_split(fmt: KVFormat, nb: int, bs: int, h: int, d: int, dtype: torch.dtype, device: torch.device,
                    num_staging_blocks: int | None, grow_staging: bool, tables) -> KVCacheLayer:
    from .format_table import check_split
    from .split_codec import STAGING_DTYPE
    check_split(fmt, d, bs)
    t = default_tables(fmt, h, d, device) if tables is None else tables.to(device)
    ks, vs = fmt.k_side, fmt.v_side
    new = lambda shape, dt: torch.zeros(shape, dtype=dt, device=device)  # noqa: E731
    lead = (nb, bs, h)
    k = new(lead + (d,), ks.storage_dtype) if ks.exact else new(lead + (ks.row_bytes(d),), torch.uint8)
    v = new(lead + (d,), vs.storage_dtype) if vs.exact else new(lead + (vs.row_bytes(d),), torch.uint8)
    layer = KVCacheLayer(k, v, fmt, dtype=dtype, tables=t, split_head_dim=d)
    if not ks.exact:
        if ks.compact:
            layer.k_scale, layer.k_zero = new((nb, h, d), torch.uint8), new((nb, h, d), torch.int8)
            layer.k_super = new((nb, h, 2), torch.float16)
        else:
            layer.k_scale, layer.k_zero = new((nb, h, d), torch.float16), new((nb, h, d), torch.float16)
    if not vs.exact:
        layer.v_scale = new(lead + (d // vs.group,), torch.float16)
    if (num_staging_blocks is not None or grow_staging) and not fmt.staged:
        raise KVFormatError(f"num_staging_blocks is a setting of staged formats; kv_format {fmt.name!r} has no staging")
    if fmt.staged:
        n = default_num_staging_blocks(nb) if num_staging_blocks is None else num_staging_blocks
        rows = dict(k_bits=fmt.k_rows, v_bits=fmt.v_rows)
        layer.staging = StagingPool(nb, n, bs, h, d, STAGING_DTYPE, device, growable=grow_staging,
                                    values=bool(fmt.sink or fmt.window), **rows)
        if fmt.sink:  # one slot of S rows per first block (about one per sequence)
            layer.sink = StagingPool(nb, n, fmt.sink, h, d, STAGING_DTYPE, device, growable=grow_staging,
                                     values=True, **rows)
    check_layer(layer)
    return layer


def _check_split(layer: KVCacheLayer) -> None:
    """Split formats: data and side tensors of each side, tables that fit, a staging pool if staged."""
    fmt, k, v, d = layer.kv_format, layer.k, layer.v, layer.head_dim
    nb, bs, h = k.shape[:3]
    t = layer.tables
    if t is None:
        raise ShapeError(f"kv format {fmt.name!r} needs its per-layer tables (allocate the layer with "
                         "kernels.allocate_kv_cache)")
    for name, x, side in (("k_cache", k, fmt.k_side), ("v_cache", v, fmt.v_side)):
        want = (nb, bs, h, d if side.exact else side.row_bytes(d))
        dt = side.storage_dtype if side.exact else torch.uint8
        if tuple(x.shape) != want or x.dtype != dt or x.device != k.device or not x.is_contiguous():
            raise ShapeError(f"{fmt.name}: {name} must be contiguous {dt} {want}, got {x.dtype} {tuple(x.shape)}")
    if not fmt.k_side.exact:
        sd = (torch.uint8, torch.int8) if fmt.k_side.compact else (torch.float16, torch.float16)
        for n_, x, dt in (("k_scale", layer.k_scale, sd[0]), ("k_zero", layer.k_zero, sd[1])):
            if x is None or tuple(x.shape) != (nb, h, d) or x.dtype != dt or x.device != k.device:
                raise ShapeError(f"{fmt.name} needs {n_} as {dt} [{nb}, {h}, {d}]")
        if fmt.k_side.compact and (layer.k_super is None or tuple(layer.k_super.shape) != (nb, h, 2)):
            raise ShapeError(f"{fmt.name} needs k_super as float16 [{nb}, {h}, 2]")
        if t.k_width is None or tuple(t.k_width.shape) != (h, d):
            raise ShapeError(f"{fmt.name} needs kivi channel widths [{h}, {d}] in its tables")
    if not fmt.v_side.exact:
        g = d // fmt.v_side.group
        vs = layer.v_scale
        if vs is None or tuple(vs.shape) != (nb, bs, h, g) or vs.dtype != torch.float16:
            raise ShapeError(f"{fmt.name} needs v_scale as float16 [{nb}, {bs}, {h}, {g}]")
        if t.v_levels is None or t.v_levels.shape != (1 << fmt.v_side.bits,):
            raise ShapeError(f"{fmt.name} needs a codebook of {1 << fmt.v_side.bits} levels in its tables")
    for pool in (layer.staging, layer.sink):  # every reader takes the pools' row codes from the format
        if pool is not None and (pool.k_bits, pool.v_bits) != (fmt.k_rows, fmt.v_rows):
            raise ShapeError(f"{fmt.name}: a staging pool keeps {pool.k_bits}/{pool.v_bits}-bit K/V rows, the "
                             f"format {fmt.k_rows}/{fmt.v_rows}; allocate the layer with kernels.allocate_kv_cache")
    if fmt.sink and (layer.sink is None or layer.sink.row_shape != (fmt.sink, h, d)):
        raise ShapeError(f"{fmt.name} needs a sink pool of [slots, {fmt.sink}, {h}, {d}] (allocate the layer with "
                         "kernels.allocate_kv_cache)")
    if fmt.staged and (layer.staging is None or layer.staging.row_shape != (bs, h, d)):
        raise ShapeError(f"{fmt.name} needs a staging pool of [slots, {bs}, {h}, {d}] (allocate the layer with "
                         "kernels.allocate_kv_cache)")
