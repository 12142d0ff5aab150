"""The router's side of a fleet: per replica what was sent there and both cache views; the routing record.

    replicas = [ReplicaState(i, f"r{i}", block_size=16, capacity_blocks=512, precise=PreciseCache(16))
                for i in range(4)]
    d = Dispatcher(make_router("kv_aware"), replicas)
    i = d.route(request, time_s=0.0)        # the replica index; recorded; the approximate view updated
    d.finished(i, request.request_id)       # its blocks leave the replica's decode load
    d.mark_down(i, "connection refused")    # ReplicaDownWarning; returns its unfinished request ids
    d.frame(), d.candidates_frame()         # one row per decision / per (decision, replica)

Invariants: a request is outstanding on exactly one replica from ``route`` to ``finished`` (or
until that replica is marked down, when the caller re-routes it); a replica that is down is
never chosen; every decision is one row of the routing record.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Sequence

from paged.errors import ConfigError, ReplicaDownWarning, UnknownRequestError

from .caches import ApproxCache, PreciseCache
from .routers import Router, ReplicaView, prompt_of

DECISION_COLUMNS = ("request_id", "time_s", "policy", "replica", "replica_name", "reason", "prompt_tokens",
                    "score", "overlap_blocks", "precise_blocks", "approx_blocks")
CANDIDATE_COLUMNS = ("request_id", "replica", "chosen", "score", "overlap_blocks")


class ReplicaState:
    """What the router knows of one replica (see the module docstring). ``approx`` is always kept
    (the router's own guess, sized like the replica's pool); ``precise`` only with KV events."""

    def __init__(self, index: int, name: str, block_size: int, capacity_blocks: int,
                 precise: PreciseCache | None = None) -> None:
        self.index, self.name = index, name
        self.block_size, self.capacity_blocks = block_size, capacity_blocks
        self.approx = ApproxCache(block_size, capacity_blocks)
        self.precise = precise
        self.outstanding: dict[str, int] = {}   # request id -> KV blocks it will hold
        self.up = True
        self.down_reason: str | None = None
        self.num_sent = 0

    def view(self, kv_usage: float | None = None) -> ReplicaView:
        """A snapshot for the router; ``kv_usage`` from the replica, else the cached fraction its
        best view shows."""
        if kv_usage is None:
            cache = self.precise if self.precise is not None else self.approx
            kv_usage = cache.num_blocks() / self.capacity_blocks if self.capacity_blocks else 0.0
        return ReplicaView(self.index, self.name, self.block_size, self.capacity_blocks, len(self.outstanding),
                           sum(self.outstanding.values()), float(kv_usage), self.up, self.precise, self.approx)

    def sent(self, request: Any, keys: Sequence[int] | None = None) -> None:
        """``request`` was routed here (``keys``: its prompt's chain keys, if computed)."""
        n = len(prompt_of(request)) + int(getattr(request, "max_tokens", 0) or 0)
        self.outstanding[request.request_id] = math.ceil(n / self.block_size)
        self.approx.record(prompt_of(request), keys)
        self.num_sent += 1


class Dispatcher:
    """Routes requests over ``replicas`` with ``router`` and keeps the routing record."""

    def __init__(self, router: Router, replicas: Sequence[ReplicaState]) -> None:
        if not replicas:
            raise ConfigError("a fleet needs at least one replica; give num_replicas >= 1")
        if [r.index for r in replicas] != list(range(len(replicas))):
            raise ConfigError("replica indices must be 0, 1, ..., n-1 in order")
        names = [r.name for r in replicas]
        if len(set(names)) != len(names):
            raise ConfigError(f"replica names must be distinct, got {names}")
        self.router, self.replicas = router, list(replicas)
        self.rows: list[tuple] = []
        self.where: dict[str, int] = {}          # outstanding request id -> replica

    def views(self, usage: Sequence[float] | None = None) -> list[ReplicaView]:
        return [r.view(None if usage is None else usage[r.index]) for r in self.replicas]

    def route(self, request: Any, time_s: float = 0.0, usage: Sequence[float] | None = None) -> int:
        """Choose a replica for ``request``, note it as sent there, record the decision."""
        i = self.router.route(request, self.views(usage))
        d = self.router.decisions[-1]
        r = self.replicas[i]
        keys = self.router.keys(request, r.block_size)
        precise = r.precise.match_keys(keys) if r.precise is not None else -1
        approx = r.approx.match_keys(keys)   # before this request is added to the guess
        r.sent(request, keys)
        self.where[request.request_id] = i
        self.rows.append((request.request_id, time_s, d.policy, i, r.name, d.reason, d.prompt_tokens,
                          d.scores[i], d.overlaps[i], precise, approx))
        return i

    def finished(self, index: int, request_id: str) -> None:
        """``request_id`` finished on replica ``index``."""
        r = self.replicas[index]
        if request_id not in r.outstanding:
            raise UnknownRequestError(f"request {request_id!r} is not outstanding on replica {r.name!r}")
        del r.outstanding[request_id]
        self.where.pop(request_id, None)

    def mark_down(self, index: int, reason: str) -> list[str]:
        """Take replica ``index`` out of routing (a ReplicaDownWarning says why); its caches are
        forgotten; returns the ids of the requests it had not finished, for the caller to re-route."""
        r = self.replicas[index]
        if not r.up:
            return []
        r.up, r.down_reason = False, reason
        lost = list(r.outstanding)
        r.outstanding.clear()
        for rid in lost:
            self.where.pop(rid, None)
        r.approx.clear()
        if r.precise is not None:
            r.precise.clear()
        left = sum(x.up for x in self.replicas)
        warnings.warn(f"replica {r.name!r} is down ({reason}); routing continues over {left} replica(s); "
                      f"{len(lost)} unfinished request(s) to re-route", ReplicaDownWarning, stacklevel=2)
        return lost

    def mark_up(self, index: int) -> None:
        """Bring replica ``index`` back (its caches start empty)."""
        r = self.replicas[index]
        r.up, r.down_reason = True, None

    # ---- records -------------------------------------------------------------------------------------
    def frame(self):
        """One row per decision (``DECISION_COLUMNS``): the chosen replica, its score, the matched
        blocks the policy saw there, and what the precise and approximate views say of it (-1: no
        such view) — their difference is the approximate view's error at routing time."""
        import pandas as pd
        return pd.DataFrame(self.rows, columns=list(DECISION_COLUMNS))

    def candidates_frame(self):
        """One row per (decision, replica): its score and matched blocks (NaN / -1: it was down)."""
        import pandas as pd
        rows = [(d.request_id, j, j == d.replica, s, m)
                for d in self.router.decisions for j, (s, m) in enumerate(zip(d.scores, d.overlaps))]
        return pd.DataFrame(rows, columns=list(CANDIDATE_COLUMNS))
