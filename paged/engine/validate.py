"""Type and range checks of ``EngineConfig`` (before any model is loaded).

One rule (``paged.checks``): integers are ``numbers.Integral`` but not ``bool``, flags are
``bool``, real numbers finite. Integer fields given as numpy integers become ints.
"""
from __future__ import annotations

from typing import Any

from paged.checks import need_flag, need_int, need_real
from paged.errors import ConfigError

# name -> (minimum, optional) for integer fields
_INTS = {"block_size": (1, False), "num_blocks": (1, True), "kv_cache_memory": (1, True),
         "max_num_batched_tokens": (1, True), "max_num_seqs": (1, False), "num_cpu_blocks": (0, True),
         "max_model_len": (1, True), "seed": (None, False)}
_FLAGS = ("enable_prefix_caching", "enable_chunked_prefill", "split_prefill_decode", "record_events")
_CHOICES = {"preemption_mode": ("recompute", "swap"), "policy": ("fcfs", "priority")}


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
    for name, choices in _CHOICES.items():
        if getattr(c, name) not in choices:
            raise bad(f"{name} must be one of {choices}, got {getattr(c, name)!r}")
    if not isinstance(c.kv_cache_dtype, str):
        raise bad(f"kv_cache_dtype must be a format name such as 'auto', 'int8' or 'int4', got {c.kv_cache_dtype!r}")
    if c.attention_backend is not None and not isinstance(c.attention_backend, str):
        raise bad(f"attention_backend must be None or a backend name, got {c.attention_backend!r}")
