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
  num_kv_heads, head_dim]``.

Every method that may need slots first counts them (:meth:`StagingPool.make_room`) and raises
:class:`~kernels.errors.StagingExhaustedError` before changing anything. A pool made with
``growable=True`` first grows instead (at least doubling, never past one slot per block, the
most that can ever be staged); growing only adds free slots.
"""

from __future__ import annotations

import torch

from .errors import ShapeError, StagingExhaustedError

__all__ = ["StagingPool", "default_num_staging_blocks"]


def default_num_staging_blocks(num_blocks: int) -> int:
    """``min(num_blocks, 256)``: one unfilled block per running request for up to 256 requests."""
    return min(int(num_blocks), 256)


class StagingPool:
    """Fixed pool of ``num_slots`` staging blocks plus the block -> slot map."""

    __slots__ = ("k", "v", "block_map", "map_host", "free", "growable")

    def __init__(self, num_blocks: int, num_slots: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, *, growable: bool = False, values: bool = False) -> None:
        if int(num_slots) < 0:
            raise ShapeError(f"num_staging_blocks must be >= 0, got {num_slots}")
        self.growable = growable
        self.k = torch.zeros(int(num_slots), block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k) if values else None
        self.block_map = torch.full((num_blocks,), -1, dtype=torch.int32, device=device)
        self.map_host = torch.full((num_blocks,), -1, dtype=torch.int32)
        self.free: list[int] = list(range(int(num_slots) - 1, -1, -1))  # pop() hands out slot 0 first

    @property
    def num_slots(self) -> int:
        return self.k.shape[0]

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self.free)

    def nbytes(self) -> int:
        """Bytes of the staging rows and the device map (the host mirror is not counted)."""
        rows = self.k.numel() * self.k.element_size() * (2 if self.v is not None else 1)
        return rows + self.block_map.numel() * 4

    def make_room(self, needed: int) -> bool:
        """Whether ``needed`` slots are free, after growing the pool if it may grow."""
        short = needed - len(self.free)
        if short <= 0:
            return True
        old, cap = self.num_slots, self.block_map.numel()
        if not self.growable or old + short > cap:
            return False
        new = min(cap, max(old + short, 2 * old))
        extra = torch.zeros(new - old, *self.k.shape[1:], dtype=self.k.dtype, device=self.k.device)
        self.k = torch.cat([self.k, extra])
        if self.v is not None:
            self.v = torch.cat([self.v, extra])
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
