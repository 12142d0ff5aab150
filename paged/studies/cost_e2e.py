"""End to end: calibrate the cost model on our engine's steps of one workload, then predict the
TTFT and TBT of a different workload with the simulator, and compare with the engine's own.

    from paged.studies.cost_e2e import e2e_table
    table = e2e_table()      # rows: workload (calibration / held out), metric, measured, predicted, error

Both workloads are traces (``paged.sim.workload`` columns: ``arrival_time``, ``prompt_tokens``,
``output_tokens``) of random-token prompts (no prefix hits), greedy, ``ignore_eos``. The engine
serves a trace in *trace time*: before each step the requests that arrived by then are added,
and when it is idle the clock jumps to the next arrival (``run_engine``), exactly as the simulator
does; a step lasts its CPU time by default (the project's way of timing on a shared VM); TTFT is measured from a request's trace arrival (which may fall inside a step), TBT is every
gap between a request's consecutive token steps (``paged.runs.Run.tbt_samples``'s definition).
The simulator runs the same ``CacheConfig`` and ``SchedulerConfig`` through the same scheduler and
KV manager, with the ``CostModel`` fitted (``CostModel.fit``) to the calibration run's step times.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

__all__ = ["Workload", "CALIBRATION", "HELD_OUT", "make_trace", "run_engine", "calibrate", "simulate",
           "latency_stats", "e2e_table"]


@dataclass(frozen=True)
class Workload:
    """A seeded trace: ``num_requests`` Poisson arrivals at ``rate`` per second, uniform lengths."""

    name: str
    num_requests: int
    rate: float
    prompt_tokens: tuple[int, int]
    output_tokens: tuple[int, int]
    seed: int


# Calibration: short prompts, long outputs, light load. Held out: longer prompts, shorter outputs,
# burstier (twice the rate) -- a different mix of prefill and decode steps.
CALIBRATION = Workload("calibration", 32, 6.0, (16, 160), (24, 64), 1)
HELD_OUT = Workload("held out", 32, 12.0, (96, 384), (8, 32), 2)


def make_trace(w: Workload) -> pd.DataFrame:
    rng = np.random.default_rng(w.seed)
    gaps = rng.exponential(1.0 / w.rate, w.num_requests)
    gaps[0] = 0.0
    return pd.DataFrame({"arrival_time": np.cumsum(gaps),
                         "prompt_tokens": rng.integers(w.prompt_tokens[0], w.prompt_tokens[1] + 1, w.num_requests),
                         "output_tokens": rng.integers(w.output_tokens[0], w.output_tokens[1] + 1, w.num_requests)})


def run_engine(engine: Any, trace: pd.DataFrame, seed: int = 0, clock: str = "cpu"
               ) -> tuple[list, np.ndarray, pd.DataFrame, np.ndarray]:
    """Serve ``trace`` on ``engine`` (a fresh ``LLMEngine``) in trace time; returns (step outputs,
    each step's seconds, per-request ``ttft_s``, every TBT gap).

    ``clock="cpu"``: a step lasts the CPU time of this thread during ``engine.step()`` (with
    ``OMP_NUM_THREADS=1`` the forward runs on it), so other processes on a shared machine do not
    lengthen it; ``"wall"``: ``time.perf_counter``."""
    import time

    from paged.engine import SamplingParams

    tick = {"cpu": time.thread_time, "wall": time.perf_counter}[clock]
    rng = np.random.default_rng(seed)
    vocab = engine.loaded.config.vocab_size
    pending = list(trace.itertuples(index=False))
    now = 0.0  # trace time
    arrival: dict[str, float] = {}
    token_ends: dict[str, list[float]] = {}
    steps, secs = [], []
    while pending or engine.has_unfinished_requests():
        if pending and not engine.has_unfinished_requests():
            now = max(now, pending[0].arrival_time)  # idle: jump to the next arrival
        while pending and pending[0].arrival_time <= now:
            r = pending.pop(0)
            rid = f"r{len(arrival)}"
            ids = rng.integers(17, vocab, int(r.prompt_tokens)).tolist()
            engine.add_request(rid, ids, SamplingParams(temperature=0.0, max_tokens=int(r.output_tokens),
                                                        ignore_eos=True))
            arrival[rid], token_ends[rid] = float(r.arrival_time), []
        t0 = tick()
        out = engine.step()
        dt = tick() - t0
        now += dt
        steps.append(out)
        secs.append(dt)
        for sid in out.new_tokens:
            token_ends[sid.split("#")[0]].append(now)
    ttft = pd.DataFrame({"request_id": list(arrival),
                         "ttft_s": [token_ends[r][0] - arrival[r] for r in arrival]})
    gaps = [np.diff(t) for t in token_ends.values() if len(t) > 1]
    return steps, np.asarray(secs), ttft, np.concatenate(gaps) if gaps else np.zeros(0)


def calibrate(steps: list, seconds: np.ndarray, model: str = "smollm2-135m", gpu: str = "cpu", seed: int = 0):
    """``CostModel.fit`` on the steps' shapes and their measured ``seconds`` (the FitReport)."""
    from paged.sim.cost_model import CostModel
    from paged.sim.shapes import step_shape

    kept = [(st, t) for st, t in zip(steps, seconds) if st.scheduled]
    shapes = [step_shape(st.scheduled, st.num_swapped_out_blocks + st.num_swapped_in_blocks, st.num_block_copies)
              for st, _ in kept]
    return CostModel(model, gpu).fit(shapes, [t for _, t in kept], seed=seed)


def simulate(trace: pd.DataFrame, cost_model: Any, cache: Any, scheduler: Any,
             model: str = "smollm2-135m", gpu: str = "cpu") -> tuple[pd.DataFrame, np.ndarray]:
    """The simulator on ``trace`` with ``cost_model``: (per-request ``ttft_s``, every TBT gap)."""
    from paged.sim.simulator import SimConfig, Simulator

    from paged.core.config import flat_knobs
    sim = Simulator(SimConfig(model=model, gpu=gpu, **flat_knobs(cache, scheduler), paged_kernel_penalty=False),
                    cost_model=cost_model)
    res = sim.run(trace)
    return res.requests[["ttft_s"]], sim.tbt_samples()


def latency_stats(ttft: pd.DataFrame, tbt: np.ndarray) -> dict[str, float]:
    t = ttft["ttft_s"].to_numpy(dtype=np.float64)
    return {"ttft_p50_s": float(np.quantile(t, 0.5)), "ttft_p99_s": float(np.quantile(t, 0.99)),
            "tbt_p50_s": float(np.quantile(tbt, 0.5)), "tbt_p99_s": float(np.quantile(tbt, 0.99))}


def e2e_table(calibration: Workload = CALIBRATION, held_out: Workload = HELD_OUT, num_blocks: int = 256,
              block_size: int = 16, max_num_seqs: int = 16, max_num_batched_tokens: int = 512,
              llm: Any = None, clock: str = "cpu") -> tuple[pd.DataFrame, Any]:
    """Measured vs predicted TTFT/TBT p50/p99 on both workloads; the FitReport of the calibration."""
    from paged.core.config import CacheConfig, SchedulerConfig, flat_knobs
    import paged

    cache = CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=False)
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    llm = llm or paged.LLM(**flat_knobs(cache, sched))
    rows, report = [], None
    for w in (calibration, held_out):
        from paged.engine import LLMEngine

        engine = LLMEngine(llm.engine.loaded, llm.engine.config)
        trace = make_trace(w)
        steps, secs, ttft, tbt = run_engine(engine, trace, seed=w.seed, clock=clock)
        if report is None:
            report = calibrate(steps, secs)
        measured = latency_stats(ttft, tbt)
        predicted = latency_stats(*simulate(trace, report.model, cache, sched))
        for k in measured:
            rows.append({"workload": w.name, "metric": k, "measured": measured[k], "predicted": predicted[k],
                         "error": predicted[k] / measured[k] - 1.0, "steps": len(steps)})
    return pd.DataFrame(rows), report
