"""Host-tier studies (issue 13): recompute evicted prefixes vs keep them in host memory, and the
seeds' eviction score vs LRU, on the simulator (a preset at scale) and the real engine (small scale):
``shared_prefix_trace`` (Zipf-popular shared prefixes, so a frequency-aware policy has something to
find), ``tier_metrics``, ``tier_study`` (one row per variant on one trace), ``swap_claim`` (the
seeds' "cuts swaps by 40% on a 70B model", measured) and ``engine_tier_study`` (same requests and
checked greedy outputs per variant, side by side).

"Swaps" are host-tier moves (tier-out + tier-in blocks) plus preemption swaps; bytes are blocks x
the per-GPU block bytes.
"""
from __future__ import annotations

import math
import random
import time
from typing import Any, Sequence

import pandas as pd

from paged import telemetry
from paged.sim.simulator import SimConfig, Simulator
from paged.sim.workload import synthetic_trace, tenant_weights
from paged.studies.engine_setup import study_model

__all__ = ["DEFAULT_VARIANTS", "ENGINE_VARIANTS", "engine_tier_study", "swap_claim",
           "tier_metrics", "tier_study"]

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


def tier_metrics(steps: pd.DataFrame, block_bytes: float = 0.0) -> dict[str, float]:
    """Per-tier hit rates (tokens over prefix-cache queries), prefill tokens saved, blocks and
    bytes moved (``block_bytes`` per block), and swap frequency from a steps frame (``STEP_COLUMNS``,
    engine or simulator). "swaps" = host-tier moves (tier-out + tier-in) + preemption swap blocks;
    ``swap_steps_share`` = share of steps that moved any block over the link."""
    if not len(steps):
        return {}
    last = steps.iloc[-1]
    q, hits, host = float(last["prefix_cache_queries"]), int(last["prefix_cache_hits"]), int(last["host_cache_hits"])
    out, tin = int(steps["num_tier_out_blocks"].sum()), int(steps["num_tier_in_blocks"].sum())
    swap = int(steps["num_swapped_out_blocks"].sum() + steps["num_swapped_in_blocks"].sum())
    moving = (steps["num_tier_out_blocks"] + steps["num_tier_in_blocks"] + steps["num_swapped_out_blocks"]
              + steps["num_swapped_in_blocks"]) > 0
    return {"prefix_hit_rate": hits / q if q else 0.0, "gpu_hit_rate": (hits - host) / q if q else 0.0,
            "host_hit_rate": host / q if q else 0.0, "prefill_tokens_saved": hits,
            "tier_out_blocks": out, "tier_in_blocks": tin,
            "host_evicted_blocks": int(steps["num_host_evicted_blocks"].sum()),
            "preemption_swap_blocks": swap, "swaps": out + tin + swap,
            "bytes_moved": (out + tin + swap) * block_bytes, "gib_moved": (out + tin + swap) * block_bytes / 2**30,
            "swap_steps_share": float(moving.mean()), "steps": len(steps)}


def tier_study(model: str = "llama-2-70b", gpu: str = "a100-80gb", tensor_parallel: int = 4,
               num_blocks: int = 3000, swap_space_gib: float = 8.0, num_requests: int = 1000,
               num_prefixes: int = 64, prefix_tokens: int = 1024, prefix_zipf: float = 1.0, rate: float = 4.0,
               variants: dict[str, dict[str, Any]] | Sequence[str] | None = None, seed: int = 0,
               **sim_kw: Any) -> pd.DataFrame:
    """Simulate one trace per variant (name -> ``SimConfig`` overrides, names of ``DEFAULT_VARIANTS`` or
    None: all): ``num_requests`` ShareGPT-like requests, each with one of ``num_prefixes`` shared prefixes
    of ``prefix_tokens`` (popularity ``prefix_zipf``); ``tier_metrics``, throughput and latency. ``num_blocks``
    is small against the prefixes' working set (``num_prefixes x prefix_tokens``), so shared prefixes are evicted."""
    if variants is None:
        variants = DEFAULT_VARIANTS
    elif not isinstance(variants, dict):
        variants = {k: DEFAULT_VARIANTS[k] for k in variants}
    base = dict(model=model, gpu=gpu, tensor_parallel=tensor_parallel, num_blocks=num_blocks,
                swap_space_gib=swap_space_gib, prompt_seed=seed, **sim_kw)
    rows, trace = [], None
    for name, over in variants.items():
        sim = Simulator(SimConfig(**{**base, **over}))
        if trace is None:
            trace = synthetic_trace("sharegpt", num_requests, rate=rate, trace_seed=seed,
                                    max_model_len=min(sim.max_model_len, 4096), num_prefixes=num_prefixes,
                                    prefix_tokens=prefix_tokens, prefix_zipf=prefix_zipf)
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


# ---- The real engine, small scale ----------------------------------------------------------------------------------

ENGINE_VARIANTS: dict[str, dict[str, Any]] = {
    "recompute (no host tier)": dict(enable_host_tier=False),
    "host tier, LRU": dict(enable_host_tier=True),
    "host tier, score": dict(enable_host_tier=True, eviction=SCORE, host_eviction=SCORE),
}


def _workload(num_requests: int, num_prefixes: int, prefix_len: int, vocab: int, prefix_zipf: float,
              seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    weights = tenant_weights(num_prefixes, prefix_zipf).tolist()
    return [rng.choices(prefixes, weights)[0] + [rng.randrange(vocab) for _ in range(rng.randrange(1, 24))]
            for _ in range(num_requests)]


def engine_tier_study(model: str | None = None, *, num_requests: int = 48, num_prefixes: int = 8,
                      prefix_blocks: int = 6, block_size: int = 16, num_blocks: int = 48, num_cpu_blocks: int = 96,
                      max_num_seqs: int = 4, max_tokens: int = 8, prefix_zipf: float = 1.0,
                      variants: dict[str, dict[str, Any]] | None = None, seed: int = 0,
                      device: str = "cpu") -> pd.DataFrame:
    """One row per variant (name -> ``EngineConfig`` overrides; default ``ENGINE_VARIANTS``).
    The GPU pool (``num_blocks``) is smaller than the prefixes' working set
    (``num_prefixes x prefix_blocks``), so shared prefixes are evicted between their uses."""
    from paged.engine import LLM, SamplingParams

    loaded = study_model(model, device=device, prefix="paged-tier-")
    prompts = _workload(num_requests, num_prefixes, prefix_blocks * block_size,
                        min(loaded.config.vocab_size, 32000), prefix_zipf, seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rows, first = [], None
    for name, over in (variants or ENGINE_VARIANTS).items():
        eng = LLM(loaded, block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs, sampling_seed=seed,
                  num_cpu_blocks=num_cpu_blocks if over.get("enable_host_tier") else 0, **over).engine
        steps, outs = [], {}
        t0 = time.perf_counter()
        for w in range(0, len(prompts), max_num_seqs):
            for i in range(w, min(w + max_num_seqs, len(prompts))):
                eng.add_request(str(i), prompts[i], params)
            while eng.has_unfinished_requests():
                s = eng.step()
                steps.append(s.to_row())
                for o in s.finished:
                    outs[o.request_id] = tuple(o.outputs[0].token_ids)
        wall = time.perf_counter() - t0
        st = telemetry.steps_frame(steps)
        first = outs if first is None else first
        gen = sum(len(v) for v in outs.values())
        rows.append({"variant": name, "num_gpu_blocks": num_blocks, "num_cpu_blocks": eng.kv_manager.num_cpu_blocks,
                     **tier_metrics(st, eng.runner.swap.device_block_bytes()),
                     "prefill_tokens_computed": int(st["num_prefill_tokens"].sum()),
                     "wall_s": wall, "throughput_tok_s": gen / wall, "outputs_match_first": outs == first,
                     "blocks_in_use_at_end": eng.kv_manager.num_used_blocks})
    return pd.DataFrame(rows)
