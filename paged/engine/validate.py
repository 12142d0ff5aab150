"""Type and range checks of ``EngineConfig`` (before any model is loaded), and the split of a
KV memory budget into blocks (and int4_kivi staging slots).

One rule (``paged.checks``): integers are ``numbers.Integral`` but not ``bool``, flags are
``bool``, real numbers finite. Integer fields given as numpy integers become ints.
"""
from __future__ import annotations

from typing import Any

import torch

from paged.checks import need_flag, need_int, need_real
from paged.errors import ConfigError
from .kv_sharing import check_share_map
from .swap import COMPRESSIONS as SWAP_COMPRESSIONS, MODES as SWAP_MODES

# name -> (minimum, optional) for integer fields
_INTS = {"block_size": (1, False), "num_blocks": (1, True), "kv_cache_memory": (1, True),
         "max_num_batched_tokens": (1, True), "max_num_seqs": (1, False), "num_cpu_blocks": (0, True),
         "max_model_len": (1, True), "seed": (None, False)}
_FLAGS = ("enable_block_compaction", "compaction_drop_cached", "enable_prefix_caching", "enable_chunked_prefill",
          "split_prefill_decode", "record_events",
          "enable_host_tier")
_CHOICES = {"preemption_mode": ("recompute", "swap"), "policy": ("fcfs", "priority"),
            "swap_mode": SWAP_MODES, "swap_compression": SWAP_COMPRESSIONS}


def check_engine_config(c: Any) -> None:
    """Raise ConfigError naming the first bad field of ``c`` (an ``EngineConfig``) and its value."""
    def bad(msg: str) -> ConfigError:
        return ConfigError(f"EngineConfig: {msg}")
    hints = {"block_size": "a power of two such as 16", "kv_cache_memory": "bytes, e.g. 1 << 30 for 1 GiB",
             "seed": "e.g. seed=0"}
    for name, (minimum, optional) in _INTS.items():
        setattr(c, name, need_int(name, getattr(c, name), bad, minimum=minimum, optional=optional,
                                  hint=hints.get(name, "")))
    if c.block_size & (c.block_size - 1):
        raise bad(f"block_size must be a power of two (1, 2, 4, ..., 16, ...), got {c.block_size!r}")
    for name in _FLAGS:
        need_flag(name, getattr(c, name), bad)
    c.watermark = need_real("watermark", c.watermark, bad, minimum=0.0, maximum=1.0, open_max=True)
    c.host_tier_threshold = need_real("host_tier_threshold", c.host_tier_threshold, bad, minimum=0.0, maximum=1.0,
                                      open_min=True)
    for name in ("eviction", "host_eviction"):
        if not isinstance(getattr(c, name), str):
            raise bad(f"{name} must be a policy name such as 'lru' or 'score:decay=0.999', got {getattr(c, name)!r}")
    for name, choices in _CHOICES.items():
        if getattr(c, name) not in choices:
            raise bad(f"{name} must be one of {choices}, got {getattr(c, name)!r}")
    if not isinstance(c.kv_cache_dtype, str):
        raise bad(f"kv_cache_dtype must be a format name such as 'auto', 'int8' or 'int4', got {c.kv_cache_dtype!r}")
    if c.attention_backend is not None and not isinstance(c.attention_backend, str):
        raise bad(f"attention_backend must be None or a backend name, got {c.attention_backend!r}")
    c.kv_share_with = check_share_map(getattr(c, "kv_share_with", None))  # ranges: once the model is known
    _check_split_format(c, bad)


def _check_split_format(c: Any, bad) -> None:
    """A split format with a sink or window reads a sequence's recent (and first) tokens from exact
    copies that a block reused from the prefix cache no longer has: it needs prefix caching off."""
    from paged._kernels import kernels
    try:
        fmt = kernels.get_format(c.kv_cache_dtype)
    except kernels.KernelError:
        return  # unknown names are reported where the cache is sized
    if fmt.split and (fmt.sink or fmt.window) and c.enable_prefix_caching:
        raise bad(f"kv_cache_dtype {c.kv_cache_dtype!r} reads its sink/window tokens from exact copies that a "
                  "block taken from the prefix cache does not keep; pass enable_prefix_caching=False")


def fit_budget(budget: int, block_bytes: int, mcfg, c, dtype: torch.dtype,
               num_layers: int | None = None) -> tuple[int, int | None]:
    """Blocks (and int4_kivi staging slots) that fit ``budget`` bytes together. The staging pool
    (K of unfilled blocks in ``dtype``, one slot per running sequence + 16, at most one per block,
    plus a 4-byte block map) is counted inside the budget and does not grow. ``num_layers``: the
    layers that own a cache (all of ``mcfg``'s by default; fewer with ``kv_share_with``)."""
    from paged._kernels import kernels
    fmt = kernels.get_format(c.kv_cache_dtype, dtype)
    if not fmt.staged:
        return int(budget // block_bytes), None
    layers = num_layers or mcfg.num_layers
    per_block = block_bytes + 4 * layers
    slot = layers * c.block_size * mcfg.num_kv_heads * mcfg.head_dim * dtype.itemsize
    cap = c.max_num_seqs + 16
    if fmt.split:  # fp16 rows of K (and V with a sink/window); a window also stages one step's new blocks
        from kernels.format_table import staging_tokens_per_seq
        rows = c.block_size + fmt.sink  # a staging slot, and a sink-pool slot of `sink` rows beside it
        slot = layers * rows * mcfg.num_kv_heads * mcfg.head_dim * 2 * (2 if fmt.sink or fmt.window else 1)
        per_seq = staging_tokens_per_seq(fmt, c.block_size) // c.block_size
        step = -(-(c.max_num_batched_tokens or 2048) // c.block_size) + c.max_num_seqs if fmt.window else 0
        cap = c.max_num_seqs * per_seq + step + 16
    n = int(budget // (per_block + slot))     # few blocks: one staging slot each
    if n > cap:
        n = int(max(0, budget - cap * slot) // per_block)
    return n, min(n, cap)
