"""Discrete-event simulation of a deployment with the engine's own Scheduler and KV-cache manager.

The simulator is a front over one ``StepLoop`` (``paged.core.loop``) with the roofline executor
(``paged.sim.executor``) on a ``SimulatedClock``. The front adds the trace's requests when the clock
passes their arrival time, moves the clock to the next arrival while nothing runs, and stamps each
request's times. Memory decisions (admission, preemption, prefix hits, swaps) are therefore exactly
those the real engine makes; only time is modelled.

Prompts are seeded synthetic token ids (``paged.sim.arrivals``), so prefix-cache hits happen only
where the trace says prompts share text.

Invariant at the end of every run: every request finished or was rejected at admission, and
no KV block is in use; the summary reports the latter as ``num_blocks_in_use_at_end`` (tests
assert it is 0) rather than raising, so a leak shows up in the numbers a study keeps.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

import numpy as np
import pandas as pd

from paged import telemetry
from paged.core.clock import SimulatedClock
from paged.core.config import check_share_map, cpu_pool_blocks
from paged.core.events import NullRecorder, Recorder
from paged.core.kv_cache import KVCache
from paged.core.kv_factory import build_kv_manager
from paged.core.loop import Step, StepLoop
from paged.core.record import StepRecord
from paged.core.request import Request
from paged.core.scheduler import Scheduler, SchedulerOutput
from paged.errors import ConfigError, InvalidRequestError, PagedError
from paged.sim.arrivals import Arrivals, SyntheticPrompts
from paged.sim.baselines import ContiguousKVCacheManager
from paged.sim.config import ALLOCATORS, DEFAULT_SWAP_SPACE_GIB, SimConfig, build_cost_model
from paged.sim.cost_model import CostModel, read_calibration, shapes_from_frame, swap_bytes_ratio
from paged.sim.executor import RooflineExecutor
from paged.sim.specs import get_kv_format, get_model, kv_cache_sizing
from paged.sim.summary import summarize
from paged.sim.workload import normalize_trace


class SimulationStuck(PagedError, RuntimeError):
    """No request can make progress and no arrival is pending (e.g. the watermark blocks admission)."""


@dataclass
class SimResult:
    """A finished run.

    - ``summary``: flat dict (``paged.sim.summary``: what ``python -m paged simulate --json`` prints).
    - ``requests``: one row per trace request, in trace order: ``paged.telemetry.REQUEST_COLUMNS``
      (seconds on the simulated clock; NaN where it never happened), then the trace's own columns
      (``arrival_time``, ``prompt_tokens``, ``output_tokens``, ...) and ``rejected``.
    - ``steps``: one row per step: ``paged.telemetry.STEP_COLUMNS`` (the engine's columns), plus
      the sim-only ``kv_internal_fragmentation`` (1 - token_usage while blocks are in use).
    """

    config: SimConfig
    summary: dict[str, Any]
    requests: pd.DataFrame
    steps: pd.DataFrame
    recorder: Recorder | None = field(default=None, repr=False)


@dataclass(slots=True, eq=False)
class _ReqStat:
    """Simulated-clock stamps of one trace request (None: not yet)."""

    index: int
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finish: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0


class Simulator:
    """One simulated deployment (build a new one per run: the scheduler keeps state).

    Steppable: ``for s in sim.iter_steps(trace): ...`` yields the loop's ``Step`` per executed step
    (``s.record``, ``s.row``, ``s.events``: empty unless ``record_events``, ``s.plan``);
    ``sim.kv``, ``sim.scheduler`` and ``sim.recorder`` may be inspected between steps (not
    changed); ``sim.result()`` summarises what ran so far. ``run(trace)`` does both.
    """

    def __init__(self, config: SimConfig | None = None, cost_model: CostModel | None = None) -> None:
        cfg = self.config = config or SimConfig()
        model = get_model(cfg.model)
        if cfg.kv_share_with is not None:  # cross-layer sharing: only the owner layers hold (and cost) K/V
            share = check_share_map(cfg.kv_share_with, model.num_layers)
            model = replace(model, kv_layers=model.num_layers - len(share))
        self.model = model
        if cfg.max_model_len is not None and cfg.max_model_len > model.max_model_len:
            raise ConfigError(f"max_model_len={cfg.max_model_len} exceeds {model.name}'s context of "
                              f"{model.max_model_len} tokens; lower max_model_len (or leave it unset)")
        self.max_model_len = cfg.max_model_len or model.max_model_len
        sched_cfg = cfg.scheduler.resolved(self.max_model_len)
        self.kv_format = get_kv_format(cfg.kv_cache_dtype, model.dtype_bytes)  # 'auto': the model's dtype
        self.sizing = kv_cache_sizing(model, cfg.gpu, cfg.block_size, kv_format=self.kv_format.name,
                                      tensor_parallel=cfg.tensor_parallel,
                                      gpu_memory_utilization=cfg.gpu_memory_utilization,
                                      max_num_batched_tokens=sched_cfg.max_num_batched_tokens,
                                      max_num_seqs=cfg.max_num_seqs)
        self.block_bytes = self.sizing.bytes_per_block  # kv_bytes_per_token(fmt, tp, block_size) x block_size
        self.num_blocks = self._num_blocks()
        self.recorder: Recorder = Recorder() if cfg.record_events else NullRecorder()
        self.layout = model.kv_layout(self.kv_format.name, cfg.tensor_parallel, cfg.block_size)  # groups, pages
        # a block's bytes in host memory (and over a network): fewer with swap compression
        self.host_block_bytes = self.block_bytes * swap_bytes_ratio(cfg.swap_compression, model.head_dim,
                                                                    self.kv_format.name, cfg.block_size)
        if cfg.allocator == "paged":
            num_cpu = cpu_pool_blocks(cfg.cache, cfg.preemption_mode, self.num_blocks, self.host_block_bytes,
                                      default_swap_space_gib=DEFAULT_SWAP_SPACE_GIB)
            self.kv: KVCache = build_kv_manager(cfg.cache, self.num_blocks, num_cpu_blocks=num_cpu,
                                                max_model_len=self.max_model_len, recorder=self.recorder,
                                                layout=self.layout)
        elif self.layout.is_hybrid:
            raise ConfigError(f"{model.name} has a hybrid KV layout ({len(self.layout.groups)} groups); the contiguous "
                              f"baselines reserve full attention only: use allocator='paged'")
        else:
            # same memory, counted in token slots
            self.kv = ContiguousKVCacheManager(self.num_blocks * cfg.block_size, cfg.allocator.split("-")[1],
                                               max_model_len=self.max_model_len, recorder=self.recorder)
        self.scheduler = Scheduler(self.kv, sched_cfg)
        self.cost = cost_model or build_cost_model(cfg, model, self.kv_format.name)
        self.calibration_report = None
        if cfg.calibration and cost_model is None:
            shapes, secs = shapes_from_frame(read_calibration(cfg.calibration))
            self.calibration_report = self.cost.fit(shapes, secs, seed=cfg.prompt_seed)
            self.cost = self.calibration_report.model
        self._ran = False
        self._trace: pd.DataFrame | None = None
        self._stats: list[_ReqStat] = []
        self._rejected: list[tuple[int, str]] = []
        self._tbt = array("d")
        self._rows: list[StepRecord] = []
        self.clock = SimulatedClock()
        self.loop = StepLoop(self.scheduler, RooflineExecutor(self.cost, self.block_bytes), self.clock, observer=self)
        self._done = 0
        self._wall = 0.0
        self._bar = None
        self._callback: Callable[[int], None] | None = None

    def _num_blocks(self) -> int:
        """GPU blocks: ``num_blocks``, else ``kv_cache_memory_bytes`` of blocks, else what fits."""
        cfg = self.config
        if cfg.num_blocks is not None:
            return cfg.num_blocks
        if cfg.kv_cache_memory_bytes is not None:
            n = int(cfg.kv_cache_memory_bytes // self.block_bytes)
            if n < 1:
                raise ConfigError(f"kv_cache_memory_bytes={cfg.kv_cache_memory_bytes} bytes hold no block of "
                                  f"{self.block_bytes:,} bytes; raise it or give num_blocks")
            return n
        return self.sizing.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.config.block_size

    def run(self, trace: pd.DataFrame, progress: bool | Callable[[int], None] = False) -> SimResult:
        """Simulate ``trace`` to completion (see module docstring). ``progress``: tqdm bar or callback."""
        for _ in self.iter_steps(trace, progress):
            pass
        return self.result()

    def iter_steps(self, trace: pd.DataFrame,
                   progress: bool | Callable[[int], None] = False) -> Iterator[Step]:
        """Simulate ``trace`` one step at a time, yielding each executed step (see class doc).

        Time spent by the consumer between steps is not counted in ``wall_s``."""
        arrivals = self._start(trace, progress)
        toks = SyntheticPrompts(self.model.vocab_size, self.config.prompt_seed)
        sched, loop, clock, rejected = self.scheduler, self.loop, self.clock, self._rejected
        wall0 = time.perf_counter()
        while self._done + len(rejected) < arrivals.n:
            self._admit(arrivals, toks, clock.now())
            if not sched.has_unfinished_requests():
                if arrivals.next < arrivals.n:
                    clock.advance_to(arrivals.clock_after_idle(clock.now()))
                continue
            step = loop.step()
            if step.record is None:
                clock.advance_to(self._idle(step.plan, arrivals, clock.now()))
                continue
            self._rows.append(step.record)
            self._wall += time.perf_counter() - wall0
            yield step
            wall0 = time.perf_counter()
        self._wall += time.perf_counter() - wall0
        self._close_bar()

    # ---- the steps of iter_steps ------------------------------------------------------
    def _start(self, trace: pd.DataFrame, progress: bool | Callable[[int], None]) -> Arrivals:
        """Take the trace (once per simulator) and set up per-request stamps and progress."""
        if self._ran:
            raise ConfigError("a Simulator runs once; build a new one for another run")
        self._ran = True
        tr = self._trace = normalize_trace(trace)
        self._stats.extend(_ReqStat(i) for i in range(len(tr)))
        if progress is True:
            from tqdm.auto import tqdm
            self._bar = tqdm(total=len(tr), unit="req", desc=f"simulate {self.config.allocator}", leave=False)
        self._callback = progress if callable(progress) else None
        return Arrivals(tr)

    def _admit(self, arrivals: Arrivals, toks: SyntheticPrompts, clock: float) -> None:
        """Add every request that has arrived by ``clock`` (a request that can never be served
        is rejected, with the reason, before its prompt is synthesised)."""
        a, stats, rejected, max_len = arrivals, self._stats, self._rejected, self.max_model_len
        while a.next < a.n and a.time[a.next] <= clock:
            i = a.next
            a.next += 1
            p, o = int(a.prompt[i]), int(a.output[i])
            if p + o > max_len:  # checked before synthesising: a 1e11-token row must not allocate
                rejected.append((i, f"request {i}: prompt ({p}) + output ({o}) = {p + o} tokens exceeds "
                                    f"max_model_len={max_len}; shorten the row or raise max_model_len"))
                continue
            req = Request(str(i), a.prompt_ids(i, toks), o, arrival_time=float(a.time[i]),
                          priority=int(a.priority[i]) if a.priority is not None else 0, data=stats[i])
            try:
                self.loop.add_request(req)
            except InvalidRequestError as exc:
                rejected.append((i, str(exc)))

    def _idle(self, plan: SchedulerOutput, arrivals: Arrivals, clock: float) -> float:
        """The clock after a plan with no work: unchanged after a preemption or swap (the next plan
        has room), the next arrival otherwise; SimulationStuck when nothing can ever run."""
        if plan.preempted or plan.swap_out:
            return clock
        later = arrivals.clock_after_idle(clock)
        if later is None:
            raise SimulationStuck(
                f"step {plan.step}: {plan.num_waiting} waiting, {plan.num_swapped} swapped requests cannot be "
                f"scheduled and no arrival is pending; lower the watermark or give the cache more blocks")
        return later

    def after_update(self, step: Step) -> None:
        """The loop's observer: stamp the step's requests (first scheduled at the step's start,
        tokens at its end, gaps into the TBT samples, in batch order) and the finished ones."""
        clock, t_end, batch = step.start_s, step.end_s, step.plan.batch
        tbt_append = self._tbt.append
        for sampled, i in batch.runs():  # a run of the decode lane (one token each), then chunk i
            if i >= 0:
                r = batch.requests[i]
                if r.data.first_scheduled is None:
                    r.data.first_scheduled = clock
                if batch.samples[i]:
                    sampled = [*sampled, r]
            for r in sampled:
                d = r.data
                last = d.last_token
                if last is None:
                    d.first_token = t_end
                else:
                    tbt_append(t_end - last)
                d.last_token = t_end
        if step.finished:
            self._finish(step.finished, t_end)

    def _finish(self, finished: list[Request], t_end: float) -> None:
        """Stamp the requests that finished at ``t_end`` and report progress."""
        for r in finished:
            d = r.data
            d.finish = t_end
            d.num_preemptions = r.num_preemptions
            d.num_cached_tokens = max(r.num_cached_tokens, 0)
        self.scheduler.take_finished()
        self._done += len(finished)
        if self._bar is not None:
            self._bar.update(len(finished))
        if self._callback is not None:
            self._callback(self._done)

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    # ---- results -------------------------------------------------------------------
    def tbt_samples(self) -> np.ndarray:
        """Every simulated gap between two consecutive tokens of a request so far (seconds)."""
        return np.frombuffer(self._tbt, dtype=np.float64).copy() if len(self._tbt) else np.empty(0)

    def result(self) -> SimResult:
        """What ran so far (all of the trace after a full ``iter_steps``/``run``)."""
        if self._trace is None:
            raise ConfigError("nothing simulated yet; call run(trace) or iterate iter_steps(trace) first")
        self._close_bar()
        cfg, tr, rejected = self.config, self._trace, self._rejected
        P, O = tr["prompt_tokens"].to_numpy(), tr["output_tokens"].to_numpy()
        arr = tr["arrival_time"].to_numpy(dtype=np.float64)
        request_row = telemetry.request_row
        reqs = telemetry.requests_frame(
            request_row(str(d.index), float(arr[d.index]), int(P[d.index]), int(O[d.index]), d.first_scheduled,
                        d.first_token, d.last_token, d.finish,
                        # one token per sampling step: a finished request had as many as its trace says
                        int(O[d.index]) if d.finish is not None else 0, d.num_preemptions, d.num_cached_tokens)
            for d in self._stats)
        for col in tr.columns:
            reqs[col] = tr[col].to_numpy()
        reqs["rejected"] = np.isin(np.arange(len(reqs)), [i for i, _ in rejected])  # at admission: trace rows
        st = telemetry.steps_frame(self._rows)
        st["kv_internal_fragmentation"] = np.where(st["kv_cache_usage_perc"] > 0, 1.0 - st["token_usage"], 0.0)
        summary = summarize(self, reqs, st, self._tbt, rejected, self._wall)
        return SimResult(cfg, summary, reqs, st, self.recorder if cfg.record_events else None)


def simulate(trace: pd.DataFrame, config: SimConfig | None = None, progress: bool = False,
             cost_model: CostModel | None = None, **overrides: Any) -> SimResult:
    """Run ``trace`` on a fresh ``Simulator(config with overrides)``."""
    cfg = config or SimConfig()
    if overrides:
        SimConfig.check_names(overrides)  # an unknown name: a ConfigError listing the valid ones
        cfg = replace(cfg, **overrides)
    return Simulator(cfg, cost_model).run(trace, progress=progress)


__all__ = ["ALLOCATORS", "SimConfig", "SimResult", "Simulator", "SimulationStuck", "simulate",
           "build_cost_model"]
