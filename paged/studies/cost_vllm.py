"""End to end against a real vLLM CPU server: calibrate the simulator on one run's ``/metrics``,
predict another workload's TTFT and TBT, and compare with what a client measured.

The server is ``paged.connect.VLLMServer`` (the project's launcher). A trace is served in wall
time: one client thread per request sleeps until the request's arrival, then streams its
completion (``stream: true``; ``serve_trace`` timestamps every token chunk), so TTFT is measured
from the arrival and TBT is every gap between consecutive tokens, the definitions
``paged.studies.cost_e2e`` uses for our engine.

Calibration sees only what vLLM exports: the deltas of its TTFT and inter-token-latency histogram
sums and counts over the calibration run (their means). The simulator's cost model is our
engine's fitted ``CostModel`` (``paged.studies.cost_e2e.calibrate``) mapped to vLLM as
``t_vllm = alpha + beta x t_ours`` per step (``scaled``: ``alpha`` a per-step overhead of vLLM's
API-server / engine-core / worker pipeline, ``beta`` the speed of its CPU kernels relative to
ours); ``fit_to_metrics`` grid-searches ``(alpha, beta)`` so that the simulated calibration trace
has vLLM's mean TTFT and mean inter-token latency (two numbers, two unknowns).
"""
from __future__ import annotations

import json
import threading
import time
import urllib.request
from dataclasses import replace
from typing import Any

import numpy as np
import pandas as pd

from paged.studies.cost_e2e import simulate

__all__ = ["stream_times", "serve_trace", "metric_means", "scaled", "fit_to_metrics"]

_ITL = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")


def stream_times(base_url: str, model: str, prompt: list[int], max_tokens: int, timeout: float = 600.0) -> list[float]:
    """POST a streaming /v1/completions; ``time.perf_counter()`` of each token (a chunk with k
    token ids counts k times)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    req = urllib.request.Request(f"{base_url}/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    times: list[float] = []
    with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - our own local server
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            choice = json.loads(line[5:])["choices"][0]
            n = len(choice.get("token_ids") or []) or (1 if choice.get("text") else 0)
            times += [now] * n
    return times


def serve_trace(base_url: str, model: str, trace: pd.DataFrame, vocab: int, seed: int = 0
                ) -> tuple[pd.DataFrame, np.ndarray]:
    """Send ``trace``'s requests at their arrival times (random-token prompts); (per-request
    ``ttft_s``, every TBT gap), wall clock."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(17, vocab, int(n)).tolist() for n in trace["prompt_tokens"]]
    out: list[list[float] | BaseException] = [[] for _ in prompts]
    t0 = time.perf_counter() + 0.5

    def one(i: int, at: float, n_out: int) -> None:
        time.sleep(max(0.0, t0 + at - time.perf_counter()))
        try:
            out[i] = stream_times(base_url, model, prompts[i], n_out)
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the caller's thread
            out[i] = e

    threads = [threading.Thread(target=one, args=(i, float(a), int(n)), daemon=True)
               for i, (a, n) in enumerate(zip(trace["arrival_time"], trace["output_tokens"]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for o in out:
        if isinstance(o, BaseException):
            raise o
    ttft = [o[0] - (t0 + float(a)) for o, a in zip(out, trace["arrival_time"])]
    gaps = [np.diff(o) for o in out if len(o) > 1]
    return pd.DataFrame({"ttft_s": ttft}), np.concatenate(gaps) if gaps else np.zeros(0)


def metric_means(before: Any, after: Any) -> dict[str, float]:
    """Mean TTFT and inter-token latency over a run from two ``paged.connect.metrics`` samples."""
    def mean(name: str) -> float:
        s = after.samples.get(f"{name}_sum", np.nan) - before.samples.get(f"{name}_sum", 0.0)
        c = after.samples.get(f"{name}_count", np.nan) - before.samples.get(f"{name}_count", 0.0)
        return float(s / c) if c else float("nan")
    itl = next((n for n in _ITL if f"{n}_count" in after.samples), _ITL[0])
    return {"ttft_mean_s": mean("vllm:time_to_first_token_seconds"), "itl_mean_s": mean(itl)}


def scaled(cost: Any, alpha: float, beta: float) -> Any:
    """``cost`` with every step ``alpha + beta x`` its time (rates / beta, constants x beta)."""
    g = cost.gpu.with_(peak_flops=cost.gpu.peak_flops / beta, hbm_bandwidth=cost.gpu.hbm_bandwidth / beta,
                       pcie_bandwidth=cost.gpu.pcie_bandwidth / beta)
    return replace(cost, gpu=g, step_overhead_s=alpha + beta * cost.step_overhead_s,
                   per_seq_s=beta * cost.per_seq_s, per_token_s=beta * cost.per_token_s)


def fit_to_metrics(cost: Any, trace: pd.DataFrame, target: dict[str, float], cache: Any, scheduler: Any
                   ) -> tuple[Any, float, float]:
    """``(scaled cost, alpha, beta)`` whose simulated mean TTFT and mean TBT of ``trace`` are
    closest (sum of squared log ratios) to ``target`` (``metric_means``): a coarse grid, then a
    finer one around its best point."""
    def err(a: float, b: float) -> float:
        ttft, tbt = simulate(trace, scaled(cost, a, b), cache, scheduler)
        return float(np.log(ttft["ttft_s"].mean() / target["ttft_mean_s"]) ** 2
                     + np.log(tbt.mean() / target["itl_mean_s"]) ** 2)

    grid = [(a, b) for a in np.linspace(0.0, 0.2, 11) for b in np.geomspace(0.25, 8.0, 16)]
    a0, b0 = min(grid, key=lambda ab: err(*ab))
    fine = [(a, b) for a in np.clip(a0 + np.linspace(-0.02, 0.02, 9), 0.0, None)
            for b in b0 * np.geomspace(0.8, 1.25, 9)]
    a, b = min(fine + [(a0, b0)], key=lambda ab: err(*ab))
    return scaled(cost, float(a), float(b)), float(a), float(b)
