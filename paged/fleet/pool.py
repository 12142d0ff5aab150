"""A pooled KV tier: per-node host (DRAM) caches that any node can read over the network.

Mooncake (Qin et al., FAST'25) keeps the KV cache of every prefill node in that node's DRAM and
lets any node fetch it over RDMA; its scheduler sends a request to the node that minimises queue
+ transfer + prefill time, and blocks fetched often are copied to the nodes that ask for them.
Here, per request in arrival order:

- ``keys``: the chained key of each full prompt block (``chain_ids`` over a trace's block ids, or
  ``caches.chain_keys`` over tokens); a hit is a leading run of keys, at most ``(n - 1) // block``
  blocks (the last prompt token is always computed, as in ``KVCacheManager``).
- on its node a key is a **local hit** when the node's cache holds it; with ``pooled`` a key that
  only other nodes hold is a **remote hit** (fetched from the first holder, ``latency + bytes /
  bandwidth`` on the ``Network``); otherwise the run ends and the rest is computed.
- the node's cache then holds the request's blocks (local hits, replicas, computed blocks) as most
  recent, the first block last of all (vLLM frees a request's blocks tail first); remote hits are
  refreshed on their holder; each node evicts its own least recently used blocks.
- ``replicate_after``: a block whose remote hits reach it is also kept on the requester's node
  (Mooncake's hot-block replication; it rides on the hit's transfer, no extra bytes).

Invariants: every node holds at most ``capacity_blocks`` keys; ``holders[k]`` is exactly the set of
nodes whose cache holds ``k``; without ``pooled`` no remote hit is ever counted. The caches are
``paged.core.eviction`` policies (the host tier's own LRU), keyed like ``caches.ApproxCache``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

from paged.core.eviction import make_policy
from paged.errors import ConfigError

__all__ = ["Network", "NodeCache", "PooledTier", "Serve", "chain_ids", "max_hit_blocks"]


def chain_ids(ids: Sequence[int]) -> list[int]:
    """Chained keys of a trace's block ids: key(i) = hash((key(i-1), id_i)), key(-1) = 0 (an id
    after a different prefix is a different block, as with ``caches.chain_keys`` over tokens)."""
    out, parent = [], 0
    for b in ids:
        parent = hash((parent, int(b)))
        out.append(parent)
    return out


@dataclass(frozen=True, slots=True)
class Network:
    """The link a remote hit crosses: ``nics`` NICs of ``nic_gbps`` Gb/s at ``efficiency`` and a
    fixed ``latency_s`` per transfer; ``contention``: in a ``SimFleet``'s pooled tiers, transfers
    that share a node queue for it (``paged.fleet.host_pool``; the replay here times each alone).
    Defaults: Mooncake's Transfer Engine, 87 GB/s measured on 4 x 200 Gb/s RoCE (efficiency 0.87;
    190 GB/s on 8 x 400 Gb/s), a few microseconds of latency."""

    nics: int = 4
    nic_gbps: float = 200.0
    efficiency: float = 0.87
    latency_s: float = 5e-6
    contention: bool = True   # inside a SimFleet: a node's NICs carry one transfer at a time (FIFO)

    def __post_init__(self) -> None:
        if not (isinstance(self.nics, int) and self.nics >= 1):
            raise ConfigError(f"nics must be an integer >= 1, got {self.nics!r}")
        if not (isinstance(self.nic_gbps, (int, float)) and self.nic_gbps > 0):
            raise ConfigError(f"nic_gbps must be a bandwidth > 0 in Gb/s (RDMA: 200 or 400), got {self.nic_gbps!r}")
        if not 0 < self.efficiency <= 1:
            raise ConfigError(f"efficiency must be in (0, 1] (measured / line rate), got {self.efficiency!r}")
        if not self.latency_s >= 0:
            raise ConfigError(f"latency_s must be >= 0 seconds, got {self.latency_s!r}")
        if not isinstance(self.contention, bool):
            raise ConfigError(f"contention must be True or False (transfers queue for a node's NICs), "
                              f"got {self.contention!r}")

    @property
    def bytes_per_s(self) -> float:
        return self.nics * self.nic_gbps * 1e9 / 8 * self.efficiency

    def seconds(self, nbytes: float) -> float:
        """One transfer of ``nbytes`` (0 bytes: no transfer, 0 s)."""
        return self.latency_s + nbytes / self.bytes_per_s if nbytes > 0 else 0.0


class _Entry:
    """One cached block in a node's policy (linked through ``prev``/``next`` like a Block)."""

    __slots__ = ("block_hash", "hits", "last_access", "depth", "prev", "next")

    def __init__(self, key: Hashable) -> None:
        self.block_hash, self.hits, self.last_access, self.depth = key, 0, 0.0, 0
        self.prev = self.next = None


class NodeCache:
    """One node's DRAM cache of ``capacity_blocks`` blocks: key -> entry, in an eviction policy."""

    def __init__(self, capacity_blocks: int, eviction: str = "lru") -> None:
        self.capacity_blocks = capacity_blocks
        self.entries: dict[Hashable, _Entry] = {}
        self.policy = make_policy(eviction)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def refresh(self, key: Hashable) -> bool:
        """Make ``key`` most recent; False (nothing inserted) when it is not held."""
        e = self.entries.get(key)
        if e is None:
            return False
        self.policy.remove(e)
        e.hits += 1
        self.policy.add(e)
        return True

    def hold(self, keys: Sequence[Hashable]) -> list[Hashable]:
        """Hold one request's blocks ``keys`` (in prompt order; at most the first
        ``capacity_blocks``) as the most recent, the first block last of all: the ones held already
        are pinned while the least recently used others make room (as blocks in use are in the
        KV manager). Returns the keys evicted."""
        keys = list(dict.fromkeys(keys))[: self.capacity_blocks]
        entries, policy = self.entries, self.policy
        held = [entries[k] for k in keys if k in entries]
        for e in held:
            policy.remove(e)
            e.hits += 1
        out = []
        while len(entries) + len(keys) - len(held) > self.capacity_blocks:
            old = policy.pop()
            del entries[old.block_hash]
            out.append(old.block_hash)
        for k in reversed(keys):
            e = entries.get(k)
            if e is None:
                e = entries[k] = _Entry(k)
            policy.add(e)
        return out


@dataclass(frozen=True, slots=True)
class Serve:
    """What one request found: leading blocks hit on its node and fetched from others (with
    their sources), blocks copied to its node, bytes over the network and their seconds."""

    node: int
    local_blocks: int
    remote_blocks: int
    sources: tuple[int, ...]
    replicated_blocks: int
    bytes_moved: float
    transfer_s: float


class PooledTier:
    """``nodes`` caches of ``capacity_blocks`` each (see the module docstring)."""

    def __init__(self, nodes: int, capacity_blocks: int, block_bytes: float, *, pooled: bool = True,
                 network: Network | None = None, replicate_after: int | None = None, eviction: str = "lru") -> None:
        if not (isinstance(nodes, int) and not isinstance(nodes, bool) and nodes >= 1):
            raise ConfigError(f"a pooled tier needs nodes >= 1 (an integer), got {nodes!r}")
        if not (isinstance(capacity_blocks, int) and capacity_blocks >= 1):
            raise ConfigError(f"capacity_blocks must be an integer >= 1 per node, got {capacity_blocks!r}")
        if not block_bytes > 0:
            raise ConfigError(f"block_bytes must be > 0 (KV bytes of one block), got {block_bytes!r}")
        if replicate_after is not None and not (isinstance(replicate_after, int) and replicate_after >= 1):
            raise ConfigError(f"replicate_after must be None (never) or an integer >= 1 remote hits, "
                              f"got {replicate_after!r}")
        self.nodes = [NodeCache(capacity_blocks, eviction) for _ in range(nodes)]
        self.capacity_blocks, self.block_bytes, self.pooled = capacity_blocks, float(block_bytes), pooled
        self.network = network if network is not None else Network()
        self.replicate_after = replicate_after
        self.holders: dict[Hashable, set[int]] = {}
        self.remote_hits: dict[Hashable, int] = {}
        self.served_remote = [0] * nodes     # blocks each node served to others
        self.evicted = [0] * nodes

    def match(self, node: int, keys: Sequence[Hashable], max_blocks: int) -> tuple[int, int]:
        """(local, remote) blocks of the leading run of ``keys`` ``node`` would find; no change."""
        cache, holders, local = self.nodes[node], self.holders, 0
        for i, k in enumerate(keys[:max_blocks]):
            if k in cache:
                local += 1
            elif not (self.pooled and holders.get(k)):
                return local, i - local
        n = min(len(keys), max_blocks)
        return local, n - local

    def transfer_s(self, remote_blocks: int) -> float:
        return self.network.seconds(remote_blocks * self.block_bytes)

    def serve(self, node: int, keys: Sequence[Hashable], max_blocks: int) -> Serve:
        """Serve a request's prefix on ``node`` and keep its blocks there (see the module docstring)."""
        if not (isinstance(node, int) and 0 <= node < len(self.nodes)):
            raise ConfigError(f"node {node!r} is not one of 0..{len(self.nodes) - 1}")
        cache, hit, sources, replicated = self.nodes[node], 0, [], 0
        keep: list[Hashable] = []
        for k in keys[:max_blocks]:
            if k in cache:
                keep.append(k)
            elif self.pooled and self.holders.get(k):
                src = min(self.holders[k])
                self.nodes[src].refresh(k)
                self.served_remote[src] += 1
                sources.append(src)
                c = self.remote_hits[k] = self.remote_hits.get(k, 0) + 1
                if self.replicate_after is not None and c >= self.replicate_after:
                    keep.append(k)
                    replicated += 1
            else:
                break
            hit += 1
        keep.extend(keys[hit:])          # computed here
        self._hold(node, keep)
        nbytes = len(sources) * self.block_bytes
        return Serve(node, hit - len(sources), len(sources), tuple(sources), replicated, nbytes,
                     self.network.seconds(nbytes))

    def _hold(self, node: int, keys: Sequence[Hashable]) -> None:
        for old in self.nodes[node].hold(keys):
            hs = self.holders[old]
            hs.discard(node)
            if not hs:
                del self.holders[old]
            self.evicted[node] += 1
        for k in keys[: self.capacity_blocks]:
            self.holders.setdefault(k, set()).add(node)

    def check(self) -> None:
        """Assert the module docstring's invariants (O(blocks); for tests)."""
        seen: dict[Hashable, set[int]] = {}
        for i, c in enumerate(self.nodes):
            assert len(c) <= self.capacity_blocks and len(c.policy) == len(c)
            for k in c.entries:
                seen.setdefault(k, set()).add(i)
        assert seen == self.holders
        assert self.pooled or not any(self.served_remote)


def max_hit_blocks(prompt_tokens: int, block_size: int) -> int:
    """Blocks a hit may cover: the last prompt token is always computed."""
    return max(0, (int(prompt_tokens) - 1) // block_size)
