"""Cross-layer KV sharing: a shared layer attends over another layer's K/V cache.

``EngineConfig.kv_share_with = {i: j}`` (the seed's ``layers: - index: 1, kv_cache:
share_with=0``) makes layer ``i`` read layer ``j``'s paged cache: the runner allocates cache
layers only for *owner* layers (those not in the map), the byte budget counts only owners (so
``kv_cache_memory`` buys ``num_layers / num_owners`` times as many blocks), and the attention
call of a shared layer writes nothing and attends with its own queries over the owner's keys
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

import operator
from typing import Mapping

from paged.errors import ConfigError

__all__ = ["check_share_map", "owner_layers", "cache_index"]


def check_share_map(share: Mapping[int, int] | None, num_layers: int | None = None) -> dict[int, int] | None:
    """The map as ``{shared: owner}`` of ints (None when empty or None), or ConfigError saying
    what to change. Without ``num_layers`` only types and the order rules are checked (the
    engine checks ranges once the model is known)."""
    if share is None:
        return None
    if not isinstance(share, Mapping):
        raise ConfigError(f"EngineConfig: kv_share_with must be None or a dict {{layer: owner layer}} such as "
                          f"{{1: 0}}, got {type(share).__name__} {str(share)[:60]}")
    out: dict[int, int] = {}
    for i, j in share.items():
        try:
            if isinstance(i, bool) or isinstance(j, bool):
                raise TypeError
            i, j = operator.index(i), operator.index(j)
        except TypeError:
            raise ConfigError(f"EngineConfig: kv_share_with entries are integer layer indices, got {i!r}: {j!r}; "
                              "e.g. kv_share_with={1: 0}") from None
        out[i] = j
    for i, j in sorted(out.items()):
        if i < 0 or j < 0:
            raise ConfigError(f"EngineConfig: kv_share_with {{{i}: {j}}}: layer indices are >= 0")
        if i == j:
            raise ConfigError(f"EngineConfig: kv_share_with {{{i}: {j}}}: layer {i} shares with itself; drop the "
                              "entry (a layer not in the map keeps its own cache)")
        if j > i:
            raise ConfigError(f"EngineConfig: kv_share_with {{{i}: {j}}}: the owner must be an earlier layer "
                              f"(j < i), since layer {i} reads K/V that layer {j} writes earlier in the same pass; "
                              f"use {{{j}: {i}}} to let layer {j} read layer {i}'s cache instead")
        if j in out:
            raise ConfigError(f"EngineConfig: kv_share_with {{{i}: {j}}}: layer {j} is itself shared (with layer "
                              f"{out[j]}), so it has no cache; name the owner directly: {{{i}: {out[j]}}}")
    if num_layers is not None:
        for i, j in sorted(out.items()):
            if i >= num_layers:
                raise ConfigError(f"EngineConfig: kv_share_with {{{i}: {j}}}: layer {i} is out of range; the "
                                  f"model has layers 0..{num_layers - 1}")
    return out or None


def owner_layers(share: Mapping[int, int] | None, num_layers: int) -> list[int]:
    """The layers that own a cache (not in ``share``), ascending; all layers without sharing."""
    return [i for i in range(num_layers) if not share or i not in share]


def cache_index(share: Mapping[int, int] | None, num_layers: int) -> list[int]:
    """For each model layer, the index of the cache layer it reads among the owners' caches
    (``owner_layers`` order): the identity without sharing."""
    owners = owner_layers(share, num_layers)
    pos = {layer: k for k, layer in enumerate(owners)}
    return [pos[(share or {}).get(i, i)] for i in range(num_layers)]
