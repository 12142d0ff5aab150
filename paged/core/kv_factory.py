"""``build_kv_manager``: the one place a KV cache is built from a ``CacheConfig`` (both executors call it)."""
from __future__ import annotations

from . import events as ev
from .config import CacheConfig
from .hybrid_manager import HybridKVCacheManager
from .kv_cache import KVCache
from .kv_groups import KVLayout
from .kv_manager import KVCacheManager

__all__ = ["build_kv_manager"]


def build_kv_manager(cache: CacheConfig, num_blocks: int, *, num_cpu_blocks: int, max_model_len: int,
                     recorder: ev.Recorder | None = None, layout: KVLayout | None = None) -> KVCache:
    """The KV-cache manager of ``cache`` over ``num_blocks`` GPU and ``num_cpu_blocks`` CPU blocks
    (the one place both executors build theirs); a hybrid ``layout`` (several KV-cache groups:
    sliding windows, state layers) gets the ``HybridKVCacheManager`` over its pages."""
    settings = dict(enable_prefix_caching=cache.enable_prefix_caching, hash_fn=cache.hash_fn,
                    eviction=cache.eviction, num_cpu_blocks=num_cpu_blocks, max_model_len=max_model_len,
                    recorder=recorder, enable_host_tier=cache.enable_host_tier,
                    host_tier_threshold=cache.host_tier_threshold)
    if layout is not None and layout.is_hybrid:
        return HybridKVCacheManager(num_blocks, layout, **settings)
    return KVCacheManager(num_blocks, cache.block_size, host_eviction=cache.host_eviction, **settings)
