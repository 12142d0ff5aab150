"""Routers: ``route(request, views) -> replica index``, each decision kept with every candidate's score.

A router sees one ``ReplicaView`` per replica (load, KV usage, its caches) and scores the replicas
that are up: the lowest score wins, ties go to the first replica after the one chosen last (so
equal scores rotate). Policies (``make_router(name, **options)``; ``ROUTERS`` lists them):

- ``round_robin``: every score 0 (the rotation alone) — vidur's ``round_robin``.
- ``least_outstanding``: requests sent and not finished — vidur's ``lor``.
- ``least_kv_usage``: the replica's KV-pool usage (0..1).
- ``session_affinity``: consistent hashing of the request's ``session_id`` (else its id) on a ring
  of ``vnodes`` points per replica name; a replica that goes down moves only its own sessions.
- ``kv_aware``: NVIDIA Dynamo's KV-router cost, ``overlap_weight * prefill_blocks + decode_blocks``
  (prefill blocks: prompt blocks not cached on the replica; decode blocks: blocks its outstanding
  requests hold plus this prompt's), argmin at ``temperature`` 0, else sampled from a softmax of
  the negated cost scaled to [0, 1]. ``view``: ``precise`` (the replica's KV events) or
  ``approximate`` (the router's guess). A large ``overlap_weight`` is pure cache affinity.
- ``cache_aware``: SGLang's router: when loads are imbalanced (``max - min > balance_abs`` and
  ``max > balance_rel * min``) the least loaded replica; else the longest prefix match if its
  match rate (matched / prompt tokens) exceeds ``cache_threshold``; else the replica whose cache
  view holds the fewest blocks. Defaults 0.3 / 64 / 1.5 as SGLang's router logs them.

Sources: Dynamo's router docs (docs.nvidia.com/dynamo, "KV Router", "Router Design"); SGLang's
``sgl-router`` cache-aware policy; vidur's global schedulers. Our code, not theirs.
"""
from __future__ import annotations

import hashlib
import math
import random
from bisect import bisect_left
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from paged.errors import ConfigError, NoReplicaError

from .caches import CacheView, chain_keys

VIEWS = ("precise", "approximate")


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What a router knows of one replica at the moment it routes."""

    index: int
    name: str
    block_size: int
    capacity_blocks: int
    num_outstanding: int = 0     # requests sent and not finished
    active_blocks: int = 0       # KV blocks its outstanding requests hold (Dynamo's decode blocks)
    kv_usage: float = 0.0        # fraction of its KV pool in use
    up: bool = True
    precise: CacheView | None = None
    approx: CacheView | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    """One routing decision: ``scores`` and ``overlaps`` per replica in index order (NaN / -1 for
    a replica that was down or, for overlaps, when the policy reads no cache); ``reason`` names the
    branch that decided (``cache_aware``: balance / cache / space)."""

    request_id: str
    replica: int
    policy: str
    prompt_tokens: int
    scores: tuple[float, ...]
    overlaps: tuple[int, ...]
    reason: str = ""


def prompt_of(request: Any) -> Sequence[int]:
    return request.prompt_token_ids


class Router:
    """Base class: validation, tie-breaking, the decision log. Subclasses define ``score``."""

    name = "router"
    view: str | None = None   # which cache view the policy reads (None: none)

    def __init__(self) -> None:
        self.decisions: list[Decision] = []
        self.last = -1
        self.memo: tuple | None = None

    def score(self, request: Any, ups: list[ReplicaView]) -> tuple[list[float], list[int], str]:
        """Scores (lower wins) and matched blocks (-1: not read) of the replicas that are up."""
        raise NotImplementedError

    def pick(self, scores: list[float], ups: list[ReplicaView]) -> int:
        """Position in ``ups`` of the winner: the lowest score, ties rotating after ``last``."""
        best = min(scores)
        tied = [i for i, s in enumerate(scores) if s == best]
        return min(tied, key=lambda i: (ups[i].index - self.last - 1) % (1 << 30))

    def route(self, request: Any, views: Sequence[ReplicaView]) -> int:
        """The index of the replica ``request`` goes to (NoReplicaError when none is up)."""
        if not views:
            raise ConfigError("a fleet needs at least one replica; give num_replicas >= 1")
        ups = [v for v in views if v.up]
        if not ups:
            raise NoReplicaError(f"request {request.request_id!r}: all {len(views)} replicas are down; "
                                 "bring one back (or add one) before routing more")
        scores, overlaps, reason = self.score(request, ups)
        chosen = ups[self.pick(scores, ups)].index
        self.last = chosen
        by_index = {v.index: i for i, v in enumerate(ups)}
        self.decisions.append(Decision(
            request.request_id, chosen, self.name, len(prompt_of(request)),
            tuple(scores[by_index[v.index]] if v.index in by_index else math.nan for v in views),
            tuple(overlaps[by_index[v.index]] if v.index in by_index else -1 for v in views), reason))
        return chosen

    def overlap(self, request: Any, v: ReplicaView) -> int:
        cache = v.precise if self.view == "precise" else v.approx
        if cache is None:
            raise ConfigError(f"router {self.name!r} reads the {self.view} cache view, which replica {v.name!r} "
                              "does not have; give the fleet KV events (precise) or use view='approximate'")
        return cache.match_keys(self.keys(request, v.block_size))

    def keys(self, request: Any, block_size: int) -> list[int]:
        """``chain_keys`` of the request's prompt, computed once per request and block size."""
        memo = self.memo
        if memo is None or memo[0] is not request or memo[1] != block_size:
            memo = self.memo = (request, block_size, chain_keys(prompt_of(request), block_size))
        return memo[2]


class RoundRobin(Router):
    name = "round_robin"

    def score(self, request, ups):
        return [0.0] * len(ups), [-1] * len(ups), ""


class LeastOutstanding(Router):
    name = "least_outstanding"

    def score(self, request, ups):
        return [float(v.num_outstanding) for v in ups], [-1] * len(ups), ""


class LeastKVUsage(Router):
    name = "least_kv_usage"

    def score(self, request, ups):
        return [float(v.kv_usage) for v in ups], [-1] * len(ups), ""


def _ring_point(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class SessionAffinity(Router):
    """Consistent hashing (see the module docstring); score: the ring distance to the replica's
    nearest point clockwise of the session's."""

    name = "session_affinity"

    def __init__(self, vnodes: int = 64) -> None:
        super().__init__()
        if not isinstance(vnodes, int) or vnodes < 1:
            raise ConfigError(f"vnodes must be a positive integer (ring points per replica), got {vnodes!r}")
        self.vnodes = vnodes
        self.rings: dict[str, list[int]] = {}

    def points(self, name: str) -> list[int]:
        if name not in self.rings:
            self.rings[name] = sorted(_ring_point(f"{name}#{k}") for k in range(self.vnodes))
        return self.rings[name]

    def score(self, request, ups):
        session = getattr(request, "session_id", None) or request.request_id
        x, full = _ring_point(str(session)), 1 << 64
        out = []
        for v in ups:
            pts = self.points(v.name)
            j = bisect_left(pts, x)
            out.append(float((pts[j % len(pts)] - x) % full))
        return out, [-1] * len(ups), ""


class KVAware(Router):
    """Dynamo-style cost (see the module docstring)."""

    name = "kv_aware"

    def __init__(self, overlap_weight: float = 1.0, temperature: float = 0.0, view: str = "precise",
                 seed: int = 0) -> None:
        super().__init__()
        if not (isinstance(overlap_weight, (int, float)) and overlap_weight >= 0):
            raise ConfigError(f"overlap_weight must be a number >= 0, got {overlap_weight!r}")
        if not (isinstance(temperature, (int, float)) and temperature >= 0):
            raise ConfigError(f"temperature must be a number >= 0 (0: always the cheapest), got {temperature!r}")
        if view not in VIEWS:
            raise ConfigError(f"view must be one of {VIEWS}, got {view!r}")
        self.overlap_weight, self.temperature, self.view = float(overlap_weight), float(temperature), view
        self.rng = random.Random(seed)

    def score(self, request, ups):
        n = len(prompt_of(request))
        costs, overlaps = [], []
        for v in ups:
            m = self.overlap(request, v)
            bs = v.block_size
            prefill = max(0.0, n / bs - m)
            decode = v.active_blocks + math.ceil(n / bs)
            costs.append(self.overlap_weight * prefill + decode)
            overlaps.append(m)
        return costs, overlaps, ""

    def pick(self, scores, ups):
        if self.temperature == 0 or len(scores) == 1:
            return super().pick(scores, ups)
        lo, hi = min(scores), max(scores)
        span = (hi - lo) or 1.0
        weights = [math.exp(-(s - lo) / span / self.temperature) for s in scores]
        return self.rng.choices(range(len(scores)), weights)[0]


class CacheAware(Router):
    """SGLang-style cache-aware routing (see the module docstring)."""

    name = "cache_aware"

    def __init__(self, cache_threshold: float = 0.3, balance_abs: int = 64, balance_rel: float = 1.5,
                 view: str = "approximate") -> None:
        super().__init__()
        if not (isinstance(cache_threshold, (int, float)) and 0 <= cache_threshold <= 1):
            raise ConfigError(f"cache_threshold is a match rate in [0, 1], got {cache_threshold!r}")
        if not (isinstance(balance_abs, (int, float)) and balance_abs >= 0):
            raise ConfigError(f"balance_abs must be a number of requests >= 0, got {balance_abs!r}")
        if not (isinstance(balance_rel, (int, float)) and balance_rel >= 1):
            raise ConfigError(f"balance_rel must be a ratio >= 1, got {balance_rel!r}")
        if view not in VIEWS:
            raise ConfigError(f"view must be one of {VIEWS}, got {view!r}")
        self.cache_threshold, self.balance_abs, self.balance_rel = cache_threshold, balance_abs, balance_rel
        self.view = view

    def score(self, request, ups):
        loads = [v.num_outstanding for v in ups]
        hi, lo = max(loads), min(loads)
        overlaps = [self.overlap(request, v) for v in ups]
        if hi - lo > self.balance_abs and hi > lo * self.balance_rel:
            return [float(x) for x in loads], overlaps, "balance"
        n = max(1, len(prompt_of(request)))
        rates = [m * v.block_size / n for m, v in zip(overlaps, ups)]
        if max(rates) > self.cache_threshold:
            return [-r for r in rates], overlaps, "cache"
        cache = "precise" if self.view == "precise" else "approx"
        return [float(getattr(v, cache).num_blocks()) for v in ups], overlaps, "space"


ROUTERS: dict[str, Callable[..., Router]] = {
    "round_robin": RoundRobin, "least_outstanding": LeastOutstanding, "least_kv_usage": LeastKVUsage,
    "session_affinity": SessionAffinity, "kv_aware": KVAware, "cache_aware": CacheAware,
}


def make_router(name: str | Router, **options: Any) -> Router:
    """A router by name (``ROUTERS``) with its options; a Router instance is returned as is."""
    if isinstance(name, Router):
        return name
    if name not in ROUTERS:
        raise ConfigError(f"unknown router {name!r}; use one of {', '.join(ROUTERS)}")
    try:
        return ROUTERS[name](**options)
    except TypeError as e:
        raise ConfigError(f"router {name!r}: {e}; see paged.fleet.routers for its options") from None
