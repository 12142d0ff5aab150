"""paged.fleet: many replicas behind one router.

    router = paged.fleet.make_router("kv_aware", overlap_weight=1.0)   # or round_robin, least_outstanding,
    #   least_kv_usage, session_affinity, cache_aware (paged.fleet.ROUTERS)
    fleet = paged.fleet.LiveFleet([EngineReplica(llm, events), ServerReplica.of(server)], router)   # live engines

Modules: ``caches`` (a replica's cache as its KV events rebuild it, and as the router guesses it),
``routers`` (the policies and their decisions), ``dispatch`` (what was sent where; the routing
record), ``live`` (the router in front of engines that publish vLLM's KV events), ``pool`` (per-node DRAM
caches pooled over a network; ``pool_study``: Mooncake's global vs local), ``host_pool`` (the replicas' own
host tiers pooled inside a running ``SimFleet``).
"""
from __future__ import annotations

import importlib

_NAMES = {
    "PreciseCache": "caches", "ApproxCache": "caches", "gap": "caches",
    "ROUTERS": "routers", "make_router": "routers", "Router": "routers", "ReplicaView": "routers",
    "Decision": "routers",
    "Dispatcher": "dispatch", "ReplicaState": "dispatch",
    "PooledTier": "pool", "Network": "pool", "PooledHostTiers": "host_pool",
    "LiveFleet": "live", "EngineReplica": "live", "ServerReplica": "live", "Arrival": "live",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(f".{_NAMES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
