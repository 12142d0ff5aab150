"""Block copy (copy-on-write) and swap between block pools, over every per-block tensor.

A block mapping is a sequence of ``(src, dst)`` block-id pairs (list, or an integer tensor
``[n, 2]``). Copies are simultaneous: all sources are read before any destination is written.
fp8 per-head scales belong to a layer, not to a block, and are not moved: a swap's source and
destination pools must share them. ``int4_kivi`` layers also carry each block's staging state
(see :mod:`kernels.kivi_cache`): pass them as :class:`KVCacheLayer` objects (not loose tensors)
so that a partial block's staged K moves with it; a staging pool too small for the mapping
raises :class:`~kernels.errors.StagingExhaustedError` before any block is copied.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from .cache import KVCacheLayer
from .errors import ShapeError

__all__ = ["copy_blocks", "swap_blocks", "block_tensors_of", "normalize_block_mapping"]

CacheLike = KVCacheLayer | torch.Tensor | Sequence[torch.Tensor]


def normalize_block_mapping(block_mapping, device: torch.device | None = None) -> torch.Tensor:
    """``(src, dst)`` pairs as an int64 tensor ``[n, 2]`` on ``device``."""
    m = torch.as_tensor(block_mapping, dtype=torch.long) if not isinstance(block_mapping, torch.Tensor) \
        else block_mapping.long()
    if m.numel() == 0:
        m = m.reshape(0, 2)
    if m.dim() != 2 or m.shape[1] != 2:
        raise ShapeError(f"block_mapping must be (src, dst) pairs, shape [n, 2]; got {tuple(m.shape)}")
    return m.to(device) if device is not None else m


def block_tensors_of(caches: CacheLike | Iterable[CacheLike]) -> list[torch.Tensor]:
    """Flatten layers, (k, v) pairs and tensors into the list of tensors indexed by block id."""
    if isinstance(caches, KVCacheLayer):
        return caches.block_tensors()
    if isinstance(caches, torch.Tensor):
        return [caches]
    out: list[torch.Tensor] = []
    for c in caches:
        out += block_tensors_of(c)
    return out


def _layers_of(caches) -> list[KVCacheLayer]:
    if isinstance(caches, KVCacheLayer):
        return [caches]
    if isinstance(caches, torch.Tensor):
        return []
    return [layer for c in caches for layer in _layers_of(c)]


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def _check_ids(m: torch.Tensor, num_blocks: int, what: str) -> None:
    if m.numel() and (int(m.min()) < 0 or int(m.max()) >= num_blocks):
        raise ShapeError(f"{what} block ids must lie in [0, {num_blocks}), got [{int(m.min())}, {int(m.max())}]")


def copy_blocks(caches: CacheLike | Iterable[CacheLike], block_mapping, *, backend: str | None = None) -> None:
    """Copy block ``src`` to block ``dst`` in every tensor of ``caches`` (all layers, K, V, scales).

    The Triton kernel copies all pairs in parallel; it runs when every ``dst`` is distinct and no
    ``dst`` is also a ``src`` (copy-on-write into fresh blocks). Other mappings take the torch
    path, which reads all sources before writing (same result on any backend).
    """
    tensors = block_tensors_of(caches)
    if not tensors:
        return
    m = normalize_block_mapping(block_mapping)
    if m.shape[0] == 0:
        return
    for t in tensors:
        _check_ids(m, t.shape[0], "copy_blocks")
    from .kivi_cache import plan_copy
    commits = [plan_copy(layer, m.cpu()) for layer in _layers_of(caches)
               if layer.staging is not None or layer.sink is not None]
    _copy_tensors(tensors, m, backend)
    for commit in commits:
        commit()


def _copy_tensors(tensors: list[torch.Tensor], m: torch.Tensor, backend: str | None) -> None:
    from .backend import resolve_backend
    be = resolve_backend(backend, tensors[0].device)
    dst, src = set(m[:, 1].tolist()), set(m[:, 0].tolist())
    if be not in ("torch", "native") and len(dst) == m.shape[0] and not dst & src:
        from .triton_impl.launch import copy_blocks_triton
        copy_blocks_triton(tensors, m.to(tensors[0].device))
        return
    for t in tensors:
        mm = m.to(t.device)
        tb = _bytes_view(t)
        tb[mm[:, 1]] = tb[mm[:, 0]]


def swap_blocks(src: CacheLike | Iterable[CacheLike], dst: CacheLike | Iterable[CacheLike], block_mapping, *,
                non_blocking: bool = False) -> None:
    """Copy block ``s`` of ``src`` into block ``d`` of ``dst`` for each pair, e.g. GPU <-> CPU pools.

    ``src`` and ``dst`` must have the same structure (same formats, shapes per block). Gathers on
    the source device, transfers once per tensor, scatters on the destination device. Use pinned CPU
    tensors and ``non_blocking=True`` to overlap with compute on a GPU.
    """
    st, dt = block_tensors_of(src), block_tensors_of(dst)
    if len(st) != len(dt):
        raise ShapeError(f"swap_blocks: source has {len(st)} block tensors, destination {len(dt)}; "
                         f"pass caches of the same format and layer count")
    m = normalize_block_mapping(block_mapping)
    if m.shape[0] == 0:
        return
    commits = _plan_swap_staging(src, dst, m)
    for a, b in zip(st, dt):
        if a.shape[1:] != b.shape[1:] or a.dtype != b.dtype:
            raise ShapeError(f"swap_blocks: block shape/dtype {tuple(a.shape[1:])} {a.dtype} != "
                             f"{tuple(b.shape[1:])} {b.dtype}")
        _check_ids(m[:, :1], a.shape[0], "swap_blocks source")
        _check_ids(m[:, 1:], b.shape[0], "swap_blocks destination")
        moved = _bytes_view(a)[m[:, 0].to(a.device)].to(b.device, non_blocking=non_blocking)
        _bytes_view(b)[m[:, 1].to(b.device)] = moved
    for commit in commits:
        commit()


def _plan_swap_staging(src, dst, m: torch.Tensor) -> list:
    """Check (and prepare) the staging side of a swap between int4_kivi layers, before any copy."""
    sl, dl = _layers_of(src), _layers_of(dst)
    if not any(x.staging is not None or x.sink is not None for x in sl + dl):
        return []
    if len(sl) != len(dl) or any(a.kv_format != b.kv_format for a, b in zip(sl, dl)):
        raise ShapeError("swap_blocks with int4_kivi: pass source and destination as the same number of "
                         "KVCacheLayer objects of the same format (their staging pools move with the blocks)")
    from .kivi_cache import plan_swap
    mm = m.cpu()
    for a, b in zip(sl, dl):
        _check_ids(mm[:, :1], a.num_blocks, "swap_blocks source")
        _check_ids(mm[:, 1:], b.num_blocks, "swap_blocks destination")
    return [plan_swap(a, b, mm) for a, b in zip(sl, dl)]
