"""The ``int4_kivi`` cache format: K per channel over a block, V per token, unfilled blocks staged.

Layout of one layer (``NB`` blocks of ``BS`` tokens, ``H`` KV heads, ``D`` = head_dim, ``G``
V groups of ``group_size`` along head_dim):

* ``v`` uint8 ``[NB, BS, H, D // 2]``, ``v_scale``/``v_zero`` fp16 ``[NB, BS, H, G]``: exactly ``int4``.
* ``k`` uint8 ``[NB, BS, H, D // 2]``: int4 codes packed two per byte along head_dim (element ``2j``
  in the low nibble), quantized per (block, head, channel) over the block's ``BS`` tokens;
  ``k_scale``/``k_zero`` fp16 ``[NB, H, D]`` (block layout: a block copy or swap moves them).
* ``staging`` (:class:`~kernels.staging.StagingPool`): ``num_staging_blocks`` slots of K in the
  model dtype ``[S, BS, H, D]`` and an int32 ``block_map [NB]`` (block -> slot, -1 for none).

Invariants:

1. *Staged or sealed.* A block with ``block_map[b] = s >= 0`` is *staged*: its K is
   ``staging.k[s]`` (the offsets written since the block's last write at offset 0 hold K
   rounded to the model dtype, the others hold 0). A block with ``block_map[b] = -1`` is
   *sealed*: its K is ``code * k_scale[b] + k_zero[b]`` (float32). V never depends on staging.
   Readers (the torch reference and the Triton kernels) decide per block from ``block_map``.
2. *Sealing.* The write that stores offset ``BS - 1`` of a block seals it: the block's K
   (staged content, or 0 for a block whose write starts at offset 0, or the dequantized sealed
   K for a sealed block written without offset 0), with this write's rows on top, is quantized
   per channel (:func:`kernels.kivi.quantize_k_blocks`) and the staging slot is released. So a
   full block's codes equal ``quantize_k_blocks`` of its K in the model dtype, whether it was
   written token by token or at once, and a prefill of full blocks needs no staging.
3. *Staging.* After a write, every written block that was not sealed by it is staged: one that
   was not gets a free slot, filled with 0 when the write includes offset 0 and otherwise with
   its dequantized sealed K. A write that includes offset 0 begins a new life: a block already
   staged keeps its slot, which is zeroed first (old content discarded).
4. *Atomic errors.* A write, copy or swap that needs more free slots than the pool holds
   (counting the slots it releases itself) raises :class:`~kernels.errors.StagingExhaustedError`
   before changing anything.
5. *Lifetimes.* ``copy_blocks`` (copy-on-write) gives a destination the source's state: a staged
   source's rows are copied into the destination's slot (its own, or a new one); a sealed
   source releases the destination's slot. ``swap_blocks`` does the same between the pools of
   two layers (GPU <-> CPU), leaving the source as it is (the manager frees it afterwards).
   :func:`kernels.release_blocks` frees the slots of blocks the KV manager freed; that call
   is what bounds staging use. A freed staged block that is never released keeps its slot until
   the block is reused: rewritten from offset 0 (it reuses its own slot), sealed, or the
   destination of a copy or swap; so without releases, staging can still hold at most one slot
   per block ever left unfilled.

Cost: the write path reads ``slot_mapping`` on the host to do this bookkeeping (one host sync
per write on a GPU; every index it then uses is computed on the host) and runs as torch ops on
every backend (no Triton write kernel for this format yet); the attention kernels read the
device map only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple

import torch

from .errors import ShapeError
from .kivi import dequantize_k_blocks, quantize_k_blocks
from .quant import quantize_kv

if TYPE_CHECKING:
    from .cache import KVCacheLayer

__all__ = ["write_kivi", "write_plan", "gather_k", "plan_copy", "plan_swap", "release"]


def take_blocks(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``t[idx]`` via index_select (several times faster than advanced indexing on CPU)."""
    return t.index_select(0, idx.reshape(-1)).view(*idx.shape, *t.shape[1:])


def _seed(layer: KVCacheLayer, blocks: torch.Tensor) -> torch.Tensor:
    """Dequantized sealed K of ``blocks`` (device, long) in the model dtype ``[n, BS, H, D]``."""
    return dequantize_k_blocks(layer.k[blocks], layer.k_scale[blocks], layer.k_zero[blocks]).to(layer.dtype)


class _WritePlan(NamedTuple):
    """Host-side view of one write: per written token (``inv``: its block's index in ``blocks``,
    ``offs``: offset in the block) and per distinct block (``blocks``, ``old`` slot or -1,
    ``has0``: offset 0 written, ``seal``: offset BS-1 written)."""

    rows: torch.Tensor  # indices of the tokens written (slot >= 0)
    slots: torch.Tensor
    offs: torch.Tensor
    blocks: torch.Tensor
    inv: torch.Tensor
    old: torch.Tensor
    has0: torch.Tensor
    seal: torch.Tensor

    @property
    def staged(self) -> torch.Tensor:
        return self.old >= 0


def write_plan(slot_mapping: torch.Tensor, bs: int) -> _WritePlan | None:
    sm_host = slot_mapping.to("cpu")  # the bookkeeping's one host sync on a GPU
    rows = torch.nonzero(sm_host >= 0).squeeze(1)
    slots = sm_host[rows].long()
    if slots.numel() == 0:
        return None
    offs = slots % bs
    blocks, inv = torch.unique(slots // bs, return_inverse=True)
    has0 = torch.zeros(blocks.numel(), dtype=torch.bool)
    has0[inv[offs == 0]] = True
    seal = torch.zeros(blocks.numel(), dtype=torch.bool)
    seal[inv[offs == bs - 1]] = True
    return _WritePlan(rows, slots, offs, blocks, inv, torch.empty(0), has0, seal)


def host_indices(mask: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host bool mask -> int64 indices on ``device`` (a boolean index on a GPU would sync)."""
    return torch.nonzero(mask).squeeze(1).to(device)


def write_kivi(layer: KVCacheLayer, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``key``/``value`` ``[T, H, D]`` at ``slot_mapping`` (< 0 skipped) under invariants 1-4."""
    pool = layer.staging
    p = write_plan(slot_mapping, layer.block_size)
    if p is None:
        return
    p = p._replace(old=pool.slots_of(p.blocks))
    need = int((~p.seal & ~p.staged).sum())
    if not pool.make_room(need - int((p.seal & p.staged).sum())):
        raise pool.exhausted(need, f"writing {p.slots.numel()} tokens into {p.blocks.numel()} blocks")
    dev = layer.device
    keep, slots = p.rows.to(dev), p.slots.to(dev)
    qv = quantize_kv(value.index_select(0, keep), "int4", group_size=layer.group_size)
    layer.v.view(-1, *layer.v.shape[2:])[slots] = qv.data
    layer.v_scale.view(-1, *layer.v_scale.shape[2:])[slots] = qv.scale
    layer.v_zero.view(-1, *layer.v_zero.shape[2:])[slots] = qv.zero
    kd = key.index_select(0, keep).to(layer.dtype)  # K rounded to the model dtype: what staging holds and sealing quantizes
    if bool(p.seal.any()):
        _seal(layer, p, kd)  # first: it may free slots that the open blocks take
    if not bool(p.seal.all()):
        _stage(layer, p, kd)


def _seal(layer: KVCacheLayer, p: _WritePlan, kd: torch.Tensor) -> None:
    """Invariant 2: quantize each block whose last offset this write stores; release its slot."""
    pool, bs, dev = layer.staging, layer.block_size, layer.device
    sb = p.blocks[p.seal]
    buf = torch.zeros(sb.numel(), bs, *kd.shape[1:], dtype=layer.dtype, device=dev)
    from_stage = (p.staged & ~p.has0)[p.seal]
    from_codes = (~p.staged & ~p.has0)[p.seal]
    if bool(from_stage.any()):
        buf[host_indices(from_stage, dev)] = pool.k[p.old[p.seal][from_stage].to(dev)]
    if bool(from_codes.any()):
        buf[host_indices(from_codes, dev)] = _seed(layer, sb[from_codes].to(dev))
    tok = p.seal[p.inv]
    pos = torch.cumsum(p.seal.long(), 0) - 1  # a block's index among the sealed ones
    buf.view(-1, *kd.shape[1:])[(pos[p.inv[tok]] * bs + p.offs[tok]).to(dev)] = kd[host_indices(tok, dev)]
    codes, s, z = quantize_k_blocks(buf.float())
    sbd = sb.to(dev)
    layer.k[sbd], layer.k_scale[sbd], layer.k_zero[sbd] = codes, s, z
    pool.unassign(p.blocks[p.seal & p.staged].tolist())


def _stage(layer: KVCacheLayer, p: _WritePlan, kd: torch.Tensor) -> None:
    """Invariant 3: give the blocks left open a slot (zeroed or seeded) and store their rows there."""
    pool, bs, dev = layer.staging, layer.block_size, layer.device
    opn = ~p.seal
    fresh = opn & ~p.staged
    pool.assign(p.blocks[fresh].tolist())
    slot = pool.slots_of(p.blocks)  # the new map; valid for the open blocks
    zero = opn & p.has0  # a new life
    if bool(zero.any()):
        pool.k[slot[zero].to(dev)] = 0
    seed = fresh & ~p.has0  # a sealed (or never written) block reopened past offset 0
    if bool(seed.any()):
        pool.k[slot[seed].to(dev)] = _seed(layer, p.blocks[seed].to(dev))
    tok = opn[p.inv]
    pool.k.view(-1, *kd.shape[1:])[(slot[p.inv[tok]] * bs + p.offs[tok]).to(dev)] = kd[host_indices(tok, dev)]


def gather_k(layer: KVCacheLayer, blocks: torch.Tensor) -> torch.Tensor:
    """Float32 K ``[*blocks.shape, BS, H, D]`` of block ids ``blocks`` (long, on the cache's device):
    staged blocks from staging, sealed ones dequantized (chosen per block with ``torch.where``)."""
    q = dequantize_k_blocks(take_blocks(layer.k, blocks), take_blocks(layer.k_scale, blocks),
                            take_blocks(layer.k_zero, blocks))
    pool = layer.staging
    if pool.num_slots == 0:
        return q
    st = take_blocks(pool.block_map, blocks).long()
    stg = take_blocks(pool.k, st.clamp(min=0)).float()
    return torch.where((st >= 0).view(*st.shape, 1, 1, 1), stg, q)


def plan_copy(layer: KVCacheLayer, m: torch.Tensor) -> Callable[[], None]:
    """Check a copy-on-write mapping (host int64 ``[n, 2]``) against ``layer``'s staging; return
    the commit that gives each destination its source's staging state (invariant 5)."""
    return plan_swap(layer, layer, m, "copy_blocks")


def plan_swap(src: KVCacheLayer, dst: KVCacheLayer, m: torch.Tensor, what: str = "swap_blocks") -> Callable[[], None]:
    """Like :func:`plan_copy` from ``src``'s pools into ``dst``'s (e.g. GPU -> CPU layer): the staging
    pool and, for split formats with a sink, the sink pool; both are checked before either commits."""
    if m.shape[0] != len(set(m[:, 1].tolist())):
        raise ShapeError(f"{what}: int4_kivi layers need distinct destination blocks in the mapping")
    commits = [plan_pool(getattr(src, name), getattr(dst, name), m, what) for name in ("staging", "sink")
               if getattr(src, name, None) is not None]

    def commit() -> None:
        for c in commits:
            c()

    return commit


def plan_pool(a, b, m: torch.Tensor, what: str) -> Callable[[], None]:
    """One pool's part of :func:`plan_swap` (``a``, ``b``: StagingPools; ``m`` host ``[n, 2]``)."""
    s_old = a.slots_of(m[:, 0])
    d_old = b.slots_of(m[:, 1])
    staged, d_staged = s_old >= 0, d_old >= 0
    need = int((staged & ~d_staged).sum())
    if not b.make_room(need - int((~staged & d_staged).sum())):
        raise b.exhausted(need, f"{what} of {m.shape[0]} blocks")

    def commit() -> None:
        src_rows = s_old[staged].to(a.k.device)
        content = [t[src_rows].to(b.k.device) for t in a.tensors()]  # all sources read first (a copy)
        b.unassign(m[:, 1][~staged].tolist())
        b.assign(m[:, 1][staged & ~d_staged].tolist())
        if src_rows.numel():
            dst = b.slots_of(m[:, 1][staged]).to(b.k.device)
            for t, c in zip(b.tensors(), content):
                t[dst] = c

    return commit


def release(layer: KVCacheLayer, block_ids) -> None:
    """Free the staging slots of ``block_ids`` (blocks the KV manager freed); unstaged ids are skipped."""
    ids = torch.as_tensor(block_ids, dtype=torch.long).reshape(-1).cpu()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= layer.num_blocks):
        raise ShapeError(f"release_blocks ids must lie in [0, {layer.num_blocks}), "
                         f"got [{int(ids.min())}, {int(ids.max())}]")
    for pool in (layer.staging, getattr(layer, "sink", None)):
        if pool is not None:
            pool.unassign(ids.tolist())
