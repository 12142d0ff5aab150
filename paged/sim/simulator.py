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
from typing import Any, Callable

import numpy as np
import pandas as pd

from paged.sim.baselines import ContiguousKVCacheManager
from paged.sim.specs import GiB, ModelSpec, get_gpu, get_model, kv_cache_sizing
from paged.sim.cost_model import CostModel, StepShape
from paged.errors import ConfigError, InvalidRequestError, PagedError
from paged.core.events import NullRecorder, Recorder
from paged.core.kv_manager import KVCacheManager
from paged.core.request import Request
from paged.core.scheduler import Scheduler, SchedulerConfig
from paged.sim.workload import normalize_trace

ALLOCATORS = ("paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle")
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
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    preemption_mode: str = "recompute"
    policy: str = "fcfs"
    watermark: float = 0.01
    enable_prefix_caching: bool = True
    swap_space_gib: float = 4.0  # CPU pool per GPU for preemption_mode="swap"
    max_model_len: int | None = None  # None: the model's
    hash_fn: str = "builtin"  # prefix hits are verified on tokens, so a fast hash is safe
    paged_kernel_penalty: bool = True  # slow KV reads for small blocks (see cost_model)
    mfu: float | None = None
    mbu: float | None = None
    step_overhead_s: float | None = None
    calibration: str | None = None  # CSV from cost_model.calibration_frame: fit the cost model to it
    seed: int = 0
    record_events: bool = False

    def __post_init__(self) -> None:
        if self.allocator not in ALLOCATORS:
            raise ConfigError(f"allocator must be one of {ALLOCATORS}, got {self.allocator!r}")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SimResult:
    """A finished run.

    - ``summary``: flat dict (what ``python -m paged simulate --json`` prints); usages are
      time-weighted means over steps with blocks in use.
    - ``requests``: the trace plus ``first_scheduled``, ``first_token_time``, ``last_token_time``,
      ``finish_time``, ``ttft``, ``queueing_time``, ``e2e_latency``, ``num_preemptions``,
      ``num_cached_tokens``, ``rejected`` (seconds on the simulated clock).
    - ``steps``: one row per step: ``time`` (start), ``duration``, ``num_seqs``, prefill/decode
      tokens, ``kv_block_usage`` (used / all blocks), ``kv_token_usage`` (slots holding tokens /
      slots of used blocks), ``kv_internal_fragmentation``, ``num_cached_free_blocks``, queue
      lengths, preemptions and swapped blocks.
    """

    config: SimConfig
    summary: dict[str, Any]
    requests: pd.DataFrame
    steps: pd.DataFrame
    recorder: Recorder | None = field(default=None, repr=False)


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
                     kv_block_size=bs, **kw)


class Simulator:
    """One simulated deployment (build a new one per run: the scheduler keeps state)."""

    def __init__(self, config: SimConfig | None = None, cost_model: CostModel | None = None) -> None:
        cfg = self.config = config or SimConfig()
        self.model = get_model(cfg.model)
        self.max_model_len = cfg.max_model_len or self.model.max_model_len
        self.sizing = kv_cache_sizing(self.model, cfg.gpu, cfg.block_size, kv_format=cfg.kv_format,
                                      tensor_parallel=cfg.tensor_parallel,
                                      gpu_memory_utilization=cfg.gpu_memory_utilization,
                                      max_num_batched_tokens=cfg.max_num_batched_tokens,
                                      max_num_seqs=cfg.max_num_seqs)
        self.num_blocks = cfg.num_blocks if cfg.num_blocks is not None else self.sizing.num_blocks
        self.block_bytes = self.sizing.bytes_per_block  # kv_bytes_per_token(fmt, tp, block_size) x block_size
        self.recorder: Recorder = Recorder() if cfg.record_events else NullRecorder()
        if cfg.allocator == "paged":
            num_cpu = int(cfg.swap_space_gib * GiB // self.block_bytes) if cfg.preemption_mode == "swap" else 0
            self.kv: KVCacheManager = KVCacheManager(
                self.num_blocks, cfg.block_size, enable_prefix_caching=cfg.enable_prefix_caching,
                hash_fn=cfg.hash_fn, num_cpu_blocks=num_cpu, max_model_len=self.max_model_len,
                recorder=self.recorder)
        else:
            # same memory, counted in token slots
            self.kv = ContiguousKVCacheManager(self.num_blocks * cfg.block_size, cfg.allocator.split("-")[1],
                                               max_model_len=self.max_model_len, recorder=self.recorder)
        self.scheduler = Scheduler(self.kv, SchedulerConfig(
            max_num_batched_tokens=cfg.max_num_batched_tokens, max_num_seqs=cfg.max_num_seqs,
            enable_chunked_prefill=cfg.enable_chunked_prefill, preemption_mode=cfg.preemption_mode,
            policy=cfg.policy, watermark=cfg.watermark))
        self.cost = cost_model or build_cost_model(cfg, self.model)
        self.calibration_report = None
        if cfg.calibration and cost_model is None:
            from paged.sim.cost_model import shapes_from_frame

            shapes, secs = shapes_from_frame(pd.read_csv(cfg.calibration))
            self.calibration_report = self.cost.fit(shapes, secs, seed=cfg.seed)
            self.cost = self.calibration_report.model
        self._ran = False

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.config.block_size

    def run(self, trace: pd.DataFrame, progress: bool | Callable[[int], None] = False,
            max_steps: int | None = None) -> SimResult:
        """Simulate ``trace`` to completion (see module docstring). ``progress``: tqdm bar or callback."""
        if self._ran:
            raise ConfigError("a Simulator runs once; build a new one for another run")
        self._ran = True
        tr = normalize_trace(trace)
        n = len(tr)
        arr = tr["arrival_time"].to_numpy(dtype=np.float64)
        P = tr["prompt_tokens"].to_numpy()
        O = tr["output_tokens"].to_numpy()
        pid = tr["prefix_id"].to_numpy()
        ptok = tr["prefix_tokens"].to_numpy()
        priority = tr["priority"].to_numpy() if "priority" in tr.columns else None
        toks = _Tokens(self.model.vocab_size, self.config.seed)
        sched, kv, cost = self.scheduler, self.kv, self.cost
        block_bytes, bs = self.block_bytes, self.config.block_size

        # per request (in Request.data): [index, first_scheduled, first_token, last_token]; -1 = not yet
        finish = np.full(n, -1.0)
        info: list[list] = [None] * n  # type: ignore[list-item]
        preempts = np.zeros(n, dtype=np.int64)
        cached = np.zeros(n, dtype=np.int64)
        rejected: list[tuple[int, str]] = []
        tbt = array("d")
        steps: list[tuple] = []
        bar = None
        if progress is True:
            from tqdm.auto import tqdm
            bar = tqdm(total=n, unit="req", desc=f"simulate {self.config.allocator}", leave=False)
        callback = progress if callable(progress) else None
        step_time = cost.step_time
        tbt_append = tbt.append

        wall0 = time.perf_counter()
        clock, nxt, done, n_steps = 0.0, 0, 0, 0
        while done + len(rejected) < n:
            while nxt < n and arr[nxt] <= clock:
                d = info[nxt] = [nxt, -1.0, -1.0, -1.0]
                req = Request(str(nxt), toks.prompt(int(P[nxt]), int(pid[nxt]), int(ptok[nxt])), int(O[nxt]),
                              arrival_time=float(arr[nxt]), priority=int(priority[nxt]) if priority is not None else 0,
                              data=d)
                try:
                    sched.add_request(req)
                except InvalidRequestError as exc:
                    rejected.append((nxt, str(exc)))
                nxt += 1
            if not sched.has_unfinished_requests():
                if nxt < n:
                    clock = max(clock, float(arr[nxt]))
                continue
            plan = sched.schedule()
            chunks = plan.scheduled
            if not chunks:
                if plan.preempted or plan.swap_out:
                    continue
                if nxt < n:
                    clock = max(clock, float(arr[nxt]))
                    continue
                raise SimulationStuck(
                    f"step {plan.step}: {plan.num_waiting} waiting, {plan.num_swapped} swapped requests cannot be "
                    f"scheduled and no arrival is pending; lower the watermark or give the cache more blocks")
            qs: list[int] = []
            cs: list[int] = []
            sampling: list[list] = []
            sampled: dict[str, int] = {}
            num_decode = 0
            for c in chunks:
                r = c.request
                d = r.data
                if d[1] < 0:
                    d[1] = clock
                nt, st = c.num_tokens, c.start
                qs.append(nt)
                cs.append(st)
                if c.samples:
                    sampled[r.request_id] = DUMMY_TOKEN
                    sampling.append(d)
                    if nt == 1 and st >= r.num_prompt_tokens:
                        num_decode += 1
            swap_blocks = len(plan.swap_out) + len(plan.swap_in)
            q = np.array(qs, dtype=np.float64)
            dt = step_time(StepShape(q, np.array(cs, dtype=np.float64), len(sampling), swap_blocks * block_bytes,
                                     len(plan.block_copies) * block_bytes))
            t_end = clock + dt
            for d in sampling:
                last = d[3]
                if last < 0:
                    d[2] = t_end
                else:
                    tbt_append(t_end - last)
                d[3] = t_end
            steps.append((clock, dt, len(chunks), sum(qs) - num_decode, num_decode, plan.kv_cache_usage_perc,
                          plan.token_usage, plan.num_waiting, plan.num_running, plan.num_swapped,
                          len(plan.preempted), swap_blocks, kv.num_cached_free_blocks))
            finished = sched.update(plan, sampled)
            clock = t_end
            n_steps += 1
            if finished:
                for r in finished:
                    i = r.data[0]
                    finish[i] = t_end
                    preempts[i] = r.num_preemptions
                    cached[i] = max(r.num_cached_tokens, 0)
                sched.take_finished()
                done += len(finished)
                if bar is not None:
                    bar.update(len(finished))
                if callback is not None:
                    callback(done)
            if max_steps is not None and n_steps >= max_steps:
                break
        wall = time.perf_counter() - wall0
        if bar is not None:
            bar.close()
        rec = np.array([d[1:] if d is not None else [-1.0] * 3 for d in info], dtype=np.float64).reshape(n, 3)
        rec = np.column_stack([rec, finish])
        return self._result(tr, rec, preempts, cached, rejected, tbt, steps, wall)

    # ---- results -------------------------------------------------------------------
    def _result(self, tr: pd.DataFrame, rec: np.ndarray, preempts: np.ndarray, cached: np.ndarray,
                rejected: list[tuple[int, str]], tbt: array, steps: list[tuple], wall: float) -> SimResult:
        cfg, kv = self.config, self.kv
        reqs = tr.copy()
        reqs["first_scheduled"], reqs["first_token_time"], reqs["last_token_time"], reqs["finish_time"] = rec.T
        reqs["ttft"] = np.where(rec[:, 1] >= 0, rec[:, 1] - reqs["arrival_time"], np.nan)
        reqs["queueing_time"] = np.where(rec[:, 0] >= 0, rec[:, 0] - reqs["arrival_time"], np.nan)
        reqs["e2e_latency"] = np.where(rec[:, 3] >= 0, rec[:, 3] - reqs["arrival_time"], np.nan)
        reqs["num_preemptions"] = preempts
        reqs["num_cached_tokens"] = cached
        reqs["rejected"] = False
        for i, _ in rejected:
            reqs.loc[i, "rejected"] = True
        st = pd.DataFrame(steps, columns=["time", "duration", "num_seqs", "num_prefill_tokens", "num_decode_tokens",
                                          "kv_block_usage", "kv_token_usage", "num_waiting", "num_running",
                                          "num_swapped", "num_preempted", "num_swap_blocks", "num_cached_free_blocks"])
        st["kv_internal_fragmentation"] = np.where(st["kv_block_usage"] > 0, 1.0 - st["kv_token_usage"], 0.0)
        ok = reqs["finish_time"] >= 0
        fin = reqs[ok]
        t0 = float(tr["arrival_time"].min()) if len(tr) else 0.0
        t1 = float(fin["finish_time"].max()) if len(fin) else t0
        span = max(t1 - t0, 1e-12)
        out_tok = int(fin["output_tokens"].sum())
        in_tok = int(fin["prompt_tokens"].sum())
        busy = st["kv_block_usage"] > 0
        w = st["duration"].to_numpy()
        tbt_a = np.frombuffer(tbt, dtype=np.float64) if len(tbt) else np.empty(0)
        nan = float("nan")

        def q(x: Any, p: float) -> float:
            x = np.asarray(x, dtype=np.float64)
            x = x[~np.isnan(x)]
            return float(np.quantile(x, p)) if len(x) else float("nan")

        def wmean(col: str) -> float:
            m = busy.to_numpy()
            return float(np.average(st[col].to_numpy()[m], weights=w[m])) if m.any() and w[m].sum() > 0 else 0.0

        hits = getattr(kv, "prefix_cache_hits", 0)
        queries = getattr(kv, "prefix_cache_queries", 0)
        tok_use, blk_use = wmean("kv_token_usage"), wmean("kv_block_usage")
        summary: dict[str, Any] = {
            "model": self.model.name, "gpu": cfg.gpu, "tensor_parallel": cfg.tensor_parallel,
            "allocator": cfg.allocator, "block_size": cfg.block_size, "kv_format": cfg.kv_format,
            "num_kv_blocks": self.num_blocks, "kv_capacity_tokens": self.capacity_tokens,
            "requests": len(tr), "requests_finished": int(ok.sum()), "requests_rejected": len(rejected),
            "duration_s": span,
            "throughput_tok_s": out_tok / span, "total_throughput_tok_s": (in_tok + out_tok) / span,
            "throughput_req_s": int(ok.sum()) / span,
            "ttft_mean_s": float(np.nanmean(fin["ttft"])) if len(fin) else nan,
            "ttft_p50_s": q(fin["ttft"], 0.5), "ttft_p99_s": q(fin["ttft"], 0.99),
            # no gaps at all (every output is one token): NaN, not a warning
            "tbt_mean_s": float(tbt_a.mean()) if len(tbt_a) else nan, "tbt_p50_s": q(tbt_a, 0.5),
            "tbt_p99_s": q(tbt_a, 0.99), "tbt_max_s": float(tbt_a.max()) if len(tbt_a) else nan,
            "e2e_p50_s": q(fin["e2e_latency"], 0.5), "e2e_p99_s": q(fin["e2e_latency"], 0.99),
            "queueing_p50_s": q(fin["queueing_time"], 0.5), "queueing_p99_s": q(fin["queueing_time"], 0.99),
            "kv_token_usage_mean": tok_use, "kv_block_usage_mean": blk_use,
            "kv_internal_fragmentation_mean": 1.0 - tok_use if blk_use else 0.0,
            "kv_tokens_per_capacity_mean": wmean_product(st, busy.to_numpy(), w),
            "mean_batch_size": float(np.average(st["num_seqs"], weights=w)) if len(st) else 0.0,
            "num_preemptions": int(sum(self.scheduler.num_preemptions.values())),
            "num_preemptions_swap": int(self.scheduler.num_preemptions.get("swap", 0)),
            "num_swapped_blocks": int(getattr(kv, "num_swapped_out_blocks", 0) + getattr(kv, "num_swapped_in_blocks", 0)),
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "num_blocks_in_use_at_end": int(kv.num_used_blocks),
            "num_steps": len(st), "wall_s": wall, "sim_requests_per_wall_s": int(ok.sum()) / max(wall, 1e-9),
        }
        if self.calibration_report is not None:
            summary["calibration_holdout_mape"] = self.calibration_report.holdout_mape
        if rejected:
            summary["first_rejection"] = rejected[0][1]
        return SimResult(cfg, summary, reqs, st, self.recorder if cfg.record_events else None)


def wmean_product(st: pd.DataFrame, mask: np.ndarray, w: np.ndarray) -> float:
    """Time-weighted mean of slots holding tokens / all slots of the pool."""
    if not mask.any() or w[mask].sum() <= 0:
        return 0.0
    x = st["kv_token_usage"].to_numpy()[mask] * st["kv_block_usage"].to_numpy()[mask]
    return float(np.average(x, weights=w[mask]))


def simulate(trace: pd.DataFrame, config: SimConfig | None = None, progress: bool = False,
             cost_model: CostModel | None = None, **overrides: Any) -> SimResult:
    """Run ``trace`` on a fresh ``Simulator(config with overrides)``."""
    cfg = config or SimConfig()
    if overrides:
        cfg = SimConfig(**{**cfg.as_dict(), **overrides})
    return Simulator(cfg, cost_model).run(trace, progress=progress)


__all__ = ["ALLOCATORS", "SimConfig", "SimResult", "Simulator", "SimulationStuck", "simulate", "build_cost_model"]


# ----------------------------------------------------------------------------------------------
# Grids and studies (each returns a tidy DataFrame; the CLI and benchmarks print them)
# ----------------------------------------------------------------------------------------------

TRACE_KEYS = ("workload", "num_requests", "rate", "arrival", "cv", "trace_seed", "num_prefixes", "prefix_tokens",
              "prefix_fraction", "trace")


def run_point(point: dict[str, Any]) -> dict[str, Any]:
    """One grid point: trace keys (``TRACE_KEYS``) + ``SimConfig`` fields -> params and summary."""
    from paged.sim.workload import load_trace, synthetic_trace

    sim_kw = {k: v for k, v in point.items() if k not in TRACE_KEYS and not k.startswith("_")}
    cfg = SimConfig(**sim_kw)
    max_len = cfg.max_model_len or get_model(cfg.model).max_model_len
    if point.get("trace"):
        tr = load_trace(point["trace"])
        limit = point.get("num_requests")  # the first N rows, as `simulate --trace -n N`; None: all
        if limit and int(limit) < len(tr):
            tr = tr.iloc[: int(limit)]
    else:
        tr = synthetic_trace(point.get("workload", "sharegpt"), int(point.get("num_requests", 1000)),
                             rate=float(point.get("rate", float("inf"))), arrival=point.get("arrival", "poisson"),
                             cv=float(point.get("cv", 2.0)), seed=int(point.get("trace_seed", cfg.seed)),
                             max_model_len=max_len, num_prefixes=int(point.get("num_prefixes", 0)),
                             prefix_tokens=int(point.get("prefix_tokens", 0)),
                             prefix_fraction=float(point.get("prefix_fraction", 1.0)))
    s = Simulator(cfg).run(tr).summary
    return {**{k: v for k, v in point.items() if not k.startswith("_")}, **s}


def run_grid(points: list[dict[str, Any]], jobs: int = 1, progress: bool = False) -> pd.DataFrame:
    """Run grid points (in ``jobs`` worker processes when > 1) into one row each, in order."""
    if jobs > 1 and len(points) > 1:
        from concurrent.futures import ProcessPoolExecutor
        import multiprocessing as mp

        # fork: works from notebooks and unguarded scripts; the workers only run pure Python
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        with ProcessPoolExecutor(max_workers=min(jobs, len(points)), mp_context=ctx) as ex:
            futures = [ex.submit(run_point, p) for p in points]
            it = futures
            if progress:
                from concurrent.futures import as_completed
                from tqdm.auto import tqdm
                for _ in tqdm(as_completed(futures), total=len(futures), unit="run", leave=False):
                    pass
            rows = [f.result() for f in it]
    else:
        it = points
        if progress:
            from tqdm.auto import tqdm
            it = tqdm(points, unit="run", leave=False)
        rows = [run_point(p) for p in it]
    return pd.DataFrame(rows)


# vLLM paper (Kwon et al., SOSP'23), Fig. 2: share of KV memory holding token states.
PAPER_TOKEN_SHARE = {"contiguous-max": 0.204, "contiguous-pow2": 0.268, "contiguous-oracle": 0.382, "paged": 0.963}


def memory_story(num_requests: int = 2000, block_size: int = 16, seed: int = 0, jobs: int = 1) -> pd.DataFrame:
    """vLLM paper's memory story: LLaMA-13B on one A100-40GB, ShareGPT-like, all requests at t=0.

    Same scheduler and memory for every allocator; ``kv_token_usage`` = slots holding tokens /
    slots reserved by requests (time-weighted over busy steps).
    """
    base = dict(model="llama-13b", gpu="a100-40gb", block_size=block_size, workload="sharegpt",
                num_requests=num_requests, rate=float("inf"), seed=seed, enable_prefix_caching=False)
    df = run_grid([{**base, "allocator": a} for a in ALLOCATORS], jobs=jobs)
    paged_tp = float(df.loc[df["allocator"] == "paged", "throughput_req_s"].iloc[0])
    out = pd.DataFrame({
        "allocator": df["allocator"],
        "token_usage": df["kv_token_usage_mean"],
        "paper_token_usage": df["allocator"].map(PAPER_TOKEN_SHARE),
        "tokens_per_pool": df["kv_tokens_per_capacity_mean"],
        "pool_reserved": df["kv_block_usage_mean"],
        "mean_batch": df["mean_batch_size"],
        "throughput_req_s": df["throughput_req_s"],
        "throughput_tok_s": df["throughput_tok_s"],
        "paged_speedup": paged_tp / df["throughput_req_s"],
        "preemptions": df["num_preemptions"],
    })
    out.attrs["config"] = {k: v for k, v in base.items()}
    return out


def interference_study(num_requests: int = 600, rate: float = 4.0, budgets: tuple[int, ...] = (2048, 512, 256),
                       model: str = "mistral-7b", gpu: str = "a100-80gb", workload: str = "azure-conv",
                       max_model_len: int = 4096, seed: int = 0, jobs: int = 1) -> pd.DataFrame:
    """Prefill/decode interference (Sarathi-Serve): p99 TBT and TTFT without and with chunked prefill.

    Without chunking the budget is ``max_model_len + max_num_seqs`` (256), so any prompt fits in one
    step next to a full decode batch: TTFT then measures interference, not head-of-line blocking
    of a long prompt behind the decodes.
    """
    base = dict(model=model, gpu=gpu, workload=workload, num_requests=num_requests, rate=rate,
                max_model_len=max_model_len, seed=seed)
    pts = [{**base, "enable_chunked_prefill": False, "max_num_batched_tokens": max_model_len + 256}]
    pts += [{**base, "enable_chunked_prefill": True, "max_num_batched_tokens": b} for b in budgets]
    df = run_grid(pts, jobs=jobs)
    ref = df.iloc[0]
    out = pd.DataFrame({
        "chunked_prefill": ["none"] + [str(b) for b in budgets],
        "tbt_p50_ms": df["tbt_p50_s"] * 1e3, "tbt_p99_ms": df["tbt_p99_s"] * 1e3, "tbt_max_ms": df["tbt_max_s"] * 1e3,
        "tbt_p99_vs_none": df["tbt_p99_s"] / ref["tbt_p99_s"],
        "ttft_p50_ms": df["ttft_p50_s"] * 1e3, "ttft_p99_ms": df["ttft_p99_s"] * 1e3,
        "ttft_p50_vs_none": df["ttft_p50_s"] / ref["ttft_p50_s"],
        "throughput_req_s": df["throughput_req_s"],
    })
    out.attrs["config"] = base
    return out


def block_size_ablation(workloads: tuple[str, ...] = ("sharegpt", "alpaca"),
                        block_sizes: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256), num_requests: int = 1000,
                        model: str = "llama-13b", gpu: str = "a100-40gb", seed: int = 0, jobs: int = 1) -> pd.DataFrame:
    """Token usage and saturation throughput per block size (vLLM paper, Fig. 18)."""
    pts = [dict(model=model, gpu=gpu, workload=w, block_size=b, num_requests=num_requests, rate=float("inf"),
                seed=seed, enable_prefix_caching=False) for w in workloads for b in block_sizes]
    df = run_grid(pts, jobs=jobs)
    return df[["workload", "block_size", "num_kv_blocks", "kv_token_usage_mean", "kv_block_usage_mean",
               "mean_batch_size", "throughput_req_s", "throughput_tok_s", "num_preemptions"]]


__all__ += ["run_point", "run_grid", "memory_story", "interference_study", "block_size_ablation",
            "PAPER_TOKEN_SHARE", "TRACE_KEYS"]
