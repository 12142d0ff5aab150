"""One simulated replica: its own scheduler, KV pool and cost model (its own GPU and tensor-parallel
degree) on its own ``StepLoop`` and simulated clock, publishing its cache in vLLM's KV-event terms.

The pieces are the simulator's (``paged.sim.Simulator(config)`` builds and checks them: a model
that does not fit its GPUs is a ConfigError there); the replica drives them with a loop of its
own, whose observer stamps each request (first scheduled, first token, finish, cached tokens).

Its cache events (the KV manager's ``cache_block`` / ``evict`` / ``tier_out`` / ``reset``, tapped
by ``paged.connect.tap`` as for a live engine, for those four kinds only, while the pool still
holds the state they are about) are applied to the replica's ``PreciseCache`` as
the ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` (``paged.connect.wire``) blocks they
are, in process (no encoding): the router's precise view follows the protocol a live replica speaks.
Invariant (checked by the tests): the precise view's blocks are exactly the pool's hash index.
"""
from __future__ import annotations

import math
from typing import Any

from paged.connect import tap
from paged.connect.wire import AllBlocksCleared
from paged.core import events as ev
from paged.core.clock import SimulatedClock
from paged.core.loop import Step, StepLoop
from paged.core.request import Request
from paged.sim.executor import RooflineExecutor

from .caches import PreciseCache
from .coast import coast
from .step_log import StepLog


CACHE_KINDS = frozenset((ev.CACHE_BLOCK, ev.EVICT, ev.TIER_OUT, ev.RESET))


class RequestStamps:
    """Simulated-clock stamps of one request on its replica (None: not yet)."""

    __slots__ = ("index", "replica", "arrival", "first_scheduled", "first_token", "last_token", "finish",
                 "num_token_steps", "num_preemptions", "num_cached_tokens", "num_reroutes", "num_remote_blocks")

    def __init__(self, index: int, replica: int, arrival: float) -> None:
        self.index, self.replica, self.arrival = index, replica, arrival
        self.first_scheduled = self.first_token = self.last_token = self.finish = None
        self.num_token_steps = self.num_preemptions = self.num_cached_tokens = self.num_reroutes = 0
        self.num_remote_blocks = 0   # blocks a pooled host tier copied from other nodes for it


class SimReplica:
    """See the module docstring. ``records``: every executed step's record (a ``StepLog``;
    ``num_coasted`` of them fast-forwarded, ``paged.fleet.coast``)."""

    def __init__(self, index: int, name: str, config: Any, precise: bool = True) -> None:
        from paged.sim.simulator import Simulator
        sim = Simulator(config)
        self.index, self.name, self.config = index, name, config
        self.model, self.num_blocks, self.block_size = sim.model, sim.num_blocks, config.block_size
        self.max_model_len = sim.max_model_len
        # one block's host bytes over all the replica's GPUs: what a pooled tier's transfer moves
        self.host_block_bytes = sim.host_block_bytes * config.tensor_parallel
        self.scheduler, self.kv, self.recorder = sim.scheduler, sim.kv, sim.recorder
        self.clock = SimulatedClock()
        self.loop = StepLoop(sim.scheduler, RooflineExecutor(sim.cost, sim.block_bytes), self.clock, observer=self)
        self.records = StepLog()              # every executed step, in order
        self.num_coasted = 0                  # of them, steps taken by the decode fast-forward
        self.finished: list[Request] = []     # finished since the fleet last took them
        self.precise = PreciseCache(self.block_size, keep_forest=False) if precise else None
        if self.precise is not None:
            self.recorder = tap.install(sim, self.on_event, CACHE_KINDS)

    # ---- the KV events ------------------------------------------------------------------------------
    def on_event(self, step: int, kind: str, rid: Any, bid: Any, value: Any) -> None:
        """The tap's listener: the cache change as the vLLM KV event it is (``BlockStored`` of one
        block, ``BlockRemoved``, ``AllBlocksCleared``), applied to the precise view block by block
        (``PreciseCache.store`` / ``remove``: what ``apply`` does per block of a decoded event)."""
        if kind == ev.CACHE_BLOCK:
            block = self.kv.pool.blocks[bid]
            parent, depth = None, block.depth
            if depth:
                hashes = self.kv.prefix.hashes.get(rid)
                parent = hashes[depth - 1] if hashes and len(hashes) >= depth else None
            self.precise.store(block.block_hash, parent, block.token_ids)
        elif kind == ev.EVICT or kind == ev.TIER_OUT:   # a demoted block leaves the GPU pool too
            h = self.kv.pool.blocks[bid].block_hash
            if h is not None:
                self.precise.remove(h)
        elif kind == ev.RESET:
            self.precise.apply((AllBlocksCleared(),))

    # ---- the loop -----------------------------------------------------------------------------------
    @property
    def now(self) -> float:
        return self.clock.now()

    def busy(self) -> bool:
        return self.loop.has_unfinished_requests()

    def add(self, request: Request) -> None:
        """Queue ``request`` (arrived at ``request.arrival_time``); an idle replica's clock moves to it."""
        if not self.busy() and self.clock.now() < request.arrival_time:
            self.clock.advance_to(request.arrival_time)
        self.loop.add_request(request)

    def step(self, horizon: float = -math.inf) -> bool:
        """The quiet decode steps that start by ``horizon`` (``paged.fleet.coast``: none by
        default); when there are none, one step of this replica's loop, its record kept, and the
        quiet steps that follow it. Returns whether the replica moved on: some step ran, or the
        loop's plan preempted (False: it could not schedule; it waits for the next event)."""
        taken = coast(self, horizon)
        if taken:
            self.num_coasted += taken
            return True
        s = self.loop.step()
        if s.record is not None:
            self.records.append(s.record)
            self.num_coasted += coast(self, horizon)
            return True
        return bool(s.plan.preempted or s.plan.swap_out)

    def after_update(self, step: Step) -> None:
        """The loop's observer: stamp the step's requests and the finished ones."""
        start, end, batch = step.start_s, step.end_s, step.plan.batch
        for r, samples in zip(batch.requests, batch.samples):
            d = r.data
            if d.first_scheduled is None:
                d.first_scheduled = start
            if samples:
                if d.first_token is None:
                    d.first_token = end
                d.last_token = end
                d.num_token_steps += 1
        for r in step.finished:
            d = r.data
            d.finish, d.num_preemptions, d.num_cached_tokens = end, r.num_preemptions, max(r.num_cached_tokens, 0)
        if step.finished:
            self.finished.extend(step.finished)
            self.scheduler.take_finished()

    def take_finished(self) -> list[Request]:
        out, self.finished = self.finished, []
        return out

    def kv_usage(self) -> float:
        return self.kv.kv_cache_usage_perc
