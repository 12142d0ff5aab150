"""How large the engine's KV cache is: the KV format resolved once, bytes per block, GPU and CPU
blocks, int4_kivi staging slots and the longest request, from an ``EngineConfig`` and the model.

Invariants: ``num_blocks >= 1``; ``max_model_len <= num_blocks * block_size`` unless the user set
it (then ``<=`` the model's context); only the owner layers of ``kv_share_with`` cost bytes.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from paged._kernels import kernels
from paged.core.config import CacheConfig, check_share_map, cpu_pool_blocks
from paged.errors import ConfigError, PagedWarning
from paged.models.loader import LoadedModel

__all__ = ["CacheSizing", "allocation_error", "fit_budget", "kv_bytes_per_block", "size_cache"]

CPU_KV_BUDGET = 512 << 20
"""KV-cache bytes on CPU when neither num_blocks nor kv_cache_memory_bytes is given."""
GPU_FREE_SHARE = 0.4
"""Share of the free GPU memory the KV cache takes when neither is given."""


def kv_bytes_per_block(cfg, block_size: int, kv_cache_dtype: str, dtype: torch.dtype, num_layers: int = 0) -> int:
    """Bytes of one block (K and V of ``block_size`` tokens) over ``num_layers`` layers (all of
    ``cfg``'s when 0), as ``kernels.allocate_kv_cache`` lays it out."""
    try:
        return (num_layers or cfg.num_layers) * block_size * kernels.bytes_per_token(
            kv_cache_dtype, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, block_size=block_size)
    except kernels.KernelError as e:
        raise ConfigError(f"kv_cache_dtype {kv_cache_dtype!r}: {e}") from e


def fit_budget(budget: int, block_bytes: int, mcfg, cache: CacheConfig, max_num_seqs: int, fmt: kernels.KVFormat,
               dtype: torch.dtype, num_layers: int | None = None,
               max_num_batched_tokens: int | None = None) -> tuple[int, int | None, int]:
    """Blocks (and staging slots of a staged format) that fit ``budget`` bytes together. The staging
    pool (K of unfilled blocks in ``dtype``, one slot per running sequence + 16, at most one per
    block, plus a 4-byte block map) is counted inside the budget and does not grow. A split format
    stages fp16 rows of K (and V with a sink/window; ``@krows``/``@vrows``: codes and an fp16 scale
    per row) and a sink slot beside each; a window also
    stages its recent blocks and one step's new blocks. ``num_layers``: the layers that own a
    cache (all of ``mcfg``'s by default; fewer with ``kv_share_with``). Returns (blocks, staging
    slots or None, bytes of one staging slot and its block-map entry)."""
    if not fmt.staged:
        return int(budget // block_bytes), None, 0
    layers = num_layers or mcfg.num_layers
    bs = cache.block_size
    slot = layers * bs * mcfg.num_kv_heads * mcfg.head_dim * dtype.itemsize
    per_block = block_bytes + 4 * layers
    cap = max_num_seqs + 16
    if fmt.split:
        from kernels.format_table import staging_tokens_per_seq
        h, d = mcfg.num_kv_heads, mcfg.head_dim
        row = lambda bits: h * d * 2 if bits == 16 else h * (bits * d // 8 + 2)  # noqa: E731  fp16, or codes + scale
        slot = layers * (bs + fmt.sink) * (row(fmt.k_rows) + (row(fmt.v_rows) if fmt.sink or fmt.window else 0))
        step = -(-(max_num_batched_tokens or 2048) // bs) + max_num_seqs if fmt.window else 0
        cap = max_num_seqs * (staging_tokens_per_seq(fmt, bs) // bs) + step + 16
    n = int(budget // (per_block + slot))     # few blocks: one staging slot each
    if n > cap:
        n = int(max(0, budget - cap * slot) // per_block)
    return n, min(n, cap), slot + 4 * layers


@dataclass(frozen=True)
class CacheSizing:
    """The engine's cache, sized (see the module docstring)."""

    kv_cache_dtype: str          # the resolved format's name ('auto' replaced by the model's dtype)
    kv_share_with: dict[int, int] | None
    block_bytes: int             # one GPU block over the owner layers
    num_blocks: int
    num_staging_blocks: int | None  # int4_kivi's fixed staging pool when sized from a byte budget
    num_cpu_blocks: int
    max_model_len: int
    pool_limits_len: bool        # max_model_len was cut to the pool (then requests are checked against it)


def size_cache(config, loaded: LoadedModel, device: torch.device, dtype: torch.dtype) -> CacheSizing:
    """Size the KV cache of ``config`` (an ``EngineConfig``) for ``loaded`` on ``device``."""
    c, mcfg = config.cache, loaded.config
    try:  # the one resolution of the format ('auto': the model's dtype) on the engine path
        fmt = kernels.get_format(c.kv_cache_dtype, dtype)
    except kernels.KernelError as e:
        raise ConfigError(f"kv_cache_dtype {c.kv_cache_dtype!r} for a {dtype} model: {e}") from e
    if fmt.split and (fmt.sink or fmt.window) and c.enable_prefix_caching:
        raise ConfigError(f"kv_cache_dtype {c.kv_cache_dtype!r} reads its sink/window tokens from exact copies that "
                          "a block taken from the prefix cache does not keep; pass enable_prefix_caching=False")
    share = check_share_map(c.kv_share_with, mcfg.num_layers)
    n_cache = mcfg.num_layers - len(share or ())  # only the owner layers hold (and cost) a cache
    block_bytes = kv_bytes_per_block(mcfg, c.block_size, fmt.name, dtype, n_cache)
    num_blocks, num_staging = c.num_blocks, None
    if num_blocks is None:
        budget = c.kv_cache_memory_bytes
        if budget is None:
            budget = int(GPU_FREE_SHARE * torch.cuda.mem_get_info(device)[0]) if device.type == "cuda" \
                else CPU_KV_BUDGET
        num_blocks, num_staging, slot = fit_budget(budget, block_bytes, mcfg, c, config.max_num_seqs, fmt, dtype,
                                                   n_cache, config.max_num_batched_tokens)
        if num_staging and num_staging * slot > STAGING_WARN_SHARE * budget:
            _warn_staging(budget, num_blocks, num_staging * slot, block_bytes, mcfg, c, config, fmt, dtype, n_cache)
    if num_blocks < 1:
        raise ConfigError(f"the KV cache holds {num_blocks} blocks of {block_bytes} bytes; give "
                          "num_blocks >= 1 or a larger kv_cache_memory_bytes")
    max_len = min(loaded.max_model_len, num_blocks * c.block_size)
    wanted = config.max_model_len
    if wanted is not None:
        if wanted > loaded.max_model_len:
            raise ConfigError(f"max_model_len={wanted} exceeds the model's {loaded.max_model_len}; lower it")
        max_len = wanted
    num_cpu = cpu_pool_blocks(c, config.preemption_mode, num_blocks, block_bytes, default_swap_space_gib=None)
    return CacheSizing(fmt.name, share, block_bytes, num_blocks, num_staging, num_cpu, max_len,
                       pool_limits_len=wanted is None and max_len < loaded.max_model_len)


STAGING_WARN_SHARE = 0.5
"""A staged format whose staging rows take more than this share of the byte budget warns."""


def _warn_staging(budget: int, num_blocks: int, staging: int, block_bytes: int, mcfg, c: CacheConfig, config,
                  fmt, dtype: torch.dtype, n_cache: int) -> None:
    """PagedWarning: the staging rows of ``max_num_seqs`` sequences eat the budget, so a small
    format holds few tokens; names the ``max_num_seqs`` that gives the pool most of the budget.

    Why a warning and not a smaller default: ``max_num_seqs`` is the scheduler's concurrency
    (throughput, latency); changing it behind the user's back would change what they measure.
    The staging pool must hold one slot per running sequence, so it cannot shrink alone."""
    plain = int(budget // block_bytes)
    hint = ""
    for seqs in (128, 64, 32, 16, 8, 4):
        if seqs < config.max_num_seqs:
            n, slots, slot = fit_budget(budget, block_bytes, mcfg, c, seqs, fmt, dtype, n_cache,
                                        config.max_num_batched_tokens)
            if slots is not None and slots * slot <= 0.25 * budget:
                hint = f"max_num_seqs={seqs} gives {n:,} blocks ({n * c.block_size:,} tokens); "
                break
    warnings.warn(
        f"kv_cache_dtype {fmt.name!r}: the staging rows of max_num_seqs={config.max_num_seqs} sequences take "
        f"{staging / 2**20:,.0f} MiB of the {budget / 2**20:,.0f} MiB KV budget, so the pool holds only "
        f"{num_blocks:,} blocks ({num_blocks * c.block_size:,} tokens; {budget / max(1, num_blocks * c.block_size):,.0f} "
        f"cache bytes per pool token) where its {block_bytes // c.block_size:,} B/token would fit {plain:,} blocks "
        f"without staging; {hint}or give num_blocks or a larger kv_cache_memory_bytes "
        "(paged.memory_facts(llm) shows the split)", PagedWarning, stacklevel=4)


def allocation_error(sizing: CacheSizing, device: torch.device, exc: BaseException) -> ConfigError | None:
    """The ConfigError for a cache that could not be allocated (None: ``exc`` is not about memory)."""
    if not isinstance(exc, MemoryError) and "memory" not in str(exc).lower() and "alloc" not in str(exc).lower():
        return None
    need = (sizing.num_blocks + sizing.num_cpu_blocks) * sizing.block_bytes
    return ConfigError(f"num_blocks={sizing.num_blocks} (+ num_cpu_blocks={sizing.num_cpu_blocks}) of "
                       f"{sizing.block_bytes:,} bytes need {need / 2**30:,.1f} GiB for the KV cache, which could "
                       f"not be allocated on {device}; lower num_blocks or give kv_cache_memory_bytes")
