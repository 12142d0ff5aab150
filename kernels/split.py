"""Split KV formats: K and V each in their own :class:`~kernels.format_table.SideFormat`.

This module is the torch reference that defines them (the Triton kernels reproduce its reads;
its writes run as torch ops on every backend, like ``int4_kivi``'s). Layout of one layer
(``NB`` blocks of ``BS`` tokens, ``H`` KV heads, ``D`` = head_dim):

* ``kivi<b>`` keys: ``k`` uint8 ``[NB, BS, H, R]`` with ``R = b * D / 8``: channel ``c`` of a
  token-head row holds ``width[h, c]`` bits at bit ``offset[h, c]`` (little-endian across bytes;
  uniform widths ``b`` = the ``int4`` packing at 4 bits); per (block, head, channel) a step and a
  zero: fp16 ``k_scale``/``k_zero`` ``[NB, H, D]``, or with ``+q8`` a uint8 step code
  (``k_scale``), an int8 zero code (``k_zero``) and fp16 super-scales ``k_super [NB, H, 2]``
  (zero unit, step unit). Value = ``code * step + zero`` (a 0-bit channel reads ``0.5 * step +
  zero``, the middle of its range). Keys are quantized per channel over the block when its
  last offset is written (*sealed*), from the block's fp16 staged rows; with ``+pre`` RoPE is
  undone first (the model's own tables) and applied again on read at each key's position.
* ``cb<b>[_g<n>]`` values: ``v`` uint8 ``[NB, BS, H, R]`` (uniform ``b``-bit codes), fp16
  ``v_scale [NB, BS, H, D / n]`` = absmax / max|level| per group; value = ``level[code] * scale``
  with the layer's codebook ``tables.v_levels``. ``+rot``: values are rotated by the Hadamard
  matrix ``H`` before quantizing; attention over them is rotated back (``out @ H^T``).
* ``fp16``/``bf16``/``fp32`` sides: the values in that dtype.
* ``staging``: fp16 rows (K, and V with a window) of the blocks still read exactly: unsealed
  KIVI blocks, and with ``@winW`` every block a query may still read within its window;
  ``sink`` (``@sinkS``): fp16 K and V of the first S tokens, one slot of S rows per first block.

Reading (:func:`attend_split`): query ``i`` reads key/value ``j`` from staging when
``j < sink`` or ``i - j < window`` (*exact*), else from the codes. Without a sink or window,
keys of unsealed blocks come from staging (they are always the newest < BS tokens) and values
from the codes. Staging invariants (slots, atomic errors, copies and swaps) are those of
:mod:`kernels.kivi_cache`; the engine releases a window block's slot once no query of its
sequence can read it exactly any more (:func:`window_out_blocks`), and every block's with
:func:`kernels.release_blocks` when the KV manager frees the block.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .errors import ShapeError
from .format_table import CODE_KIVI, KVFormat
from .kivi_cache import host_indices, write_plan
from .split_codec import (STAGING_DTYPE, SplitTables, bit_layout, cb_dequantize, cb_quantize, hadamard, kivi_dequantize,
                          kivi_quantize, kivi_step_zero, lloyd_levels, normal_levels, pack_bits, rope, rope_tables,
                          unpack_bits, uniform_widths, unrope)
from .split_read import (attend_split, decode_k, decode_v, gather_split, split_decode_ref, split_prefill_ref, v_offset,
                         v_width)

if TYPE_CHECKING:
    from .cache import KVCacheLayer

__all__ = ["SplitTables", "rope", "unrope", "rope_tables", "hadamard", "bit_layout", "pack_bits", "unpack_bits",
           "cb_quantize", "cb_dequantize", "lloyd_levels", "normal_levels", "kivi_quantize", "kivi_dequantize",
           "kivi_step_zero", "uniform_widths", "write_split",
           "gather_split", "attend_split", "split_prefill_ref", "split_decode_ref", "window_out_blocks",
           "STAGING_DTYPE"]


# ---- writes -------------------------------------------------------------------------------------

def check_positions(layer: "KVCacheLayer", positions: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """Host int64 positions [n] when the format needs them (+pre, a sink or a window), else None."""
    fmt = layer.kv_format
    if not (fmt.k_side.pre_rope or fmt.sink or fmt.window):
        return None
    if positions is None:
        raise ShapeError(f"kv format {fmt.name!r} needs the tokens' positions: pass positions= to write_kv "
                         "(each token's index in its sequence)")
    if positions.shape != (n,):
        raise ShapeError(f"positions must be [{n}] (one per written token), got {tuple(positions.shape)}")
    return positions.to("cpu", torch.int64)


def _seed_k(layer: "KVCacheLayer", blocks: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """The exact-row stand-in of sealed blocks' keys (decoded, RoPE at their positions), fp16 values."""
    return decode_k(layer, blocks.to(layer.device), start.to(layer.device)).to(STAGING_DTYPE)


def write_split(layer: "KVCacheLayer", key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
                positions: torch.Tensor | None) -> None:
    """Store ``key``/``value`` ``[T, H, D]`` at ``slot_mapping`` (< 0 skipped): V codes now, K codes
    when a block is sealed, exact fp16 rows in staging (see the module docstring). Raises
    StagingExhaustedError before changing anything when the pool is too small."""
    fmt = layer.kv_format
    ks, vs = fmt.k_side, fmt.v_side
    pos_host = check_positions(layer, positions, key.shape[0])
    p = write_plan(slot_mapping, layer.block_size)
    if p is None:
        return
    dev, bs = layer.device, layer.block_size
    keep, slots = p.rows.to(dev), p.slots.to(dev)
    kx, vx = key.index_select(0, keep).float(), value.index_select(0, keep).float()
    pool, windowed = layer.staging, bool(fmt.window or fmt.sink)
    kivi = ks.code == CODE_KIVI
    start = None
    if pos_host is not None:
        start = torch.zeros(p.blocks.numel(), dtype=torch.int64)
        start[p.inv] = pos_host[p.rows] - p.offs
    # 1. count staging (and sink) slots before changing anything
    if pool is not None:
        old = pool.slots_of(p.blocks)
        after = torch.ones_like(p.seal) if windowed else ~p.seal
        fresh, freed = after & (old < 0), ~after & (old >= 0)
        need = int(fresh.sum())
        if not pool.make_room(need - int(freed.sum())):
            raise pool.exhausted(need, f"writing {p.slots.numel()} tokens into {p.blocks.numel()} blocks")
    sink_rows = None
    if fmt.sink:
        sink_rows = torch.nonzero(pos_host[p.rows] < fmt.sink).squeeze(1)  # written tokens that are sink tokens
        sb = p.blocks[p.inv[sink_rows]].unique()
        new_sink = sb[layer.sink.slots_of(sb) < 0]
        if not layer.sink.make_room(int(new_sink.numel())):
            raise layer.sink.exhausted(int(new_sink.numel()), f"writing the sink tokens of {sb.numel()} sequences")
    # 2. values: codes now
    if vs.exact:
        layer.v.view(-1, *layer.v.shape[2:])[slots] = vx.to(layer.v.dtype)
    else:
        vr = vx @ layer.tables.hadamard if vs.rotate else vx
        codes, scale = cb_quantize(vr, layer.tables.v_levels, vs.group)
        layer.v.view(-1, *layer.v.shape[2:])[slots] = pack_bits(codes, v_width(layer), v_offset(layer), layer.v.shape[-1])
        layer.v_scale.view(-1, *layer.v_scale.shape[2:])[slots] = scale
    if ks.exact:
        layer.k.view(-1, *layer.k.shape[2:])[slots] = kx.to(layer.k.dtype)
    if sink_rows is not None and sink_rows.numel():
        _write_sink(layer, p, sink_rows, pos_host, kx, vx)
    if pool is None:
        return
    kd = kx.to(STAGING_DTYPE)
    # 3. seal full KIVI blocks from their exact rows (staged before this write, or decoded) + this write's
    if kivi and bool(p.seal.any()):
        _seal(layer, p, kd, old, start)
    # 4. staging: release sealed blocks (KIVI only), give the others a slot, write the exact rows
    pool.unassign(p.blocks[freed].tolist())
    pool.assign(p.blocks[fresh].tolist())
    slot = pool.slots_of(p.blocks)
    life = after & p.has0  # a write from offset 0 begins a new life: discard old rows
    if bool(life.any()):
        pool.zero(slot[life].to(dev))
    seed = fresh & ~p.has0  # reopened past offset 0: rows from the codes
    if bool(seed.any()):
        sb = p.blocks[seed]
        st = start[seed] if start is not None else torch.zeros_like(sb)
        seed_slots = slot[seed].to(dev)
        if kivi:
            pool.write_slots("k", seed_slots, _seed_k(layer, sb, st))
        if pool.v is not None:
            v = decode_v(layer, sb.to(dev), blocks=True)
            if vs.rotate:
                v = v @ layer.tables.hadamard.T
            pool.write_slots("v", seed_slots, v.to(STAGING_DTYPE))
            if not kivi:
                pool.write_slots("k", seed_slots, decode_k(layer, sb.to(dev), st.to(dev)).to(STAGING_DTYPE))
    tok = after[p.inv]
    rows = (slot[p.inv[tok]] * bs + p.offs[tok]).to(dev)
    sel = torch.nonzero(tok).squeeze(1).to(dev)
    pool.write("k", rows, kd[sel])
    if pool.v is not None:
        pool.write("v", rows, vx[sel].to(STAGING_DTYPE))


def _write_sink(layer: "KVCacheLayer", p, rows: torch.Tensor, pos_host: torch.Tensor, kx: torch.Tensor,
                vx: torch.Tensor) -> None:
    """fp16 K/V of the written sink tokens (positions < S) into their first block's sink slot; a
    write of position 0 begins a new life (the slot is zeroed first)."""
    pool, dev = layer.sink, layer.device
    blocks = p.blocks[p.inv[rows]]
    pool.assign([b for b in blocks.unique().tolist() if int(pool.map_host[b]) < 0])
    first = blocks[pos_host[p.rows][rows] == 0]
    if first.numel():
        pool.zero(pool.slots_of(first).to(dev))
    at = (pool.slots_of(blocks) * pool.k.shape[1] + pos_host[p.rows][rows]).to(dev)
    sel = rows.to(dev)
    pool.write("k", at, kx[sel].to(STAGING_DTYPE))
    pool.write("v", at, vx[sel].to(STAGING_DTYPE))


def _seal(layer: "KVCacheLayer", p, kd: torch.Tensor, old: torch.Tensor, start: torch.Tensor | None) -> None:
    """Quantize the KIVI blocks whose last offset this write stores (their exact rows as fp16)."""
    pool, bs, dev, t = layer.staging, layer.block_size, layer.device, layer.tables
    fmt = layer.kv_format
    sb = p.blocks[p.seal]
    buf = torch.zeros(sb.numel(), bs, *kd.shape[1:], dtype=STAGING_DTYPE, device=dev)
    staged = (old >= 0)[p.seal]
    from_stage = staged & ~p.has0[p.seal]
    from_codes = ~staged & ~p.has0[p.seal]
    st = start[p.seal] if start is not None else torch.zeros_like(sb)
    if bool(from_stage.any()):
        buf[host_indices(from_stage, dev)] = pool.read("k", old[p.seal][from_stage].to(dev)).to(STAGING_DTYPE)
    if bool(from_codes.any()):
        buf[host_indices(from_codes, dev)] = _seed_k(layer, sb[from_codes], st[from_codes])
    tok = p.seal[p.inv]
    pos = torch.cumsum(p.seal.long(), 0) - 1
    buf.view(-1, *kd.shape[1:])[(pos[p.inv[tok]] * bs + p.offs[tok]).to(dev)] = kd[host_indices(tok, dev)]
    x = buf.float()
    rows = st.to(dev)[:, None] + torch.arange(bs, device=dev)
    if fmt.k_side.pre_rope:
        r = rows.clamp(max=t.cos.shape[0] - 1)
        x = unrope(x, t.cos[r], t.sin[r])
    exclude = rows < fmt.sink if fmt.sink else None
    codes, step, zero, sup = kivi_quantize(x, t.k_width, fmt.k_side.compact, exclude)
    sbd = sb.to(dev)
    layer.k[sbd] = pack_bits(codes, t.k_width, t.k_offset, t.k_row_bytes)
    layer.k_scale[sbd], layer.k_zero[sbd] = step, zero
    if sup is not None:
        layer.k_super[sbd] = sup


def window_out_blocks(block_tables, seq_lens, fmt: KVFormat, block_size: int) -> list[int]:
    """Block ids no query of their sequence reads exactly any more after this step: block ``b`` of
    a sequence of ``L`` tokens once ``(b + 1) * BS <= L - window + 1`` (the next query, at ``L``,
    reads ``j > L - window`` exactly; sink tokens have their own pool). ``block_tables`` host
    ints ``[S, M]`` (padding past a sequence's blocks is never selected), ``seq_lens`` ``[S]`` the
    lengths after the step. Empty for formats without a window. The caller frees the slots with
    :func:`kernels.release_blocks` (after checking no other sequence shares a block)."""
    if not fmt.split or not fmt.window:
        return []
    bt = torch.as_tensor(block_tables, dtype=torch.long).cpu()
    lens = torch.as_tensor(seq_lens, dtype=torch.long).cpu()
    if bt.numel() == 0:
        return []
    n_out = ((lens - fmt.window + 1) // block_size).clamp(min=0)
    out = torch.arange(bt.shape[1])[None, :] < n_out[:, None]
    return bt[out].unique().tolist()
