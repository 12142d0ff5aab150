"""Host-tier studies (issue 13): recompute evicted prefixes vs keep them in host memory, and
the seeds' eviction score vs LRU, on the simulator (a model/GPU preset at scale).

- ``shared_prefix_trace``: requests that share one of ``num_prefixes`` long prefixes with
  Zipf popularity, so a frequency-aware policy has something to find;
- ``tier_metrics`` (from ``paged.telemetry``): per-tier hit rates, blocks/bytes moved and swap
  frequency of a run's step frame (engine or simulator: the same columns);
- ``tier_study``: one row per variant (tier off = recompute, tier on with LRU, with the score
  policy, proactive demotion at a threshold) on the same trace;
- ``swap_claim``: the seeds' "cuts swaps by 40% on a 70B model", measured: swaps (blocks
  moved between the tiers) of the score policy over LRU's, on the same trace.

"Swaps" here are host-tier moves (tier-out + tier-in blocks) plus preemption swaps; bytes are
blocks x the simulator's per-GPU block bytes.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import pandas as pd

from paged.sim.simulator import SimConfig, Simulator
from paged.telemetry import tier_metrics
from paged.sim.workload import synthetic_trace

__all__ = ["DEFAULT_VARIANTS", "shared_prefix_trace", "swap_claim", "tier_metrics", "tier_study"]

SCORE = "score:decay=0.999,size_weight=-0.5"
"""The score policy measured by default (frequency x decay - 0.5 x depth; see ScorePolicy)."""

DEFAULT_VARIANTS: dict[str, dict[str, Any]] = {
    "recompute (no host tier)": dict(enable_host_tier=False),
    "host tier, LRU": dict(enable_host_tier=True, eviction="lru", host_eviction="lru"),
    "host tier, score": dict(enable_host_tier=True, eviction=SCORE, host_eviction=SCORE),
    "host tier, score (size_weight=+0.5)": dict(enable_host_tier=True, eviction="score:decay=0.999,size_weight=0.5",
                                                host_eviction="score:decay=0.999,size_weight=0.5"),
    "host tier, LRU, demote at 70%": dict(enable_host_tier=True, host_tier_threshold=0.7),
}


def shared_prefix_trace(num_requests: int = 1000, num_prefixes: int = 64, prefix_tokens: int = 1024,
                        zipf: float = 1.0, rate: float = 4.0, workload: str = "sharegpt", seed: int = 0,
                        max_model_len: int = 4096) -> pd.DataFrame:
    """``workload`` requests (Poisson at ``rate``/s) each prefixed by one of ``num_prefixes``
    shared prefixes of ``prefix_tokens`` tokens, prefix i drawn with probability ~ 1/(i+1)^zipf
    (0: uniform)."""
    tr = synthetic_trace(workload, num_requests, rate=rate, seed=seed, max_model_len=max_model_len - prefix_tokens)
    rng = np.random.default_rng(seed + 7)
    w = 1.0 / np.arange(1, num_prefixes + 1) ** zipf
    ids = rng.choice(num_prefixes, size=len(tr), p=w / w.sum())
    return tr.assign(prefix_id=ids.astype(np.int64), prefix_tokens=np.int64(prefix_tokens),
                     prompt_tokens=(tr["prompt_tokens"].to_numpy() + prefix_tokens).astype(np.int64))


def tier_study(model: str = "llama-2-70b", gpu: str = "a100-80gb", tensor_parallel: int = 4,
               num_blocks: int = 3000, swap_space_gib: float = 8.0, num_requests: int = 1000,
               num_prefixes: int = 64, prefix_tokens: int = 1024, zipf: float = 1.0, rate: float = 4.0,
               variants: dict[str, dict[str, Any]] | Sequence[str] | None = None, seed: int = 0,
               **sim_kw: Any) -> pd.DataFrame:
    """Simulate one ``shared_prefix_trace`` under each variant (name -> ``SimConfig`` overrides;
    names of ``DEFAULT_VARIANTS``; None: all of them); one row per variant with
    ``tier_metrics``, throughput and latency. ``num_blocks`` is kept small against the prefix
    working set (``num_prefixes x prefix_tokens``) so the GPU pool has to evict shared prefixes."""
    if variants is None:
        variants = DEFAULT_VARIANTS
    elif not isinstance(variants, dict):
        variants = {k: DEFAULT_VARIANTS[k] for k in variants}
    base = dict(model=model, gpu=gpu, tensor_parallel=tensor_parallel, num_blocks=num_blocks,
                swap_space_gib=swap_space_gib, seed=seed, **sim_kw)
    rows = []
    trace = None
    for name, over in variants.items():
        sim = Simulator(SimConfig(**{**base, **over}))
        if trace is None:
            trace = shared_prefix_trace(num_requests, num_prefixes, prefix_tokens, zipf, rate, seed=seed,
                                        max_model_len=min(sim.max_model_len, 4096))
        res = sim.run(trace)
        s = res.summary
        rows.append({"variant": name, "eviction": sim.config.eviction,
                     "host_eviction": sim.config.host_eviction if sim.config.enable_host_tier else "-",
                     "host_tier_threshold": sim.config.host_tier_threshold, "num_gpu_blocks": sim.num_blocks,
                     "num_cpu_blocks": sim.kv.num_cpu_blocks, "block_bytes": sim.block_bytes,
                     **tier_metrics(res.steps, sim.block_bytes),
                     "throughput_tok_s": s["throughput_tok_s"], "ttft_mean_s": s["ttft_mean_s"],
                     "ttft_p99_s": s["ttft_p99_s"], "tbt_p99_s": s["tbt_p99_s"], "duration_s": s["duration_s"],
                     "blocks_in_use_at_end": s.get("num_blocks_in_use_at_end", 0)})
    df = pd.DataFrame(rows)
    ref = df.iloc[0]
    df["prefill_saved_vs_first"] = df["prefill_tokens_saved"] - ref["prefill_tokens_saved"]
    df["throughput_vs_first"] = df["throughput_tok_s"] / ref["throughput_tok_s"]
    return df


def swap_claim(df: pd.DataFrame, policy: str = "host tier, score", baseline: str = "host tier, LRU") -> str:
    """One line on the seeds' "cuts swaps by 40% on a 70B model" from a ``tier_study`` frame."""
    a, b = df.set_index("variant").loc[policy], df.set_index("variant").loc[baseline]
    ratio = a["swaps"] / b["swaps"] if b["swaps"] else math.nan
    change = f"{(1 - ratio) * 100:.0f}% fewer" if ratio <= 1 else f"{(ratio - 1) * 100:.0f}% more"
    return (f"{policy} vs {baseline}: {int(a['swaps'])} vs {int(b['swaps'])} swapped blocks = "
            f"{ratio:.2f}x ({change}; the seed claims 40% fewer), hit rate "
            f"{a['prefix_hit_rate']:.3f} vs {b['prefix_hit_rate']:.3f}, throughput "
            f"{a['throughput_tok_s'] / b['throughput_tok_s']:.3f}x")
