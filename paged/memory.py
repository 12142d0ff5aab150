"""What a run's KV cache costs and how long its steps take, read the same way for both executors.

- ``memory_facts(x)``: for an ``LLM``, an ``LLMEngine`` or a ``Simulator``, the pool (blocks,
  tokens, bytes per token of one block) and, for the engine, the bytes it really allocated: the
  blocks plus the staging rows of a staged format (``int4_kivi``, the split ``kvq*`` formats),
  whose share is what makes a small format hold few tokens at a large ``max_num_seqs``.
- ``step_times(steps)``: a step frame (``paged.telemetry.STEP_COLUMNS``; ``SimResult.steps``,
  ``Run.steps_frame()``) summarized by kind: ``prefill`` (prefill tokens only), ``decode``
  (decode tokens only), ``mixed`` (both), each with its count and step-time statistics in seconds.

Invariants: ``pool_tokens == num_blocks * block_size``; ``cache_bytes == pool_bytes + staging_bytes``;
``bytes_per_token == block_bytes / block_size``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import pandas as pd

from paged.errors import ConfigError

__all__ = ["MemoryFacts", "STEP_KINDS", "memory_facts", "step_kind", "step_times"]

STEP_KINDS = ("prefill", "decode", "mixed")


@dataclass(frozen=True)
class MemoryFacts:
    """One executor's KV cache, in bytes and tokens (see the module docstring)."""

    executor: str               # "engine" or "simulator"
    kv_cache_dtype: str         # the resolved format
    block_size: int
    num_blocks: int
    block_bytes: int            # one block, K and V of every owner layer
    staging_slots: int | None   # staged formats sized from a byte budget: the fixed staging pool
    cache_bytes: int            # everything the cache holds on the device (engine: as allocated)

    @property
    def pool_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes_per_token(self) -> float:
        """Bytes of one token in a block (codes, scales, zero points; all layers, K and V)."""
        return self.block_bytes / self.block_size

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def staging_bytes(self) -> int:
        """What the staging rows (and their block maps) cost beside the blocks."""
        return self.cache_bytes - self.pool_bytes

    @property
    def cache_bytes_per_pool_token(self) -> float:
        """Every cache byte over the tokens the pool holds (staging included)."""
        return self.cache_bytes / self.pool_tokens

    def as_dict(self) -> dict[str, Any]:
        """The fields and the derived facts, one flat dict (a table row)."""
        return {**asdict(self), "pool_tokens": self.pool_tokens, "bytes_per_token": self.bytes_per_token,
                "pool_bytes": self.pool_bytes, "staging_bytes": self.staging_bytes,
                "cache_bytes_per_pool_token": self.cache_bytes_per_pool_token}


def memory_facts(x: Any) -> MemoryFacts:
    """The ``MemoryFacts`` of an ``LLM``, ``LLMEngine`` or ``Simulator``."""
    engine = getattr(x, "engine", x)
    sizing = getattr(engine, "sizing", None)
    if sizing is not None and hasattr(engine, "runner"):  # the torch engine
        return MemoryFacts("engine", sizing.kv_cache_dtype, engine.config.block_size, sizing.num_blocks,
                           sizing.block_bytes, sizing.num_staging_blocks, int(engine.runner.cache_bytes()))
    if sizing is not None and hasattr(x, "block_bytes"):  # the simulator: blocks only, no staging modelled
        block = int(x.block_bytes)
        return MemoryFacts("simulator", x.kv_format.name, x.config.block_size, x.num_blocks, block, None,
                           x.num_blocks * block)
    raise ConfigError(f"memory_facts takes an LLM, an LLMEngine or a Simulator, got {type(x).__name__}")


def step_kind(num_prefill_tokens: int, num_decode_tokens: int) -> str:
    """'prefill', 'decode', 'mixed', or 'idle' (a step that computed no token)."""
    if num_prefill_tokens and num_decode_tokens:
        return "mixed"
    return "prefill" if num_prefill_tokens else "decode" if num_decode_tokens else "idle"


def step_times(steps: pd.DataFrame) -> pd.DataFrame:
    """One row per kind in ``STEP_KINDS`` (a kind no step had: count 0, times NaN): ``steps``,
    ``tokens`` (computed), ``mean_s``, ``p50_s``, ``p99_s``, ``total_s`` of ``step_time_s``."""
    need = {"num_prefill_tokens", "num_decode_tokens", "step_time_s"}
    if not need <= set(steps.columns):
        raise ConfigError(f"step_times needs a step frame with {sorted(need)} (paged.telemetry.STEP_COLUMNS); "
                          f"missing {sorted(need - set(steps.columns))}")
    kind = [step_kind(p, d) for p, d in zip(steps["num_prefill_tokens"], steps["num_decode_tokens"])]
    rows = []
    for k in STEP_KINDS:
        sel = steps[[x == k for x in kind]]
        t = sel["step_time_s"].astype(float)
        rows.append({"kind": k, "steps": len(sel),
                     "tokens": int((sel["num_prefill_tokens"] + sel["num_decode_tokens"]).sum()),
                     "mean_s": t.mean(), "p50_s": t.quantile(0.5), "p99_s": t.quantile(0.99), "total_s": t.sum()})
    return pd.DataFrame(rows)
