"""The simulator's input side: a trace's rows as arrivals, and the synthetic prompts they get.

Prompts are seeded token ids. A row with content blocks (``block_hashes``) gets the tokens of its
blocks (``paged.sim.content_blocks.block_tokens``: equal block ids mean equal tokens, whatever the
arrival order). Otherwise requests with the same ``prefix_id`` share their first ``prefix_tokens``
ids (drawn from a generator of their own, so a shared prefix does not depend on arrival order),
and everything else comes from one generator over the vocabulary, in arrival order.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from paged.sim.content_blocks import BLOCK_COLUMN, SMALL_TOKEN_HI, block_tokens, content_block_size
from paged.sim.trace_files import normalize_trace

__all__ = ["Arrivals", "SyntheticPrompts", "trace_prompts"]


class SyntheticPrompts:
    """Seeded synthetic prompt token ids in ``[17, vocab_size)`` (content blocks: ``[17, 257)``);
    shared prefixes and equal content blocks are identical across requests."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        self.lo, self.hi = 17, max(vocab_size, 18)
        self.rng = np.random.default_rng(seed)
        self.seed = seed
        self.prefixes: dict[int, np.ndarray] = {}

    def prompt(self, n: int, prefix_id: int, prefix_tokens: int) -> list[int]:
        if prefix_id < 0 or prefix_tokens <= 0:
            return self.rng.integers(self.lo, self.hi, n).tolist()
        pre = self.prefixes.get(prefix_id)
        if pre is None or len(pre) < prefix_tokens:
            pre = np.random.default_rng([self.seed, 1 + prefix_id]).integers(self.lo, self.hi, max(prefix_tokens, 1))
            self.prefixes[prefix_id] = pre
        own = self.rng.integers(self.lo, self.hi, n - prefix_tokens)
        return np.concatenate([pre[:prefix_tokens], own]).tolist()

    def from_blocks(self, ids: np.ndarray, n: int, block_size: int) -> list[int]:
        """The ``n`` tokens of content blocks ``ids`` of ``block_size`` tokens each, in
        ``[17, min(vocab_size, 257))`` (small ints: see ``paged.sim.content_blocks``)."""
        hi = min(self.hi, SMALL_TOKEN_HI)
        return block_tokens(ids, n, block_size, seed=self.seed, lo=self.lo, hi=hi).tolist()


class Arrivals:
    """The trace's rows in arrival order, as numpy columns, and the next one to add."""

    __slots__ = ("time", "prompt", "output", "prefix_id", "prefix_tokens", "priority", "blocks",
                 "block_size", "n", "next")

    def __init__(self, tr: pd.DataFrame) -> None:
        self.time = tr["arrival_time"].to_numpy(dtype=np.float64)
        self.prompt = tr["prompt_tokens"].to_numpy()
        self.output = tr["output_tokens"].to_numpy()
        self.prefix_id = tr["prefix_id"].to_numpy()
        self.prefix_tokens = tr["prefix_tokens"].to_numpy()
        self.priority = tr["priority"].to_numpy() if "priority" in tr.columns else None
        self.blocks = tr[BLOCK_COLUMN].to_numpy() if BLOCK_COLUMN in tr.columns else None
        self.block_size = content_block_size(tr) if self.blocks is not None else 0
        self.n = len(tr)
        self.next = 0

    def prompt_ids(self, i: int, toks: SyntheticPrompts) -> list[int]:
        """Row ``i``'s prompt token ids: from its content blocks, else from its shared prefix."""
        if self.blocks is not None:
            return toks.from_blocks(self.blocks[i], int(self.prompt[i]), self.block_size)
        return toks.prompt(int(self.prompt[i]), int(self.prefix_id[i]), int(self.prefix_tokens[i]))

    def clock_after_idle(self, clock: float) -> float | None:
        """The clock moved to the next arrival (None: no arrival is pending)."""
        return max(clock, float(self.time[self.next])) if self.next < self.n else None


def trace_prompts(trace: pd.DataFrame, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Every row's prompt token ids, in arrival order, exactly as the simulator makes them with
    ``seed``: what the torch engine is given (``engine.add_request(rid, ids, ...)``) to replay a
    trace's content, e.g. a Mooncake trace's shared blocks, on a real model."""
    arrivals = Arrivals(normalize_trace(trace))
    toks = SyntheticPrompts(vocab_size, seed)
    return [arrivals.prompt_ids(i, toks) for i in range(arrivals.n)]
