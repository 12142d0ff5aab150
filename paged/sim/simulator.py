"""Discrete-event simulation of a deployment with the engine's own Scheduler and KV-cache manager.

The loop: requests of a trace are added when the simulated clock passes their arrival time;
``Scheduler.schedule()`` plans a step; the ``CostModel`` turns the plan (new tokens and cached
context per chunk, swapped and copied blocks) into a duration; every chunk that samples gets a
dummy token (no stop tokens, so a request ends at its trace output length); ``Scheduler.update``
moves requests on. Memory decisions (admission, preemption, prefix hits, swaps) are therefore
exactly those the real engine makes; only time is modelled.

Prompts are synthesized token ids (seeded): requests with the same ``prefix_id`` share their
first ``prefix_tokens`` ids, everything else is random over the vocabulary, so prefix-cache hits
happen only where the trace says prompts share text.

Invariant at the end of every run: every request finished or was rejected at admission, and
no KV block is in use; the summary reports the latter as ``num_blocks_in_use_at_end`` (tests
assert it is 0) rather than raising, so a leak shows up in the numbers a study keeps.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import pandas as pd

from paged import telemetry
from paged.checks import is_int
from paged.core.events import Event, NullRecorder, Recorder
from paged.core.kv_manager import KVCacheManager
from paged.core.plan import DecodeRun
from paged.core.request import Request
from paged.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from paged.errors import ConfigError, InvalidRequestError, PagedError
from paged.sim.baselines import ContiguousKVCacheManager
from paged.sim.cost_model import CostModel, plan_shape, swap_bytes_ratio
from paged.sim.specs import GiB, ModelSpec, get_gpu, get_model, kv_cache_sizing
from paged.sim.summary import summarize
from paged.sim.workload import normalize_trace

ALLOCATORS = ("contiguous-max", "contiguous-pow2", "contiguous-oracle", "paged")  # as the vLLM paper draws them
DUMMY_TOKEN = 17  # first non-control id of SmolLM2's vocabulary; never a stop token here


class SimulationStuck(PagedError, RuntimeError):
    """No request can make progress and no arrival is pending (e.g. the watermark blocks admission)."""


@dataclass
class SimConfig:
    """Everything a simulated deployment needs besides its trace."""

    model: str = "llama-2-13b"
    gpu: str = "a100-80gb"
    tensor_parallel: int = 1
    block_size: int = 16
    num_blocks: int | None = None  # None: what fits at gpu_memory_utilization
    gpu_memory_utilization: float = 0.9
    kv_format: str = "fp16"
    allocator: str = "paged"
    enable_chunked_prefill: bool = True
    max_num_batched_tokens: int | None = None  # None: the engine's rule (SchedulerConfig.of)
    max_num_seqs: int = 256
    preemption_mode: str = "recompute"
    policy: str = "fcfs"
    watermark: float = 0.01
    enable_prefix_caching: bool = True
    # block compaction (see EngineConfig; paged.core.compaction): its copies are charged like CoW copies (HBM)
    enable_block_compaction: bool = False
    compaction_threshold: float = 0.25
    compaction_interval: int = 16
    compaction_max_copies: int | None = None
    compaction_drop_cached: bool = False
    swap_space_gib: float = 4.0  # CPU pool per GPU for preemption_mode="swap" and the host tier (shared)
    # host tier (paged.core.host_tier): see EngineConfig; its copies are charged like swaps (over PCIe)
    eviction: str = "lru"
    enable_host_tier: bool = False
    host_eviction: str = "lru"
    host_tier_threshold: float = 1.0
    max_model_len: int | None = None  # None: the model's
    hash_fn: str = "builtin"  # prefix hits are verified on tokens, so a fast hash is safe
    paged_kernel_penalty: bool = True  # slow KV reads for small blocks (see cost_model)
    swap_overlap: bool = False  # swaps beside the forward (EngineConfig.swap_mode='overlap'; see cost_model)
    swap_compression: str | None = None  # None | 'fp8' | 'int4' host blocks (fewer link bytes)
    mfu: float | None = None
    mbu: float | None = None
    step_overhead_s: float | None = None
    calibration: str | None = None  # CSV from cost_model.calibration_frame: fit the cost model to it
    seed: int = 0
    record_events: bool = False

    def __post_init__(self) -> None:
        if self.allocator not in ALLOCATORS:
            raise ConfigError(f"allocator must be one of {ALLOCATORS}, got {self.allocator!r}")
        if self.max_model_len is not None and (not is_int(self.max_model_len) or self.max_model_len < 1):
            raise ConfigError(f"max_model_len must be a positive integer (None: the model's), "
                              f"got {self.max_model_len!r}")
        for name in ("swap_space_gib", "step_overhead_s"):
            v = getattr(self, name)
            if v is not None and not (v >= 0 and v < float("inf")):
                raise ConfigError(f"{name} must be a finite number >= 0, got {v!r}")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SimResult:
    """A finished run.

    - ``summary``: flat dict (what ``python -m paged simulate --json`` prints); usages are
      time-weighted means over steps with blocks in use.
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


class SimStep:
    """One simulated step: ``row`` (``paged.telemetry.STEP_COLUMNS``), the step's ``events``
    (empty unless ``record_events``) and the scheduler's ``plan``."""

    __slots__ = ("row", "events", "plan")

    def __init__(self, row: dict[str, Any], events: list[Event], plan: SchedulerOutput) -> None:
        self.row, self.events, self.plan = row, events, plan


class _ReqStat:
    """Simulated-clock stamps of one trace request (None: not yet)."""

    __slots__ = ("index", "first_scheduled", "first_token", "last_token", "finish", "num_preemptions",
                 "num_cached_tokens")

    def __init__(self, index: int) -> None:
        self.index = index
        self.first_scheduled: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.finish: float | None = None
        self.num_preemptions = 0
        self.num_cached_tokens = 0


class _Tokens:
    """Seeded synthetic prompt token ids; shared prefixes are identical across requests."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        self.lo, self.hi = 17, max(vocab_size, 18)
        self.rng = np.random.default_rng(seed)
        self.seed = seed
        self.prefixes: dict[int, np.ndarray] = {}

    def prompt(self, n: int, prefix_id: int, prefix_tokens: int) -> list[int]:
        if prefix_id < 0 or prefix_tokens <= 0:
            return self.rng.integers(self.lo, self.hi, n).tolist()
        pre = self.prefixes.get(prefix_id)
        if pre is None or len(pre) < prefix_tokens:
            pre = np.random.default_rng([self.seed, 1 + prefix_id]).integers(self.lo, self.hi, max(prefix_tokens, 1))
            self.prefixes[prefix_id] = pre
        own = self.rng.integers(self.lo, self.hi, n - prefix_tokens)
        return np.concatenate([pre[:prefix_tokens], own]).tolist()


def build_cost_model(cfg: SimConfig, model: ModelSpec) -> CostModel:
    kw: dict[str, Any] = {}
    for k in ("mfu", "mbu", "step_overhead_s"):
        if getattr(cfg, k) is not None:
            kw[k] = getattr(cfg, k)
    bs = cfg.block_size if (cfg.allocator == "paged" and cfg.paged_kernel_penalty) else None
    return CostModel(model, get_gpu(cfg.gpu), tensor_parallel=cfg.tensor_parallel, kv_format=cfg.kv_format,
                     kv_block_size=bs, swap_overlap=cfg.swap_overlap, swap_compression=cfg.swap_compression, **kw)


class Simulator:
    """One simulated deployment (build a new one per run: the scheduler keeps state).

    Steppable: ``for s in sim.iter_steps(trace): ...`` yields a ``SimStep`` per executed step;
    ``sim.kv``, ``sim.scheduler`` and ``sim.recorder`` may be inspected between steps (not
    changed); ``sim.result()`` summarises what ran so far. ``run(trace)`` does both.
    """

    def __init__(self, config: SimConfig | None = None, cost_model: CostModel | None = None) -> None:
        cfg = self.config = config or SimConfig()
        self.model = get_model(cfg.model)
        if cfg.max_model_len is not None and cfg.max_model_len > self.model.max_model_len:
            raise ConfigError(f"max_model_len={cfg.max_model_len} exceeds {self.model.name}'s context of "
                              f"{self.model.max_model_len} tokens; lower max_model_len (or leave it unset)")
        self.max_model_len = cfg.max_model_len or self.model.max_model_len
        sched_cfg = SchedulerConfig.of(cfg, self.max_model_len)
        self.sizing = kv_cache_sizing(self.model, cfg.gpu, cfg.block_size, kv_format=cfg.kv_format,
                                      tensor_parallel=cfg.tensor_parallel,
                                      gpu_memory_utilization=cfg.gpu_memory_utilization,
                                      max_num_batched_tokens=sched_cfg.max_num_batched_tokens,
                                      max_num_seqs=cfg.max_num_seqs)
        self.num_blocks = cfg.num_blocks if cfg.num_blocks is not None else self.sizing.num_blocks
        self.block_bytes = self.sizing.bytes_per_block  # kv_bytes_per_token(fmt, tp, block_size) x block_size
        self.recorder: Recorder = Recorder() if cfg.record_events else NullRecorder()
        if cfg.allocator == "paged":
            host_block = self.block_bytes * swap_bytes_ratio(cfg.swap_compression, self.model.head_dim, cfg.kv_format,
                                                             cfg.block_size)  # compressed host blocks are smaller
            num_cpu = (int(cfg.swap_space_gib * GiB // host_block)
                       if cfg.preemption_mode == "swap" or cfg.enable_host_tier else 0)
            self.kv: KVCacheManager = KVCacheManager(
                self.num_blocks, cfg.block_size, enable_prefix_caching=cfg.enable_prefix_caching,
                hash_fn=cfg.hash_fn, num_cpu_blocks=num_cpu, max_model_len=self.max_model_len,
                recorder=self.recorder, eviction=cfg.eviction, host_tier=cfg.enable_host_tier,
                host_eviction=cfg.host_eviction, host_tier_threshold=cfg.host_tier_threshold)
        else:
            # same memory, counted in token slots
            self.kv = ContiguousKVCacheManager(self.num_blocks * cfg.block_size, cfg.allocator.split("-")[1],
                                               max_model_len=self.max_model_len, recorder=self.recorder)
        self.scheduler = Scheduler(self.kv, sched_cfg)
        self.cost = cost_model or build_cost_model(cfg, self.model)
        self.calibration_report = None
        if cfg.calibration and cost_model is None:
            from paged.sim.cost_model import read_calibration, shapes_from_frame

            shapes, secs = shapes_from_frame(read_calibration(cfg.calibration))
            self.calibration_report = self.cost.fit(shapes, secs, seed=cfg.seed)
            self.cost = self.calibration_report.model
        self._ran = False
        self._trace: pd.DataFrame | None = None
        self._stats: list[_ReqStat] = []
        self._rejected: list[tuple[int, str]] = []
        self._tbt = array("d")
        self._rows: list[dict[str, Any]] = []
        self._wall = 0.0
        self._bar = None

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.config.block_size

    def run(self, trace: pd.DataFrame, progress: bool | Callable[[int], None] = False,
            max_steps: int | None = None) -> SimResult:
        """Simulate ``trace`` to completion (see module docstring). ``progress``: tqdm bar or callback."""
        for _ in self.iter_steps(trace, progress, max_steps):
            pass
        return self.result()

    def iter_steps(self, trace: pd.DataFrame, progress: bool | Callable[[int], None] = False,
                   max_steps: int | None = None) -> Iterator[SimStep]:
        """Simulate ``trace`` one step at a time, yielding each executed step (see class doc).

        Time spent by the consumer between steps is not counted in ``wall_s``."""
        if self._ran:
            raise ConfigError("a Simulator runs once; build a new one for another run")
        self._ran = True
        tr = self._trace = normalize_trace(trace)
        n = len(tr)
        arr = tr["arrival_time"].to_numpy(dtype=np.float64)
        P = tr["prompt_tokens"].to_numpy()
        O = tr["output_tokens"].to_numpy()
        pid = tr["prefix_id"].to_numpy()
        ptok = tr["prefix_tokens"].to_numpy()
        priority = tr["priority"].to_numpy() if "priority" in tr.columns else None
        toks = _Tokens(self.model.vocab_size, self.config.seed)
        sched, cost, recorder = self.scheduler, self.cost, self.recorder
        block_bytes = self.block_bytes
        stats, rejected, rows = self._stats, self._rejected, self._rows
        stats.extend(_ReqStat(i) for i in range(n))
        if progress is True:
            from tqdm.auto import tqdm
            self._bar = tqdm(total=n, unit="req", desc=f"simulate {self.config.allocator}", leave=False)
        bar = self._bar
        callback = progress if callable(progress) else None
        step_time = cost.step_time
        tbt_append = self._tbt.append
        step_row = telemetry.step_row
        sampled: dict[str, int] = {}  # the executor's tokens: DUMMY_TOKEN for every request ever added

        wall0 = time.perf_counter()
        clock, nxt, done, n_steps = 0.0, 0, 0, 0
        while done + len(rejected) < n:
            while nxt < n and arr[nxt] <= clock:
                p, o = int(P[nxt]), int(O[nxt])
                if p + o > self.max_model_len:  # checked before synthesising: a 1e11-token row must not allocate
                    rejected.append((nxt, f"request {nxt}: prompt ({p}) + output ({o}) = {p + o} tokens exceeds "
                                          f"max_model_len={self.max_model_len}; shorten the row or raise "
                                          "max_model_len"))
                    nxt += 1
                    continue
                req = Request(str(nxt), toks.prompt(p, int(pid[nxt]), int(ptok[nxt])), o,
                              arrival_time=float(arr[nxt]), priority=int(priority[nxt]) if priority is not None else 0,
                              data=stats[nxt])
                try:
                    sched.add_request(req)
                    sampled[req.request_id] = DUMMY_TOKEN
                except InvalidRequestError as exc:
                    rejected.append((nxt, str(exc)))
                nxt += 1
            if not sched.has_unfinished_requests():
                if nxt < n:
                    clock = max(clock, float(arr[nxt]))
                continue
            mark = len(recorder)
            plan = sched.schedule()
            work = plan.work
            if not work:
                if plan.preempted or plan.swap_out:
                    continue
                if nxt < n:
                    clock = max(clock, float(arr[nxt]))
                    continue
                raise SimulationStuck(
                    f"step {plan.step}: {plan.num_waiting} waiting, {plan.num_swapped} swapped requests cannot be "
                    f"scheduled and no arrival is pending; lower the watermark or give the cache more blocks")
            moved = len(plan.swap_out) + len(plan.swap_in) + len(plan.tier_out) + len(plan.tier_in)  # over PCIe
            shape = plan_shape(work, moved, len(plan.block_copies) + len(plan.compaction_copies), block_bytes)
            dt = step_time(shape)
            t_end = clock + dt
            num_decode = 0
            for w in work:  # time stamps of every request the step samples for, in batch order
                if w.__class__ is DecodeRun:  # admitted in an earlier step: first_scheduled is set
                    reqs, starts = w.requests, w.starts
                else:
                    d = w.request.data
                    if d.first_scheduled is None:
                        d.first_scheduled = clock
                    if not w.samples:
                        continue
                    reqs, starts = (w.request,), (w.start if w.is_decode else -1,)  # -1: not counted as decode
                for r, start in zip(reqs, starts):
                    d = r.data
                    last = d.last_token
                    if last is None:
                        d.first_token = t_end
                    else:
                        tbt_append(t_end - last)
                    d.last_token = t_end
                    if start >= r.num_prompt_tokens:  # a decode, not the last token of a prompt
                        num_decode += 1
            finished = sched.update(plan, sampled)
            num_tokens = shape.num_tokens
            row = step_row(plan, time_s=clock, step_time_s=dt, num_batched_tokens=num_tokens,
                           num_prefill_tokens=num_tokens - num_decode, num_decode_tokens=num_decode,
                           num_finished=len(finished))
            rows.append(row)
            clock = t_end
            n_steps += 1
            if finished:
                for r in finished:
                    d = r.data
                    d.finish = t_end
                    d.num_preemptions = r.num_preemptions
                    d.num_cached_tokens = max(r.num_cached_tokens, 0)
                sched.take_finished()
                done += len(finished)
                if bar is not None:
                    bar.update(len(finished))
                if callback is not None:
                    callback(done)
            now = time.perf_counter()
            self._wall += now - wall0
            yield SimStep(row, recorder.since(mark), plan)
            wall0 = time.perf_counter()
            if max_steps is not None and n_steps >= max_steps:
                break
        self._wall += time.perf_counter() - wall0
        self._close_bar()

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
        reqs["rejected"] = False
        for i, _ in rejected:
            reqs.loc[i, "rejected"] = True
        st = telemetry.steps_frame(self._rows)
        st["kv_internal_fragmentation"] = np.where(st["kv_cache_usage_perc"] > 0, 1.0 - st["token_usage"], 0.0)
        summary = summarize(self, reqs, st, self._tbt, rejected, self._wall)
        return SimResult(cfg, summary, reqs, st, self.recorder if cfg.record_events else None)


def simulate(trace: pd.DataFrame, config: SimConfig | None = None, progress: bool = False,
             cost_model: CostModel | None = None, **overrides: Any) -> SimResult:
    """Run ``trace`` on a fresh ``Simulator(config with overrides)``."""
    cfg = config or SimConfig()
    if overrides:
        cfg = SimConfig(**{**cfg.as_dict(), **overrides})
    return Simulator(cfg, cost_model).run(trace, progress=progress)


__all__ = ["ALLOCATORS", "SimConfig", "SimResult", "SimStep", "Simulator", "SimulationStuck", "simulate",
           "build_cost_model"]
