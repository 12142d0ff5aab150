"""What one step computes, as the cost model reads it: per scheduled chunk, its new tokens and the
cached context before it, plus the step's sampled tokens and swapped/copied bytes.

``plan_shape`` builds a ``StepShape`` from a plan's ``Batch`` columns (the simulator's hot path),
``step_shape`` from chunk views (``ScheduledChunk``: a plan's or an engine step's ``scheduled``);
both give the same shape for the same step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from paged.core.plan import Batch
from paged.errors import ConfigError

__all__ = ["StepShape", "step_shape", "plan_shape"]


@dataclass(slots=True)
class StepShape:
    """What a step computes: per chunk new tokens ``q`` and cached context ``ctx`` before it."""

    q: np.ndarray
    ctx: np.ndarray
    num_sampled: int = 0
    swap_bytes: float = 0.0
    copy_bytes: float = 0.0

    @classmethod
    def make(cls, q: Sequence[int], ctx: Sequence[int], num_sampled: int | None = None,
             swap_bytes: float = 0.0, copy_bytes: float = 0.0) -> "StepShape":
        qa = np.asarray(q, dtype=np.float64)
        ca = np.asarray(ctx, dtype=np.float64)
        if qa.shape != ca.shape:
            raise ConfigError(f"q and ctx must have the same length, got {qa.shape} and {ca.shape}")
        return cls(qa, ca, len(qa) if num_sampled is None else num_sampled, swap_bytes, copy_bytes)

    @property
    def num_tokens(self) -> int:
        return int(self.q.sum())

    @property
    def num_seqs(self) -> int:
        return len(self.q)


def step_shape(chunks: Sequence[Any], num_swapped_blocks: int = 0, num_copied_blocks: int = 0,
               block_bytes: float = 0.0) -> StepShape:
    """The ``StepShape`` of one step from its chunks (anything with ``num_tokens``, ``start``,
    ``samples``: ``ScheduledChunk`` views); swapped and copied blocks are priced at ``block_bytes``
    each (``shapes_from_steps`` builds its shapes here)."""
    return StepShape(np.array([c.num_tokens for c in chunks], dtype=np.float64),
                     np.array([c.start for c in chunks], dtype=np.float64),
                     [c.samples for c in chunks].count(True), num_swapped_blocks * block_bytes,
                     num_copied_blocks * block_bytes)


def plan_shape(batch: Batch, num_swapped_blocks: int = 0, num_copied_blocks: int = 0,
               block_bytes: float = 0.0) -> StepShape:
    """``step_shape(plan.scheduled, ...)`` read from the plan's ``batch`` columns (see the module doc)."""
    return StepShape(np.array(batch.num_tokens, dtype=np.float64), np.array(batch.starts, dtype=np.float64),
                     batch.num_sampled, num_swapped_blocks * block_bytes, num_copied_blocks * block_bytes)
