"""Fragmentation: how much reserved KV memory holds tokens, contiguous allocators vs paging, on the
simulator (every allocator on one shared trace) and the real engine (small scale); records here,
figures in ``paged.viz.fragmentation``.

Invariants: every allocator of ``run_allocators`` sees the same trace, scheduler settings and pool
(``num_blocks x block_size`` token slots; contiguous allocators count the same slots); "token share"
= slots holding tokens / slots reserved (``token_usage``), time-weighted over steps with memory in
use: the vLLM paper's "share of KV memory holding token states"; paging's internal fragmentation =
1 - token share, only in each request's last block.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import pandas as pd

from paged.errors import ConfigError
from paged.sim.simulator import ALLOCATORS
from paged.studies.papers import PAPER_TOKEN_SHARE

LABELS = {"contiguous-max": "contiguous, max_len each", "contiguous-pow2": "contiguous, prompt + pow2(output)",
          "contiguous-oracle": "contiguous, exact length (oracle)", "paged": "paged (blocks of 16)"}


def label(allocator: str, block_size: int = 16) -> str:
    """How tables and figures name an allocator (paged with its block size)."""
    return f"paged (blocks of {block_size})" if allocator == "paged" else LABELS.get(allocator, allocator)


def shared_trace(workload: str = "sharegpt", num_requests: int = 300, max_model_len: int = 2048, seed: int = 0,
                 rate: float = float("inf")) -> pd.DataFrame:
    """One seeded trace (all requests at t=0 by default, as in the vLLM paper's memory experiment)."""
    from paged.sim.workload import synthetic_trace

    return synthetic_trace(workload, num_requests, rate=rate, trace_seed=seed, max_model_len=max_model_len)


def run_allocators(trace: pd.DataFrame, allocators: Sequence[str] = ALLOCATORS, *, model: str = "llama-13b",
                   gpu: str = "a100-40gb", block_size: int = 16, **config) -> dict:
    """Simulate ``trace`` once per allocator (same scheduler, same memory); ``{allocator: SimResult}``. Defaults
    are the vLLM paper's setting: LLaMA-13B on one A100-40GB, prefix caching off. ``config``: other
    ``SimConfig`` fields (``num_blocks``, ``max_num_seqs``, ...)."""
    from paged.sim.simulator import SimConfig, Simulator

    bad = [a for a in allocators if a not in ALLOCATORS]
    if bad:
        raise ConfigError(f"unknown allocators {bad}; choose from {ALLOCATORS}")
    config.setdefault("enable_prefix_caching", False)
    return {a: Simulator(SimConfig(model=model, gpu=gpu, block_size=block_size, allocator=a, **config)).run(trace)
            for a in allocators}


def pool_share_under_load(steps: pd.DataFrame) -> float:
    """Slots holding tokens / all slots of the pool, time-weighted over steps with requests waiting. While
    requests wait, memory is what limits the batch: the regime of the vLLM paper's Fig. 2, whose bars are shares
    of the whole KV memory (tokens, reservations, internal and external fragmentation add up to 100%). NaN when
    no step had a queue."""
    m = np.asarray(steps["num_waiting"]) > 0
    w = np.asarray(steps["step_time_s"], float)[m]
    if not m.any() or w.sum() <= 0:
        return float("nan")
    held = np.asarray(steps["kv_cache_usage_perc"], float)[m] * np.asarray(steps["token_usage"], float)[m]
    return float(np.average(held, weights=w))


def token_share_table(results: Mapping[str, object]) -> pd.DataFrame:
    """One row per allocator: tokens as a share of the pool under load beside the paper's figure, tokens as
    a share of what requests reserved, batch size, throughput and the speed-up of paging."""
    rows = []
    for a, r in results.items():
        s = r.summary
        rows.append({"allocator": label(a, s["block_size"]), "token_share_of_pool": pool_share_under_load(r.steps),
                     "paper_token_share": PAPER_TOKEN_SHARE.get(a, np.nan),
                     "token_share_of_reserved": s["kv_token_usage_mean"],
                     "mean_batch": s["mean_batch_size"], "throughput_req_s": s["throughput_req_s"],
                     "preemptions": s["num_preemptions"], "_key": a})
    df = pd.DataFrame(rows)
    df.insert(3, "difference_pts", 100 * (df["token_share_of_pool"] - df["paper_token_share"]))
    if "paged" in results:
        paged = float(df.loc[df["_key"] == "paged", "throughput_req_s"].iloc[0])
        df["paged_speedup"] = paged / df["throughput_req_s"]
    return df.drop(columns="_key")


def block_size_sweep(block_sizes: Sequence[int] = (1, 8, 16, 32, 64, 128, 256), *, trace: pd.DataFrame,
                     model: str = "llama-13b", gpu: str = "a100-40gb", **config) -> pd.DataFrame:
    """Paged runs of ``trace`` per block size: token share, internal fragmentation, batch, throughput."""
    rows = []
    for b in block_sizes:
        s = run_allocators(trace, ("paged",), model=model, gpu=gpu, block_size=int(b), **config)["paged"].summary
        rows.append({"block_size": int(b), "token_share": s["kv_token_usage_mean"],
                     "internal_fragmentation": s["kv_internal_fragmentation_mean"],
                     "mean_batch": s["mean_batch_size"], "throughput_req_s": s["throughput_req_s"],
                     "num_kv_blocks": s["num_kv_blocks"]})
    return pd.DataFrame(rows)


def engine_workload(num_requests: int = 8, prompt_tokens: tuple[int, int] = (20, 120),
                    output_tokens: tuple[int, int] = (8, 48), seed: int = 0, vocab: tuple[int, int] = (17, 49152)):
    """Seeded requests of token-id prompts with varied lengths for ``paged.runs.Run``. Outputs ignore EOS
    so every request produces exactly its drawn length (fixed memory footprint)."""
    from paged.engine import SamplingParams

    rng = np.random.default_rng(seed)
    out = []
    for i in range(num_requests):
        n = int(rng.integers(prompt_tokens[0], prompt_tokens[1] + 1))
        m = int(rng.integers(output_tokens[0], output_tokens[1] + 1))
        out.append({"request_id": f"r{i}", "prompt": rng.integers(*vocab, n).tolist(),
                    "params": SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0)})
    return out


def engine_block_sizes(loaded_model, workload, block_sizes: Sequence[int] = (4, 16, 64), pool_tokens: int = 4096,
                       max_model_len: int = 1024) -> pd.DataFrame:
    """Run ``workload`` on the real engine once per block size, same pool of ``pool_tokens`` slots. Returns
    every step row (STEP_COLUMNS) plus ``block_size``, ``held`` (slots holding tokens), ``reserved`` (slots of
    blocks in use) and ``contiguous_reserved`` (the counterfactual: each running request reserving
    ``max_model_len`` slots, as a contiguous allocator would)."""
    import paged
    from paged import runs

    frames = []
    for b in block_sizes:
        llm = paged.LLM(loaded_model, block_size=int(b), num_blocks=pool_tokens // int(b), max_model_len=max_model_len,
                        enable_prefix_caching=False, record_events=False)
        st = runs.Run(llm, workload).run_to_completion().steps_frame()
        st["block_size"] = int(b)
        st["reserved"] = st["num_used_blocks"] * int(b)
        st["held"] = st["reserved"] * st["token_usage"]
        st["contiguous_reserved"] = st["num_running"] * max_model_len
        frames.append(st)
    return pd.concat(frames, ignore_index=True)


def engine_share_table(steps: pd.DataFrame) -> pd.DataFrame:
    """Per block size: token share of paged blocks and of the contiguous counterfactual (step-averaged)."""
    g = steps[steps["reserved"] > 0].groupby("block_size")
    return pd.DataFrame({
        "token_share_paged": g["held"].sum() / g["reserved"].sum(),
        "token_share_contiguous_max": g["held"].sum() / g["contiguous_reserved"].sum(),
        "peak_blocks": g["num_used_blocks"].max(), "steps": g.size(),
    }).reset_index()


__all__ = ["ALLOCATORS", "LABELS", "PAPER_TOKEN_SHARE", "block_size_sweep", "engine_block_sizes", "engine_share_table",
           "engine_workload", "label", "pool_share_under_load", "run_allocators", "shared_trace", "token_share_table"]
