"""A simulated fleet: N replicas (each its own ``StepLoop``, pool and cost model) behind one router.

    fleet = SimFleet([SimConfig(model="llama-2-70b", gpu="a100-80gb", tensor_parallel=4)] * 8, "kv_aware")
    result = fleet.run(trace)          # a paged trace (paged.sim.workload)
    result.summary                     # fleet-wide: hit rate, TTFT p50/p99, per-replica spread
    result.requests, result.steps      # paged.telemetry's columns + ``replica``
    result.routing                     # one row per decision (paged.fleet.dispatch.DECISION_COLUMNS)
    result.per_replica                 # one summary row per replica

Time is discrete-event over the replicas' own clocks: the replica with work whose clock is
earliest steps next (a heap of busy replicas by clock: O(log replicas) per step, idle replicas
cost nothing), unless the next arrival comes first; then the router sees every replica as
it stands at that arrival (a replica mid-step is a step ahead: the request waits for that step
to end, as it would on a real engine) and the request joins the chosen replica's queue. Prompts
are the simulator's synthetic ones (shared ``prefix_id`` = shared tokens), made once, so every
policy routes exactly the same requests.

With ``pooled=Network(...)`` the replicas' host tiers are one pool (``paged.fleet.host_pool``):
a routed request first copies what other nodes' host tiers hold of its prefix into its replica's
host tier and joins the queue when that transfer is done (its TTFT includes it); each request's
``num_remote_blocks`` and the summary's ``remote_*`` / ``network_*`` say what crossed the network.

A replica can go away mid-run (``run(trace, down_at={2: 30.0})``): it is marked down
(``ReplicaDownWarning``), the requests it had not finished are aborted there (blocks freed) and
routed again at that moment, keeping their arrival time (their TTFT includes the loss).

Invariant at the end: every request finished on exactly one replica or was rejected (it can never
fit the replica it was routed to), and no replica holds a block in use.
"""
from __future__ import annotations

import gc
import heapq
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import pandas as pd

from paged import telemetry
from paged.core.request import Request
from paged.errors import ConfigError, InvalidRequestError
from paged.sim.arrivals import Arrivals, SyntheticPrompts
from paged.sim.simulator import SimulationStuck
from paged.sim.workload import normalize_trace

from .dispatch import Dispatcher, ReplicaState
from .host_pool import PooledHostTiers
from .live import Arrival
from .pool import Network
from .routers import make_router
from .sim_replica import RequestStamps, SimReplica
from .step_log import concat_columns


@dataclass
class FleetResult:
    """A finished fleet run (see the module docstring)."""

    summary: dict[str, Any]
    requests: pd.DataFrame
    steps: pd.DataFrame
    routing: pd.DataFrame
    per_replica: pd.DataFrame


class SimFleet:
    """See the module docstring. ``configs``: one ``SimConfig`` per replica (or one config and
    ``num_replicas``); ``router``: a name of ``paged.fleet.ROUTERS`` with ``router_options``, or a
    Router; ``precise``: build each replica's precise view from its KV events (off: only the
    router's approximate guess exists, and the precise policies refuse); ``pooled``: the network
    over which the replicas' host tiers are pooled (None: each node's tier is its own)."""

    def __init__(self, configs: Any, router: Any = "round_robin", *, num_replicas: int | None = None,
                 precise: bool = True, seed: int = 0, pooled: Network | None = None, **router_options: Any) -> None:
        if not isinstance(configs, (list, tuple)):
            configs = [configs] * (1 if num_replicas is None else num_replicas)
        elif num_replicas is not None and num_replicas != len(configs):
            raise ConfigError(f"{len(configs)} replica configs but num_replicas={num_replicas}; give one or the other")
        if not isinstance(num_replicas, (int, type(None))) or len(configs) < 1:
            raise ConfigError(f"a fleet needs at least one replica; give num_replicas >= 1 (got {num_replicas!r})")
        self.router = make_router(router, **router_options)
        self.replicas = []
        for i, c in enumerate(configs):
            try:
                self.replicas.append(SimReplica(i, f"r{i}", c, precise))
            except ConfigError as e:
                raise ConfigError(f"replica r{i} ({c.model} on {c.tensor_parallel}x {c.gpu}): {e}") from None
        vocab = {r.model.vocab_size for r in self.replicas}
        if len(vocab) != 1:
            raise ConfigError(f"replicas serve models with different vocabularies {sorted(vocab)}; a fleet serves "
                              "one model (its replicas may differ in GPU and tensor-parallel degree)")
        self.vocab_size, self.seed = vocab.pop(), seed
        self.pool = PooledHostTiers(self.replicas, pooled) if pooled is not None else None
        self.dispatcher = Dispatcher(self.router, [ReplicaState(r.index, r.name, r.block_size, r.num_blocks,
                                                                r.precise) for r in self.replicas])
        self.wall_s = 0.0
        self.ran = False

    def run(self, trace: pd.DataFrame, down_at: Mapping[int, float] | None = None) -> FleetResult:
        """Route and simulate ``trace`` to the end (see the module docstring); once per fleet.
        ``down_at``: replica index -> simulated time it goes away (its unfinished requests are
        aborted there and routed again, keeping their arrival time: nothing is lost)."""
        if self.ran:
            raise ConfigError("a SimFleet runs once; build a new one for another run")
        failures = sorted((float(t), int(i)) for i, t in (down_at or {}).items())
        if any(not 0 <= i < len(self.replicas) for _, i in failures):
            raise ConfigError(f"down_at names replicas {sorted(down_at)}; the fleet has 0..{len(self.replicas) - 1}")
        self.ran = True
        with collector_paused():
            return self.simulate(trace, failures)

    def simulate(self, trace: pd.DataFrame, failures: list[tuple[float, int]]) -> FleetResult:
        """``run``'s discrete-event loop and records; ``failures``: (time, replica) pairs, sorted."""
        wall0 = time.perf_counter()
        tr = normalize_trace(trace)
        a = Arrivals(tr)
        toks = SyntheticPrompts(self.vocab_size, self.seed)
        self.stamps: list[RequestStamps | None] = [None] * a.n
        self.rejected: list[tuple[int, str]] = []
        self.inflight: dict[str, Arrival] = {}
        self.fetching: list[tuple[float, int, int, Request]] = []   # heap: (ready time, row, replica, request)
        reps, d = self.replicas, self.dispatcher
        self.ready: list[tuple[float, int]] = []   # heap of (clock, index): busy replicas that can step
        self.queued: set[int] = set()             # replicas with an entry in ``ready``
        stalled: list[SimReplica] = []   # busy replicas that could not schedule: wait for the next event
        times, n, nxt = a.time, a.n, a.next
        t_arrival = float(times[0]) if n else math.inf
        while True:
            t_next = min(t_arrival, failures[0][0] if failures else math.inf,
                         self.fetching[0][0] if self.fetching else math.inf)
            r = self.earliest()
            if r is not None and r.now <= t_next:
                heapq.heappop(self.ready)
                self.queued.discard(r.index)
                moved = r.step(t_next)
                for done in r.take_finished():
                    d.finished(r.index, done.request_id)
                    self.inflight.pop(done.request_id, None)
                if not moved:
                    if math.isinf(t_next):
                        raise SimulationStuck(f"replica {r.name} cannot schedule its waiting request(s) and no "
                                              "arrival is pending; give it more blocks (or lower the watermark)")
                    r.clock.advance_to(max(r.now, t_next))
                    stalled.append(r)
                else:
                    self.enqueue(r)
                continue
            if math.isinf(t_next):
                break
            for x in stalled:
                self.enqueue(x)
            stalled.clear()
            if failures and failures[0][0] <= t_next:
                self.fail(failures.pop(0)[1], t_next)
                continue
            if self.fetching and self.fetching[0][0] <= t_next:
                _, i, k, req = heapq.heappop(self.fetching)
                self.queue(i, k, req)
                continue
            i = nxt
            nxt = a.next = i + 1
            t_arrival = float(times[nxt]) if nxt < n else math.inf
            self.admit(i, Arrival(str(i), tuple(a.prompt_ids(i, toks)), int(a.output[i]), session_of(a, i)),
                       t_next, t_next)
        self.wall_s = time.perf_counter() - wall0
        return self.result(tr, self.stamps, self.rejected)

    def enqueue(self, r: SimReplica) -> None:
        """``r`` may step (again): give it an entry in the ready heap, if it is busy and has none."""
        if r.index not in self.queued and r.busy():
            heapq.heappush(self.ready, (r.now, r.index))
            self.queued.add(r.index)

    def earliest(self) -> SimReplica | None:
        """The busy replica with the earliest clock (the lowest index among equal clocks), or None;
        entries of replicas that went idle (a failure aborted their requests) are dropped."""
        ready, reps = self.ready, self.replicas
        while ready:
            t, i = ready[0]
            r = reps[i]
            if r.busy() and t == r.now:
                return r
            heapq.heappop(ready)
            self.queued.discard(i)
            self.enqueue(r)          # its clock moved while it was idle: queued again at its clock
        return None

    def admit(self, i: int, arrival: Arrival, t: float, arrived: float, reroutes: int = 0) -> None:
        """Route trace row ``i`` at time ``t`` (it arrived at ``arrived``) and queue it there."""
        k = self.dispatcher.route(arrival, t, [x.kv_usage() for x in self.replicas])
        st = self.stamps[i] = RequestStamps(i, k, arrived)
        st.num_reroutes = reroutes
        self.inflight[arrival.request_id] = arrival
        req = Request(arrival.request_id, list(arrival.prompt_token_ids), arrival.max_tokens, arrival_time=t, data=st)
        if self.pool is not None:
            f = self.pool.fetch(k, arrival.prompt_token_ids, [x.index for x in self.dispatcher.replicas if x.up],
                                t=t)
            st.num_remote_blocks = f.num_blocks
            if f.seconds > 0:   # it joins the queue once its remote blocks have crossed the network
                req.arrival_time = t + f.wait_s + f.seconds
                heapq.heappush(self.fetching, (req.arrival_time, i, k, req))
                return
        self.queue(i, k, req)

    def queue(self, i: int, k: int, request: Request) -> None:
        """Queue trace row ``i``'s ``request`` on replica ``k`` (rejected if it can never fit there)."""
        try:
            self.replicas[k].add(request)
        except InvalidRequestError as e:
            self.rejected.append((i, str(e)))
            self.dispatcher.finished(k, request.request_id)
            self.inflight.pop(request.request_id, None)
            return
        self.enqueue(self.replicas[k])

    def fail(self, index: int, t: float) -> None:
        """Replica ``index`` goes away at ``t``: abort what it holds, route it again (ReplicaDownWarning)."""
        r = self.replicas[index]
        lost = self.dispatcher.mark_down(index, f"simulated failure at t={t:.3f} s")
        moving = {req.request_id for _, _, k, req in self.fetching if k == index}   # not queued there yet
        if moving:
            self.fetching = [x for x in self.fetching if x[2] != index]
            heapq.heapify(self.fetching)
        for rid in lost:
            if rid not in moving:
                r.scheduler.abort(rid)
        r.scheduler.take_finished()
        r.take_finished()
        for rid in lost:
            old = self.stamps[int(rid)]
            self.admit(int(rid), self.inflight.pop(rid), t, old.arrival, old.num_reroutes + 1)

    # ---- records ----------------------------------------------------------------------------------
    def result(self, tr: pd.DataFrame, stamps: Sequence[RequestStamps | None],
               rejected: list[tuple[int, str]]) -> FleetResult:
        P, O = tr["prompt_tokens"].to_numpy(), tr["output_tokens"].to_numpy()
        rows = []
        for i, s in enumerate(stamps):
            row = telemetry.request_row(str(i), s.arrival, int(P[i]), int(O[i]), s.first_scheduled, s.first_token,
                                        s.last_token, s.finish, s.num_token_steps, s.num_preemptions,
                                        s.num_cached_tokens)
            row.update(replica=s.replica, num_reroutes=s.num_reroutes, num_remote_blocks=s.num_remote_blocks)
            rows.append(row)
        reqs = pd.DataFrame(rows, columns=list(telemetry.REQUEST_COLUMNS) + ["replica", "num_reroutes",
                                                                             "num_remote_blocks"])
        reqs["rejected"] = False
        reqs.loc[[i for i, _ in rejected], "rejected"] = True
        cols = concat_columns([r.records for r in self.replicas])
        steps = pd.DataFrame(cols, copy=False)   # a block per column: no stacking of millions of rows
        lengths = [len(r.records) for r in self.replicas]
        steps["replica"] = np.repeat(np.array([r.index for r in self.replicas], dtype=np.int64),
                                     lengths) if len(steps) else np.array([], object)
        routing = self.dispatcher.frame()
        ends = np.cumsum(lengths)
        per = pd.DataFrame([self.replica_summary(r, reqs[reqs["replica"] == r.index],
                                                 cols["step_time_s"][end - length:end])
                            for r, end, length in zip(self.replicas, ends, lengths)])
        summary = fleet_summary(reqs, per, self.router.name, self.wall_s)
        summary["num_blocks_in_use_at_end"] = int(sum(r.kv.num_used_blocks for r in self.replicas))
        if self.pool is not None:
            summary.update(self.pool.summary())
        known = routing[routing["precise_blocks"] >= 0]
        diff = (known["approx_blocks"] - known["precise_blocks"]).to_numpy()
        summary["view_agree"] = float((diff == 0).mean()) if len(diff) else float("nan")   # guess == stream
        summary["view_over_blocks_mean"] = float(np.clip(diff, 0, None).mean()) if len(diff) else float("nan")
        return FleetResult(summary, reqs, steps, routing, per)

    def replica_summary(self, r: SimReplica, reqs: pd.DataFrame, step_times: np.ndarray) -> dict[str, Any]:
        fin = reqs[reqs["finish_s"].notna()]
        prompt = float(fin["num_prompt_tokens"].sum())
        return {"replica": r.index, "name": r.name, "model": r.model.name, "gpu": r.config.gpu,
                "tensor_parallel": r.config.tensor_parallel, "num_kv_blocks": r.num_blocks,
                "requests": len(reqs), "hit_rate": float(fin["num_cached_tokens"].sum()) / prompt if prompt else 0.0,
                "ttft_p50_s": _q(fin["ttft_s"], 0.5), "ttft_p99_s": _q(fin["ttft_s"], 0.99),
                "prefill_tokens": int(prompt - fin["num_cached_tokens"].sum()), "steps": len(r.records),
                "busy_s": float(sum(step_times.tolist()))}   # in step order, as the steps ran


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside the block, as it was after. A fleet run makes
    millions of long-lived objects (blocks, step records) and no cyclic garbage (a collection at
    its end finds none), so the collector's passes over them are pure cost: a fifth of a run's
    CPU time on the 70B benchmark; reference counting frees everything else as before. At the end
    every object alive counts as old (``gc.freeze`` then ``gc.unfreeze``: into the oldest generation),
    so the young collection that would follow does not scan the run's millions of objects (0.9 s
    after 3,000 requests on 16 replicas); full collections see them as before."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.freeze()
            gc.unfreeze()
            gc.enable()


def session_of(a: Arrivals, i: int) -> str | None:
    """A request's session for affinity routing: its shared prefix, else its first content block
    (a conversation's turns share their first block), else none."""
    pid = int(a.prefix_id[i])
    if pid >= 0:
        return f"p{pid}"
    if a.blocks is not None and len(a.blocks[i]):
        return f"b{int(a.blocks[i][0])}"
    return None


def _q(x: Any, p: float) -> float:
    x = np.asarray(x, dtype=np.float64)
    x = x[~np.isnan(x)]
    return float(np.quantile(x, p)) if len(x) else float("nan")


def fleet_summary(reqs: pd.DataFrame, per: pd.DataFrame, policy: str, wall_s: float) -> dict[str, Any]:
    """Fleet-wide numbers: hit rate (cached / prompt tokens of finished requests), TTFT and e2e
    quantiles, prefill tokens computed, and the spread of requests and busy time over replicas."""
    fin = reqs[reqs["finish_s"].notna()]
    prompt = float(fin["num_prompt_tokens"].sum())
    cached = float(fin["num_cached_tokens"].sum())
    n = per["requests"].to_numpy()
    return {"policy": policy, "replicas": len(per), "requests": len(reqs), "requests_finished": len(fin),
            "requests_rejected": int(reqs["rejected"].sum()), "hit_rate": cached / prompt if prompt else 0.0,
            "prefill_tokens": int(prompt - cached), "ttft_mean_s": float(fin["ttft_s"].mean()),
            "ttft_p50_s": _q(fin["ttft_s"], 0.5), "ttft_p99_s": _q(fin["ttft_s"], 0.99),
            "e2e_p99_s": _q(fin["e2e_s"], 0.99), "max_replica_share": float(n.max() / max(n.sum(), 1)),
            "replica_ttft_p99_max_s": float(per["ttft_p99_s"].max()), "wall_s": wall_s}
