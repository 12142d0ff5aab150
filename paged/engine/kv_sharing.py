"""Cross-layer KV sharing: a shared layer attends over another layer's K/V cache.

``EngineConfig.kv_share_with = {i: j}`` (a ``CacheConfig`` knob) (the seed's ``layers: - index: 1, kv_cache:
share_with=0``) makes layer ``i`` read layer ``j``'s paged cache: the runner allocates cache
layers only for *owner* layers (those not in the map), the byte budget counts only owners (so
``kv_cache_memory_bytes`` buys ``num_layers / num_owners`` times as many blocks), and the
attention call of a shared layer writes nothing and attends with its own queries over the owner's keys
and values. This is Cross-Layer Attention (CLA; Brandon et al. 2024), which trains models with
the sharing in place; applied to a pretrained model it changes the function (see
:mod:`paged.studies.sharing` for the measured cost).

A shared layer's own K/V projections are computed and ignored: the model fuses q/k/v into one
matmul and knows nothing of the cache layout, so dropping them would need a per-layer model
change for a compute-only saving (memory is what sharing is for).

Invariants of a valid map: keys and values are layer indices in ``[0, num_layers)``; ``j < i``
(the owner runs first in the forward pass, so this step's tokens are in its cache when layer
``i`` reads them); an owner is never itself shared (no chains: every shared layer names the
layer that holds the cache).
"""
from __future__ import annotations

from typing import Mapping

from paged.core.config import check_share_map  # the map's one check (types, order; ranges given num_layers)

__all__ = ["check_share_map", "owner_layers", "cache_index"]


def owner_layers(share: Mapping[int, int] | None, num_layers: int) -> list[int]:
    """The layers that own a cache (not in ``share``), ascending; all layers without sharing."""
    return [i for i in range(num_layers) if not share or i not in share]


def cache_index(share: Mapping[int, int] | None, num_layers: int) -> list[int]:
    """For each model layer, the index of the cache layer it reads among the owners' caches
    (``owner_layers`` order): the identity without sharing."""
    pos = {layer: k for k, layer in enumerate(owner_layers(share, num_layers))}
    return [pos[(share or {}).get(i, i)] for i in range(num_layers)]
