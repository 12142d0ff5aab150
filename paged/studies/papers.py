"""The papers' experiments reproduced on the simulator, as DataFrames: ``memory_story`` (vLLM paper,
Fig. 2: share of KV memory holding tokens per allocator), ``interference_study`` (Sarathi-Serve:
prefill/decode interference with and without chunked prefill), ``block_size_ablation`` (vLLM paper,
Fig. 18: token usage and throughput per block size).
"""
from __future__ import annotations

import pandas as pd

from paged.sim.simulator import ALLOCATORS
from paged.sweeps import sweep

# vLLM paper (Kwon et al., SOSP'23), Fig. 2: share of KV memory holding token states.
PAPER_TOKEN_SHARE = {"contiguous-max": 0.204, "contiguous-pow2": 0.268, "contiguous-oracle": 0.382, "paged": 0.963}


def memory_story(num_requests: int = 2000, block_size: int = 16, seed: int = 0, jobs: int = 1) -> pd.DataFrame:
    """vLLM paper's memory story: LLaMA-13B on one A100-40GB, ShareGPT-like, all requests at t=0. Same scheduler
    and memory for every allocator; ``kv_token_usage`` = slots holding tokens / slots reserved by requests
    (time-weighted over busy steps)."""
    base = dict(model="llama-13b", gpu="a100-40gb", block_size=block_size, workload="sharegpt",
                num_requests=num_requests, rate=float("inf"), trace_seed=seed, prompt_seed=seed,
                enable_prefix_caching=False)
    df = sweep("simulate", [{**base, "allocator": a} for a in ALLOCATORS], jobs=jobs, store=False,
               progress=False, on_error="raise")
    paged_tp = float(df.loc[df["allocator"] == "paged", "throughput_req_s"].iloc[0])
    out = pd.DataFrame({
        "allocator": df["allocator"], "token_usage": df["kv_token_usage_mean"],
        "paper_token_usage": df["allocator"].map(PAPER_TOKEN_SHARE),
        "tokens_per_pool": df["kv_tokens_per_capacity_mean"], "pool_reserved": df["kv_block_usage_mean"],
        "mean_batch": df["mean_batch_size"], "throughput_req_s": df["throughput_req_s"],
        "throughput_tok_s": df["throughput_tok_s"], "paged_speedup": paged_tp / df["throughput_req_s"],
        "preemptions": df["num_preemptions"],
    })
    out.attrs["config"] = dict(base)
    return out


def interference_study(num_requests: int = 600, rate: float = 4.0, budgets: tuple[int, ...] = (2048, 512, 256),
                       model: str = "mistral-7b", gpu: str = "a100-80gb", workload: str = "azure-conv",
                       max_model_len: int = 4096, seed: int = 0, jobs: int = 1) -> pd.DataFrame:
    """Prefill/decode interference (Sarathi-Serve): p99 TBT and TTFT without and with chunked prefill. Without
    chunking the budget is ``max_model_len + max_num_seqs`` (256), so any prompt fits in one step next to a full
    decode batch: TTFT then measures interference, not head-of-line blocking of a long prompt behind the
    decodes."""
    base = dict(model=model, gpu=gpu, workload=workload, num_requests=num_requests, rate=rate,
                max_model_len=max_model_len, trace_seed=seed, prompt_seed=seed)
    pts = [{**base, "enable_chunked_prefill": False, "max_num_batched_tokens": max_model_len + 256}]
    pts += [{**base, "enable_chunked_prefill": True, "max_num_batched_tokens": b} for b in budgets]
    df = sweep("simulate", pts, jobs=jobs, store=False, progress=False, on_error="raise")
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
                trace_seed=seed, prompt_seed=seed, enable_prefix_caching=False) for w in workloads for b in block_sizes]
    df = sweep("simulate", pts, jobs=jobs, store=False, progress=False, on_error="raise")
    return df[["workload", "block_size", "num_kv_blocks", "kv_token_usage_mean", "kv_block_usage_mean",
               "mean_batch_size", "throughput_req_s", "throughput_tok_s", "num_preemptions"]]


__all__ = ["PAPER_TOKEN_SHARE", "block_size_ablation", "interference_study", "memory_story"]
