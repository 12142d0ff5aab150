"""Grids and paper studies on the simulator: each returns a tidy DataFrame (the CLI and
benchmarks print them).

- ``run_point``/``run_grid``: one simulated run per point (trace keys + ``SimConfig`` fields),
  in worker processes when ``jobs > 1``;
- ``memory_story`` (vLLM paper, Fig. 2), ``interference_study`` (Sarathi-Serve),
  ``block_size_ablation`` (vLLM paper, Fig. 18).
"""
from __future__ import annotations

from typing import Any

import pandas as pd

from paged.sim.simulator import ALLOCATORS, SimConfig, Simulator
from paged.sim.workload import load_trace, synthetic_trace

TRACE_KEYS = ("workload", "num_requests", "rate", "arrival", "cv", "trace_seed", "num_prefixes", "prefix_tokens",
              "prefix_fraction", "trace")


def trace_for(point: dict[str, Any], max_model_len: int) -> pd.DataFrame:
    """The trace of a point's trace keys (``TRACE_KEYS``): the first ``num_requests`` rows of
    ``trace`` (all when None), else ``num_requests`` (default 1000) synthetic requests of
    ``workload``, seeded by ``trace_seed`` (default ``seed``)."""
    if point.get("trace"):
        tr = load_trace(point["trace"])
        limit = point.get("num_requests")
        return tr.iloc[: int(limit)] if limit and int(limit) < len(tr) else tr
    return synthetic_trace(point.get("workload", "sharegpt"), int(point.get("num_requests") or 1000),
                           rate=float(point.get("rate", float("inf"))), arrival=point.get("arrival", "poisson"),
                           cv=float(point.get("cv", 2.0)), seed=int(point.get("trace_seed", point.get("seed", 0))),
                           max_model_len=max_model_len, num_prefixes=int(point.get("num_prefixes", 0)),
                           prefix_tokens=int(point.get("prefix_tokens", 0)),
                           prefix_fraction=float(point.get("prefix_fraction", 1.0)))


def run_point(point: dict[str, Any]) -> dict[str, Any]:
    """One grid point: trace keys (``TRACE_KEYS``) + ``SimConfig`` fields -> params and summary."""
    sim = Simulator(SimConfig(**{k: v for k, v in point.items() if k not in TRACE_KEYS and not k.startswith("_")}))
    s = sim.run(trace_for(point, sim.max_model_len)).summary
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


__all__ = ["trace_for", "run_point", "run_grid", "memory_story", "interference_study", "block_size_ablation",
           "PAPER_TOKEN_SHARE", "TRACE_KEYS"]
