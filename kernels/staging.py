"""``StagingPool``: exact rows of the blocks a quantized layer still reads exactly.

``int4_kivi``: K (model dtype) of the blocks that are not full. Split formats
(:mod:`kernels.split`): fp16 K of the blocks whose keys are not sealed yet and, with a sink or a
window, fp16 K and V (``v``) of the blocks a query may still read exactly.

Invariants (checked by :meth:`StagingPool.check`, kept by every method):

* ``block_map`` (int32 ``[num_blocks]``, on the cache's device) maps a block to its staging slot,
  or -1. ``map_host`` is an identical CPU copy that the host reads for bookkeeping, so no method
  reads the device map back (no host sync).
* A slot belongs to at most one block; ``free`` holds exactly the slots no block maps to.
* Slot ``s`` owns rows ``k[s]`` (and ``v[s]`` when the pool keeps values) ``[block_size,
  num_kv_heads, head_dim]`` in ``dtype`` (``k_bits``/``v_bits`` 16), or, for a side of ``b < 16``
  bits (split formats' ``@krows<b>``/``@vrows<b>``), ``[block_size, num_kv_heads, b * head_dim / 8]``
  uint8 codes with ``k_scale[s]``/``v_scale[s]`` fp16 ``[block_size, num_kv_heads]``: symmetric rows
  (:func:`kernels.split_codec.row_quantize`). Read and write rows through :meth:`StagingPool.read`
  and :meth:`StagingPool.write`, which hide the difference.

Every method that may need slots first counts them (:meth:`StagingPool.make_room`) and raises
:class:`~kernels.errors.StagingExhaustedError` before changing anything. A pool made with
``growable=True`` first grows instead (at least doubling, never past one slot per block, the
most that can ever be staged); growing only adds free slots.
"""

from __future__ import annotations

import torch

from .errors import ShapeError, StagingExhaustedError
from .split_codec import row_dequantize, row_quantize

__all__ = ["StagingPool", "default_num_staging_blocks"]


def default_num_staging_blocks(num_blocks: int) -> int:
    """``min(num_blocks, 256)``: one unfilled block per running request for up to 256 requests."""
    return min(int(num_blocks), 256)


class StagingPool:
    """Fixed pool of ``num_slots`` staging blocks plus the block -> slot map."""

    __slots__ = ("k", "v", "k_scale", "v_scale", "k_bits", "v_bits", "head_dim", "block_map", "map_host", "free",
                 "growable")

    def __init__(self, num_blocks: int, num_slots: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, *, growable: bool = False, values: bool = False,
                 k_bits: int = 16, v_bits: int = 16) -> None:
        if int(num_slots) < 0:
            raise ShapeError(f"num_staging_blocks must be >= 0, got {num_slots}")
        self.growable, self.head_dim, self.k_bits, self.v_bits = growable, head_dim, k_bits, v_bits
        lead = (int(num_slots), block_size, num_kv_heads)
        self.k, self.k_scale = self._rows(lead, head_dim, k_bits, dtype, device)
        self.v, self.v_scale = self._rows(lead, head_dim, v_bits, dtype, device) if values else (None, None)
        self.block_map = torch.full((num_blocks,), -1, dtype=torch.int32, device=device)
        self.map_host = torch.full((num_blocks,), -1, dtype=torch.int32)
        self.free: list[int] = list(range(int(num_slots) - 1, -1, -1))  # pop() hands out slot 0 first

    @staticmethod
    def _rows(lead: tuple, head_dim: int, bits: int, dtype: torch.dtype, device) -> tuple:
        if bits >= 16:
            return torch.zeros(*lead, head_dim, dtype=dtype, device=device), None
        return (torch.zeros(*lead, bits * head_dim // 8, dtype=torch.uint8, device=device),
                torch.zeros(lead, dtype=torch.float16, device=device))

    @property
    def num_slots(self) -> int:
        return self.k.shape[0]

    @property
    def row_shape(self) -> tuple[int, int, int]:
        """``(rows per slot, num_kv_heads, head_dim)`` of the values the slots hold."""
        return (*self.k.shape[1:3], self.head_dim)

    def tensors(self) -> list[torch.Tensor]:
        """Every per-slot tensor (codes and scales), in a fixed order."""
        return [t for t in (self.k, self.k_scale, self.v, self.v_scale) if t is not None]

    def _side(self, side: str) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        return (self.k, self.k_scale, self.k_bits) if side == "k" else (self.v, self.v_scale, self.v_bits)

    def read(self, side: str, slots: torch.Tensor) -> torch.Tensor:
        """Float32 rows ``[n, rows, H, D]`` of ``side`` (``"k"``/``"v"``) in ``slots`` (long, on the
        pool's device)."""
        data, scale, bits = self._side(side)
        if scale is None:
            return data.index_select(0, slots).float()
        return row_dequantize(data.index_select(0, slots), scale.index_select(0, slots), bits, self.head_dim)

    def write(self, side: str, rows: torch.Tensor, x: torch.Tensor) -> None:
        """Store ``x`` ``[n, H, D]`` at flat row indices ``rows`` (``slot * rows_per_slot + offset``)."""
        data, scale, bits = self._side(side)
        if scale is None:
            data.view(-1, *data.shape[2:])[rows] = x.to(data.dtype)
            return
        codes, s = row_quantize(x, bits)
        data.view(-1, *data.shape[2:])[rows] = codes
        scale.view(-1, scale.shape[2])[rows] = s

    def write_slots(self, side: str, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Store whole slots: ``x`` ``[n, rows, H, D]`` into ``slots`` (long, on the pool's device)."""
        per = self.k.shape[1]
        rows = (slots[:, None] * per + torch.arange(per, device=slots.device)).reshape(-1)
        self.write(side, rows, x.reshape(-1, *x.shape[2:]))

    def zero(self, slots: torch.Tensor) -> None:
        """Clear every row of ``slots`` (they read as 0)."""
        for t in self.tensors():
            t[slots] = 0

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self.free)

    def nbytes(self) -> int:
        """Bytes of the staging rows and the device map (the host mirror is not counted)."""
        return sum(t.numel() * t.element_size() for t in self.tensors()) + self.block_map.numel() * 4

    def make_room(self, needed: int) -> bool:
        """Whether ``needed`` slots are free, after growing the pool if it may grow."""
        short = needed - len(self.free)
        if short <= 0:
            return True
        old, cap = self.num_slots, self.block_map.numel()
        if not self.growable or old + short > cap:
            return False
        new = min(cap, max(old + short, 2 * old))
        for name in ("k", "k_scale", "v", "v_scale"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, torch.cat([t, t.new_zeros(new - old, *t.shape[1:])]))
        self.free[:0] = range(new - 1, old - 1, -1)  # free slots already listed are handed out first
        return True

    def exhausted(self, needed: int, what: str) -> StagingExhaustedError:
        return StagingExhaustedError(
            f"the staging pool is full: {what} needs {needed} free slot(s), {len(self.free)} of "
            f"{self.num_slots} are free. Allocate the layer with a larger num_staging_blocks= (at least the "
            f"number of blocks that are not full at once, about one per running request), or call "
            f"kernels.release_blocks(layer, ids) for blocks the KV manager freed")

    def slots_of(self, blocks: torch.Tensor) -> torch.Tensor:
        """Host int64 slots (-1: not staged) of host block ids."""
        return self.map_host[blocks.long()].long()

    def assign(self, blocks: list[int]) -> None:
        """Give each (unstaged, distinct) block a free slot; the caller has checked the count."""
        self._set(blocks, [self.free.pop() for _ in blocks])

    def unassign(self, blocks: list[int]) -> None:
        """Return the slots of the staged blocks among ``blocks`` to the free list (others are skipped)."""
        idx = torch.tensor(list(dict.fromkeys(blocks)), dtype=torch.long)  # one lookup, not one per block
        slots = self.map_host[idx]
        staged = slots >= 0
        if not bool(staged.any()):
            return
        blocks = idx[staged].tolist()
        self.free.extend(slots[staged].tolist())
        self._set(blocks, [-1] * len(blocks))

    def _set(self, blocks: list[int], slots: list[int]) -> None:
        if not blocks:
            return
        idx = torch.tensor(blocks, dtype=torch.long)
        val = torch.tensor(slots, dtype=torch.int32)
        self.map_host[idx] = val
        self.block_map[idx.to(self.block_map.device)] = val.to(self.block_map.device)

    def check(self) -> None:
        """Assert the invariants above (tests; costs a device sync)."""
        used = self.map_host[self.map_host >= 0].tolist()
        assert len(used) == len(set(used)), "a staging slot is mapped from two blocks"
        assert set(used).isdisjoint(self.free) and len(used) + len(self.free) == self.num_slots
        assert len(set(self.free)) == len(self.free)
        assert torch.equal(self.block_map.cpu(), self.map_host), "device map differs from its host mirror"
