"""The flat summary of a simulated run (what ``python -m paged simulate --json`` prints).

Usages are time-weighted means over steps with blocks in use; latencies are quantiles over
finished requests; ``tbt_*`` over every gap between a request's consecutive tokens.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import pandas as pd

if TYPE_CHECKING:
    from array import array


def summarize(sim: Any, reqs: pd.DataFrame, st: pd.DataFrame, tbt: "array[float]",
              rejected: Sequence[tuple[int, str]], wall: float) -> dict[str, Any]:
    """The flat summary of a run of ``sim`` (a ``Simulator``): ``reqs``/``st`` its request and
    step tables (see ``SimResult``), ``tbt`` every gap between consecutive tokens, ``rejected``
    (trace row, reason) pairs."""
    cfg, kv, tr = sim.config, sim.kv, reqs
    ok = reqs["finish_s"].notna()
    fin = reqs[ok]
    t0 = float(tr["arrival_time_s"].min()) if len(tr) else 0.0
    t1 = float(fin["finish_s"].max()) if len(fin) else t0
    span = max(t1 - t0, 1e-12)
    out_tok = int(fin["output_tokens"].sum())
    busy = st["kv_cache_usage_perc"].to_numpy() > 0
    w = st["step_time_s"].to_numpy()
    tbt_a = np.frombuffer(tbt, dtype=np.float64) if len(tbt) else np.empty(0)
    nan = float("nan")

    def q(x: Any, p: float) -> float:
        x = np.asarray(x, dtype=np.float64)
        x = x[~np.isnan(x)]
        return float(np.quantile(x, p)) if len(x) else float("nan")

    def wmean(x: np.ndarray) -> float:
        """Time-weighted mean of ``x`` over the steps with blocks in use."""
        return float(np.average(x[busy], weights=w[busy])) if busy.any() and w[busy].sum() > 0 else 0.0

    token_usage, block_usage = st["token_usage"].to_numpy(), st["kv_cache_usage_perc"].to_numpy()
    tok_use, blk_use = wmean(token_usage), wmean(block_usage)
    summary: dict[str, Any] = {
        "model": sim.model.name, "gpu": cfg.gpu, "tensor_parallel": cfg.tensor_parallel,
        "allocator": cfg.allocator, "block_size": cfg.block_size, "kv_cache_dtype": sim.kv_format.name,
        "num_kv_blocks": sim.num_blocks, "kv_capacity_tokens": sim.capacity_tokens,
        "requests": len(tr), "requests_finished": int(ok.sum()), "requests_rejected": len(rejected),
        "duration_s": span, "throughput_tok_s": out_tok / span,
        "total_throughput_tok_s": (int(fin["prompt_tokens"].sum()) + out_tok) / span,
        "throughput_req_s": int(ok.sum()) / span,
        "ttft_mean_s": float(np.nanmean(fin["ttft_s"])) if len(fin) else nan,
        "ttft_p50_s": q(fin["ttft_s"], 0.5), "ttft_p99_s": q(fin["ttft_s"], 0.99),
        # no gaps at all (every output is one token): NaN, not a warning
        "tbt_mean_s": float(tbt_a.mean()) if len(tbt_a) else nan, "tbt_p50_s": q(tbt_a, 0.5),
        "tbt_p99_s": q(tbt_a, 0.99), "tbt_max_s": float(tbt_a.max()) if len(tbt_a) else nan,
        "e2e_p50_s": q(fin["e2e_s"], 0.5), "e2e_p99_s": q(fin["e2e_s"], 0.99),
        "queueing_p50_s": q(fin["queueing_s"], 0.5), "queueing_p99_s": q(fin["queueing_s"], 0.99),
        "kv_token_usage_mean": tok_use, "kv_block_usage_mean": blk_use,
        "kv_internal_fragmentation_mean": 1.0 - tok_use if blk_use else 0.0,
        "kv_tokens_per_capacity_mean": wmean(token_usage * block_usage),  # slots holding tokens / all slots
        "mean_batch_size": float(np.average(st["num_seqs"], weights=w)) if len(st) else 0.0,
        "num_preemptions": int(sum(sim.scheduler.num_preemptions.values())),
        "num_preemptions_swap": int(sim.scheduler.num_preemptions.get("swap", 0)),
        "num_swapped_blocks": int(kv.num_swapped_out_blocks + kv.num_swapped_in_blocks),
        "prefix_cache_hit_rate": kv.prefix_cache_hits / kv.prefix_cache_queries if kv.prefix_cache_queries else 0.0,
        "prefix_cache_hit_tokens": int(kv.prefix_cache_hits), "prefix_cache_query_tokens": int(kv.prefix_cache_queries),
        # host tier (0 without one): share of prompt tokens served from it, blocks moved GPU <-> host
        "host_cache_hit_rate": (getattr(kv, "host_cache_hits", 0) / kv.prefix_cache_queries
                                if kv.prefix_cache_queries else 0.0),
        "num_tier_moved_blocks": (int(st["num_tier_out_blocks"].sum() + st["num_tier_in_blocks"].sum())
                                  if len(st) else 0),
        "num_blocks_in_use_at_end": int(kv.num_used_blocks),
        "num_steps": len(st), "wall_s": wall, "sim_requests_per_wall_s": int(ok.sum()) / max(wall, 1e-9),
    }
    if sim.calibration_report is not None:
        summary["calibration_holdout_mape"] = sim.calibration_report.holdout_mape
    if rejected:
        summary["first_rejection"] = rejected[0][1]
    return summary
