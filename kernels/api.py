"""Public entry points: validate inputs, pick a backend, call the Triton kernel or the torch reference.

Every operation on a :class:`~kernels.cache.KVCacheLayer` lives here (or in :mod:`kernels.blocks`);
the layer itself is data only.

Value checks (seq_lens in range, every block id a sequence uses inside the cache, slots inside the
cache) run where they cost no device sync: on CPU tensors always, on GPU tensors only when the
environment variable ``PAGED_KERNEL_CHECKS=1`` is set (one sync per call; for debugging).
"""

from __future__ import annotations

import math
import os
import weakref

import torch

from .backend import resolve_backend
from .cache import KVCacheLayer, as_layer, check_layer
from .errors import ShapeError
from .reference import decode_attention_ref, prefill_attention_ref, write_kv_ref

__all__ = ["paged_decode_attention", "paged_prefill_attention", "write_kv", "release_blocks", "release_window"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
Scale = torch.Tensor | float | None  # fp8: per tensor or per KV head; int8/int4: per-token side tensor
Side = torch.Tensor | None


def _int32(name: str, t: torch.Tensor, dim: int, device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != dim or t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ShapeError(f"{name} must be a {dim}-D int32 tensor, got "
                         f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    if t.device != device:
        raise ShapeError(f"{name} is on {t.device} but the cache is on {device}; move it with .to({str(device)!r})")
    return t.to(torch.int32).contiguous()


def _check_q(q: torch.Tensor, layer: KVCacheLayer, what: str) -> None:
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.dtype not in _FLOATS:
        raise ShapeError(f"{what} must be a float16/bfloat16/float32 tensor [tokens, num_q_heads, head_dim], "
                         f"got {getattr(q, 'dtype', None)} {tuple(getattr(q, 'shape', ()))}")
    if q.device != layer.device:
        raise ShapeError(f"{what} is on {q.device} but the cache is on {layer.device}")
    if q.shape[2] != layer.head_dim:
        raise ShapeError(f"{what} head_dim {q.shape[2]} != cache head_dim {layer.head_dim}")
    if q.shape[1] % layer.num_kv_heads:
        raise ShapeError(f"num_q_heads {q.shape[1]} must be a multiple of num_kv_heads {layer.num_kv_heads}")


def _check_values(t: torch.Tensor) -> bool:
    """Whether value checks run on ``t``: always on CPU, on a device with PAGED_KERNEL_CHECKS=1."""
    return t.device.type == "cpu" or os.environ.get("PAGED_KERNEL_CHECKS", "0") == "1"


def _check_tables(block_tables: torch.Tensor, seq_lens: torch.Tensor, num_seqs: int, layer: KVCacheLayer) -> None:
    """Shapes always; values (see the module docstring): ``0 <= seq_lens <= width x block_size``, and
    the first ``ceil(seq_len / block_size)`` ids of each row in ``[0, num_blocks)`` (the rest is padding)."""
    if block_tables.shape[0] != num_seqs or seq_lens.shape[0] != num_seqs:
        raise ShapeError(f"block_tables {tuple(block_tables.shape)} and seq_lens {tuple(seq_lens.shape)} need one "
                         f"row per sequence ({num_seqs})")
    if not num_seqs or not _check_values(seq_lens):
        return
    key = (block_tables._version, seq_lens._version, layer.num_blocks, layer.block_size)
    last = _last_checked
    if last and last[0]() is block_tables and last[1]() is seq_lens and last[2] == key:
        return  # the same unchanged tables as the previous call (the other layers of one step)
    _check_table_values(block_tables, seq_lens, layer)
    _last_checked[:] = [weakref.ref(block_tables), weakref.ref(seq_lens), key]


# (weakref to block_tables, weakref to seq_lens, (their versions, num_blocks, block_size)) of the last
# tables that passed: weak references, so a new tensor at a reused address never matches
_last_checked: list = []


def _check_table_values(block_tables: torch.Tensor, seq_lens: torch.Tensor, layer: KVCacheLayer) -> None:
    bs, width = layer.block_size, block_tables.shape[1]
    cap = width * bs
    lo, hi = int(seq_lens.min()), int(seq_lens.max())
    if lo < 0 or hi > cap:
        i = int(seq_lens.argmin()) if lo < 0 else int(seq_lens.argmax())
        raise ShapeError(f"seq_lens must lie in [0, {cap}] (block_tables width {width} x block_size {bs}); "
                         f"got seq_lens[{i}] = {lo if lo < 0 else hi}")
    used = torch.arange(width, device=seq_lens.device)[None, :] < ((seq_lens.long() + bs - 1) // bs)[:, None]
    bad = used & ((block_tables < 0) | (block_tables >= layer.num_blocks))
    if bool(bad.any()):
        row, col = (int(x) for x in bad.nonzero()[0])
        raise ShapeError(f"block_tables[{row}, {col}] = {int(block_tables[row, col])} is not a block of this cache "
                         f"(ids 0..{layer.num_blocks - 1}); sequence {row} uses its first "
                         f"{int(used[row].sum())} entries, which must all be allocated block ids")


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor | KVCacheLayer, v_cache: torch.Tensor | None,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, *, scale: float | None = None,
                           k_scale: Scale = None, v_scale: Scale = None, k_zero: Side = None, v_zero: Side = None,
                           kv_format: str | None = None,
                           backend: str | None = None, return_lse: bool = False, num_splits: int | None = None):
    """Attention of one query token per sequence over its paged K/V.

    ``q`` ``[num_seqs, num_q_heads, head_dim]``; ``k_cache``/``v_cache`` in the block layout
    (or a :class:`KVCacheLayer` as ``k_cache`` with ``v_cache=None``); ``block_tables`` int32
    ``[num_seqs, max_blocks]``; ``seq_lens`` int32 ``[num_seqs]`` (tokens in the cache, the
    current one included). Returns ``out`` ``[num_seqs, num_q_heads, head_dim]`` in ``q.dtype``,
    and with ``return_lse`` also the float32 natural-log log-sum-exp of the scaled scores
    ``[num_seqs, num_q_heads]``. ``num_splits`` overrides the split-KV count of the Triton path.
    """
    layer = as_layer(k_cache, v_cache, kv_format=kv_format, k_scale=k_scale, v_scale=v_scale,
                     k_zero=k_zero, v_zero=v_zero)
    _check_q(q, layer, "q")
    bt = _int32("block_tables", block_tables, 2, layer.device)
    sl = _int32("seq_lens", seq_lens, 1, layer.device)
    _check_tables(bt, sl, q.shape[0], layer)
    be = resolve_backend(backend, q.device)
    if layer.kv_format.split and return_lse:
        raise ShapeError(f"return_lse is not available for split kv format {layer.kv_format.name!r}")
    if be == "native":
        from .native import quant as native_quant
        if not return_lse and native_quant.supports(layer):
            return native_quant.decode(q, layer, bt, sl, _softmax_scale(q, scale))
        be = "torch"  # what the compiled kernels do not take: the references
    if layer.kv_format.split:
        sc = _softmax_scale(q, scale)
        if be == "torch":
            from .split import split_decode_ref
            return split_decode_ref(q, layer, bt, sl, sc)[0]
        from .triton_impl.split_launch import split_decode_triton
        return split_decode_triton(q, layer, bt, sl, sc, num_splits)
    if be == "torch":
        out, lse = decode_attention_ref(q, layer, bt, sl, scale, need_lse=return_lse)
    else:
        from .triton_impl.launch import decode_triton
        out, lse = decode_triton(q, layer, bt, sl, scale, num_splits=num_splits)
    return (out, lse) if return_lse else out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor | KVCacheLayer, v_cache: torch.Tensor | None,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *,
                            scale: float | None = None, k_scale: Scale = None, v_scale: Scale = None,
                            k_zero: Side = None, v_zero: Side = None, kv_format: str | None = None,
                            backend: str | None = None) -> torch.Tensor:
    """Prefill/extend attention for a variable-length batch (chunked prefill, prefix hits, decodes).

    ``q`` ``[total_q_tokens, num_q_heads, head_dim]``; ``query_start_loc`` int32 ``[num_seqs+1]``
    (cumulative query lengths, starting at 0); ``seq_lens`` = context length per sequence
    *including* the new tokens, whose K/V :func:`write_kv` has already stored. Query ``i`` of
    sequence ``s`` sits at position ``seq_lens[s] - q_len + i`` and attends to positions
    ``[0, that position]``. Returns ``[total_q_tokens, num_q_heads, head_dim]`` in ``q.dtype``.
    """
    layer = as_layer(k_cache, v_cache, kv_format=kv_format, k_scale=k_scale, v_scale=v_scale,
                     k_zero=k_zero, v_zero=v_zero)
    _check_q(q, layer, "q")
    bt = _int32("block_tables", block_tables, 2, layer.device)
    sl = _int32("seq_lens", seq_lens, 1, layer.device)
    qsl = _int32("query_start_loc", query_start_loc, 1, layer.device)
    n = bt.shape[0]
    _check_tables(bt, sl, n, layer)
    if qsl.shape[0] != n + 1:
        raise ShapeError(f"query_start_loc needs num_seqs + 1 = {n + 1} entries, got {qsl.shape[0]}")
    if _check_values(qsl):
        q_lens = qsl[1:] - qsl[:-1]
        if int(qsl[0]) != 0 or int(qsl[-1]) != q.shape[0] or bool((q_lens < 0).any()):
            raise ShapeError(f"query_start_loc must rise from 0 to total_q_tokens={q.shape[0]}, "
                             f"got {qsl.tolist()[:8]}...")
        if bool((q_lens > sl).any()):
            raise ShapeError("each seq_len must count the new query tokens too (seq_lens >= query lengths); "
                             "write their K/V with write_kv first")
    be = _host(resolve_backend(backend, q.device))
    if layer.kv_format.split:
        sc = _softmax_scale(q, scale)
        if be == "torch":
            from .split import split_prefill_ref
            return split_prefill_ref(q, layer, bt, sl, qsl, sc)
        from .triton_impl.split_launch import split_prefill_triton
        return split_prefill_triton(q, layer, bt, sl, qsl, sc)
    if be == "torch":
        return prefill_attention_ref(q, layer, bt, sl, qsl, scale)
    from .triton_impl.launch import prefill_triton
    return prefill_triton(q, layer, bt, sl, qsl, scale)


def _host(be: str) -> str:
    """The backend of the paths without a compiled CPU kernel: 'native' runs the references there."""
    return "torch" if be == "native" else be


def _softmax_scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def write_kv(key: torch.Tensor, value: torch.Tensor, layer: KVCacheLayer, slot_mapping: torch.Tensor, *,
             backend: str | None = None, positions: torch.Tensor | None = None) -> None:
    """Store ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` at ``slot_mapping`` (int,
    ``[num_tokens]``, slot = block_id * block_size + offset; slots < 0 are skipped), quantizing on
    write into ``layer`` (its format, scales and staging pool travel with it; loose tensors become a
    layer through :func:`kernels.as_layer`). ``positions`` (int ``[num_tokens]``, each token's index
    in its sequence): needed by split formats with ``+pre`` keys, a sink or a window; ignored by the others.
    """
    if not isinstance(layer, KVCacheLayer):
        raise ShapeError(f"write_kv writes into a KVCacheLayer, got {type(layer).__name__}; allocate one with "
                         "kernels.allocate_kv_cache or wrap loose tensors with kernels.as_layer(k_cache, v_cache)")
    check_layer(layer)
    for name, x in (("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.dtype not in _FLOATS or \
                tuple(x.shape[1:]) != (layer.num_kv_heads, layer.head_dim) or x.device != layer.device:
            raise ShapeError(f"{name} must be a float tensor [num_tokens, {layer.num_kv_heads}, {layer.head_dim}] "
                             f"on {layer.device}, got {getattr(x, 'dtype', None)} {tuple(getattr(x, 'shape', ()))}")
    if key.shape != value.shape:
        raise ShapeError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have the same shape")
    sm = _int32("slot_mapping", slot_mapping, 1, layer.device)
    if sm.shape[0] != key.shape[0]:
        raise ShapeError(f"slot_mapping has {sm.shape[0]} entries for {key.shape[0]} tokens")
    if sm.numel() and _check_values(sm) and int(sm.max()) >= layer.num_blocks * layer.block_size:
        raise ShapeError(f"slot {int(sm.max())} is past the cache ({layer.num_blocks} blocks x {layer.block_size})")
    if layer.kv_format.split:
        from .split import write_split
        if resolve_backend(backend, key.device) == "native" and _native_write(layer, key, value, sm, positions):
            return
        write_split(layer, key, value, sm, positions)  # torch ops on every backend (host bookkeeping)
        return
    be = resolve_backend(backend, key.device)
    if be == "native":
        from .native import quant_write
        if quant_write.supports_plain(layer):
            rest = quant_write.write_plain(layer, key, value, sm)
            if rest is not None:
                ix = rest.to(key.device)
                write_kv_ref(layer, key.index_select(0, ix), value.index_select(0, ix), sm.index_select(0, ix))
            return
    if _host(be) == "torch" or layer.kv_format.k_per_channel:
        write_kv_ref(layer, key, value, sm)  # int4_kivi: torch ops on every backend (kernels.kivi_cache)
        return
    from .triton_impl.launch import write_kv_triton
    write_kv_triton(layer, key.contiguous(), value.contiguous(), sm)


def _native_write(layer: KVCacheLayer, key, value, sm, positions) -> bool:
    """The compiled split write of the tokens it takes (:mod:`kernels.native.quant_write`), the
    reference for the rest; False when the compiled write does not take this layer."""
    from .native import quant_write
    if not quant_write.supports(layer):
        return False
    from .split import check_positions, write_split
    pos = check_positions(layer, positions, key.shape[0])
    rest = quant_write.write_split(layer, key, value, sm, pos)
    if rest is not None:
        ix = rest.to(key.device)
        write_split(layer, key.index_select(0, ix), value.index_select(0, ix), sm.index_select(0, ix),
                    None if positions is None else positions.index_select(0, rest.to(positions.device)))
    return True


def release_blocks(layer: KVCacheLayer, block_ids) -> None:
    """Tell ``layer`` that the KV manager freed ``block_ids`` (ints or an integer tensor).

    ``int4_kivi`` and staged split formats: frees their staging slots (this bounds staging use; see
    :mod:`kernels.kivi_cache`). A no-op for the other formats, so callers need not check.
    """
    if layer.staging is not None or layer.sink is not None:
        from .kivi_cache import release
        release(layer, block_ids)


def release_window(layer: KVCacheLayer, block_ids) -> None:
    """Split formats with a window: free the staging slots of ``block_ids``, blocks that no query
    reads exactly any more (:func:`kernels.split.window_out_blocks`); their codes stay, and a sink
    slot stays until the block is freed (:func:`release_blocks`). A no-op for other formats."""
    fmt = layer.kv_format
    if fmt.split and fmt.window and layer.staging is not None:
        ids = torch.as_tensor(block_ids, dtype=torch.long).reshape(-1).cpu()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= layer.num_blocks):
            raise ShapeError(f"release_window ids must lie in [0, {layer.num_blocks}), "
                             f"got [{int(ids.min())}, {int(ids.max())}]")
        layer.staging.unassign(ids.tolist())
