"""The replicas' host tiers pooled fleet-wide, inside a running ``SimFleet`` (Mooncake's global KV pool).

``paged.fleet.pool`` replays caches alone; here each replica keeps its real host tier
(``paged.core.host_tier``: cached-free prefix blocks demoted to its CPU pool) and, with pooling,
a routed request first takes from the other replicas' host tiers what its own node lacks:

- walk the request's full prompt blocks (at most ``(n - 1) // block_size``, as the prefix lookup
  does) through the chosen replica's GPU index and host tier, verified like a prefix hit; where
  the local run ends, continue through the other replicas' host tiers (a block of the same hash
  and tokens: the hash chains every earlier block, so it was computed after the same prefix);
- copy that remote run into the chosen replica's host tier (``HostTier.receive``, new local
  content ids chained after the local run), refreshing each source entry; the request joins the
  replica's queue once the transfer is done (``Network.seconds`` of the run's host-block bytes);
- then the replica's own prefix lookup finds the copies like any host-tier hit, and its cost model
  charges their CPU -> GPU copies in the step that reads them.

Contention (``Network.contention``, on by default): a transfer occupies the NICs of the node it
lands on and of every node it reads from, at the full link rate, from when the last of them is
free (first come, first served, in routing order) until it is done; its wait joins the request's
time to its queue (``Fetch.wait_s``). Approximations (stated, not hidden): no sharing of a link
between two transfers at once (a queue, not fair sharing), no switch or core-network limit; a copy
can be evicted by its node before the request is scheduled (then those tokens are computed, as any
cache miss); the copies take the source's hit count and recency, so only LRU order is exact.
Invariants: a remote block is copied only when the chosen replica holds it in neither tier; every
replica's host tier keeps its own invariants (``HostTier.check``); without pooling nothing moves.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from paged.core.host_tier import HostTier
from paged.core.prefix_cache import find_cached_prefix
from paged.errors import ConfigError

from .pool import Network
from .sim_replica import SimReplica

__all__ = ["Fetch", "PooledHostTiers"]


@dataclass(frozen=True, slots=True)
class Fetch:
    """One request's remote run: blocks copied to its replica, their bytes, the transfer time, and
    the wait for busy NICs before it (the blocks are in place ``wait_s + seconds`` after the fetch)."""

    num_blocks: int
    nbytes: float
    seconds: float
    wait_s: float = 0.0


class PooledHostTiers:
    """See the module docstring. ``replicas``: a fleet's replicas, each with a host tier, one block
    size and one hash function (a remote block is found by its hash); ``network``: the link a
    remote run crosses."""

    def __init__(self, replicas: Sequence[SimReplica], network: Network) -> None:
        if not isinstance(network, Network):
            raise ConfigError(f"pooled must be a paged.fleet.Network (the link remote hits cross), got {network!r}")
        missing = [r.name for r in replicas if getattr(r.kv, "host", None) is None]
        if missing:
            raise ConfigError(f"a pooled host tier needs every replica's host tier; {missing} have none: give their "
                              "SimConfig enable_host_tier=True (and a CPU pool)")
        keys = {(r.block_size, r.kv.prefix.hasher.hash_fn) for r in replicas}
        if len(keys) != 1:
            raise ConfigError(f"pooled replicas must share one block size and hash_fn (a remote block is found by "
                              f"its hash); got {sorted((bs, getattr(f, '__name__', str(f))) for bs, f in keys)}")
        self.replicas, self.network = list(replicas), network
        self.free_at = [0.0] * len(self.replicas)   # per node: when its NICs finish the transfers so far
        self.num_fetches = self.num_blocks = 0
        self.nbytes = self.seconds = self.wait_s = 0.0

    def fetch(self, k: int, token_ids: Sequence[int], sources: Sequence[int] | None = None,
              extra_keys: tuple = (), t: float = 0.0) -> Fetch:
        """Copy into replica ``k``'s host tier the remote run of ``token_ids`` (module docstring),
        taken from the host tiers of replicas ``sources`` (default: every other one; a replica
        that is down is no source), asked for at time ``t`` (seconds; it queues for busy NICs)."""
        r = self.replicas[k]
        kv, bs = r.kv, r.block_size
        host: HostTier = kv.host
        hashes: list = []
        kv.prefix.hasher.extend(hashes, token_ids, extra_keys, len(token_ids))
        last = min(len(hashes), (len(token_ids) - 1) // bs)
        local = find_cached_prefix(kv.pool, hashes, token_ids, bs, last, host.entries)
        for e in local:
            if host.entries.get(e.block_hash) is e:
                host.refresh(e)   # most recent: the copies below must not evict the run they extend
        i, parent_cid = len(local), local[-1].cid if local else 0
        others = [(j, self.replicas[j].kv.host)
                  for j in (range(len(self.replicas)) if sources is None else sources) if j != k]
        n, nodes = 0, {k}
        while i < last and kv.pool.index.get(hashes[i]) is None and hashes[i] not in host.entries:
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            j, holder = next(((j, tier) for j, tier in others if (e := tier.entries.get(hashes[i])) is not None
                              and e.token_ids == tokens), (None, None))
            if holder is None:
                break
            source = holder.entries[hashes[i]]
            copy = host.receive(source, kv.pool.new_cid(), parent_cid)
            if copy is None:
                break
            holder.refresh(source)
            nodes.add(j)
            parent_cid, i, n = copy.cid, i + 1, n + 1
        nbytes = n * r.host_block_bytes
        seconds, wait = self.network.seconds(nbytes), 0.0
        if n and self.network.contention:
            start = max(t, max(self.free_at[j] for j in nodes))
            wait = start - t
            for j in nodes:
                self.free_at[j] = start + seconds
        if n:
            self.num_fetches += 1
            self.num_blocks += n
            self.nbytes += nbytes
            self.seconds += seconds
            self.wait_s += wait
        return Fetch(n, nbytes, seconds, wait)

    def summary(self) -> dict[str, float]:
        """The pool's traffic over the run (fleet-wide)."""
        return {"remote_fetches": self.num_fetches, "remote_blocks": self.num_blocks,
                "network_bytes": self.nbytes, "network_s": self.seconds, "network_wait_s": self.wait_s}
