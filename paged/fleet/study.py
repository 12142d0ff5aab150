"""Fleet studies: plain parameters in, the fleet's summary out (registered for ``paged.sweep``).

    routing_study(policy="kv_aware", num_replicas=8)        # one fleet run -> one summary row (dict)
    compare_policies(num_replicas=8)                          # one row per policy, same requests
    hot_prefix_study(hot_share=0.7)                           # affinity vs the load term on a hot prefix
    mooncake_policies(1000, num_replicas=8)                   # each policy on Mooncake's conversation trace
    pooled_host_tiers(500, num_replicas=8)                    # host tiers each its own, then pooled

Every run builds its replicas from one ``SimConfig`` (``model``, ``gpu``, ``tensor_parallel``,
``block_size``, ``num_blocks``: None = what the GPUs hold) and routes ``shared_prefix_trace``.
"""
from __future__ import annotations

from typing import Any, Sequence

import pandas as pd

from paged.sim.config import SimConfig

from .sim import SimFleet
from .workloads import shared_prefix_trace

POLICIES = ("round_robin", "least_outstanding", "least_kv_usage", "session_affinity", "kv_aware", "cache_aware")
TRACE_KEYS = ("num_requests", "rate", "num_prefixes", "prompt_tokens", "prefix_tokens", "output_tokens", "hot_share")


def _split(kw: dict[str, Any]) -> tuple[dict, dict]:
    trace = {k: kw.pop(k) for k in TRACE_KEYS if k in kw}
    return trace, kw


def routing_study(policy: str = "kv_aware", num_replicas: int = 8, model: str = "llama-2-13b",
                  gpu: str = "a100-80gb", tensor_parallel: int = 1, block_size: int = 16,
                  num_blocks: int | None = None, seed: int = 0, precise: bool = True,
                  **options: Any) -> dict[str, Any]:
    """One fleet run: ``options`` are ``shared_prefix_trace`` keys (``TRACE_KEYS``) and the
    router's own (``overlap_weight``, ``view``, ``temperature``, ``cache_threshold``, ...)."""
    trace_kw, router_kw = _split(dict(options))
    cfg = SimConfig(model=model, gpu=gpu, tensor_parallel=tensor_parallel, block_size=block_size,
                    num_blocks=num_blocks, prompt_seed=seed)
    fleet = SimFleet(cfg, policy, num_replicas=num_replicas, precise=precise, seed=seed, **router_kw)
    res = fleet.run(shared_prefix_trace(seed=seed, **trace_kw))
    return {**res.summary, **{f"router_{k}": v for k, v in router_kw.items()}}


def compare_policies(policies: Sequence[str] = POLICIES, **kw: Any) -> pd.DataFrame:
    """``routing_study`` per policy on the same requests; ``hit_rate_vs_rr`` and
    ``ttft_p99_vs_rr``: ratios to round robin's (when it is among the policies)."""
    df = pd.DataFrame([routing_study(p, **kw) for p in policies])
    if "round_robin" in set(df["policy"]):
        rr = df[df["policy"] == "round_robin"].iloc[0]
        df["hit_rate_vs_rr"] = df["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else float("nan")
        df["ttft_p99_vs_rr"] = df["ttft_p99_s"] / rr["ttft_p99_s"]
    return df


def hot_prefix_study(hot_share: float = 0.7, overlap_weights: Sequence[float] = (1000.0, 10.0, 1.0),
                     num_replicas: int = 8, **kw: Any) -> pd.DataFrame:
    """A hot prefix: KV-aware routing at each ``overlap_weight`` (large: pure cache affinity; 1:
    Dynamo's default, decode load counts as much as a cached block), SGLang-style cache_aware
    (with its load-balance thresholds) and round robin. One row each."""
    base = dict(num_requests=400, rate=60.0, num_prefixes=8, output_tokens=128, hot_share=hot_share)
    base.update(kw)
    rows = [routing_study("kv_aware", num_replicas, overlap_weight=w, **base) for w in overlap_weights]
    rows += [routing_study(p, num_replicas, **base) for p in ("cache_aware", "round_robin")]
    return pd.DataFrame(rows)


def mooncake_policies(num_requests: int | None = 1000, num_replicas: int = 8,
                      policies: Sequence[str] = ("round_robin", "least_outstanding", "kv_aware", "cache_aware"),
                      model: str = "llama-3.1-70b", gpu: str = "a100-80gb", tensor_parallel: int = 8,
                      trace: str = "conversation") -> pd.DataFrame:
    """Each policy on the first ``num_requests`` of a Mooncake trace (its own 512-token content
    blocks as shared tokens; None: all), one row per policy with ratios to round robin's."""
    from paged.sim.trace_files import mooncake_trace
    tr = mooncake_trace(trace, num_requests)
    cfg = SimConfig(model=model, gpu=gpu, tensor_parallel=tensor_parallel, block_size=16)
    df = pd.DataFrame([SimFleet(cfg, p, num_replicas=num_replicas).run(tr).summary for p in policies])
    if "round_robin" in set(df["policy"]):
        rr = df[df["policy"] == "round_robin"].iloc[0]
        df["hit_rate_vs_rr"] = df["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else float("nan")
        df["ttft_p99_vs_rr"] = df["ttft_p99_s"] / rr["ttft_p99_s"]
    return df


def pooled_host_tiers(num_requests: int | None = 500, num_replicas: int = 8,
                      policies: Sequence[str] = ("round_robin", "cache_aware"), model: str = "llama-3.1-70b",
                      gpu: str = "a100-80gb", tensor_parallel: int = 8, num_blocks: int | None = 16384,
                      swap_space_gib: float = 512.0, trace: str = "conversation",
                      network: Any = None) -> pd.DataFrame:
    """Each policy on the first ``num_requests`` of a Mooncake trace with every replica's host
    tier its own, then pooled over ``network`` (default ``Network()``; ``paged.fleet.host_pool``): one
    row per (policy, pooled). ``num_blocks`` GPU blocks per replica (262k tokens, a small share of what
    the GPUs hold, so prefixes reach the host tiers within 500 requests; None: all of it) and
    ``swap_space_gib`` of host memory for its tier."""
    from paged.sim.trace_files import mooncake_trace

    from .pool import Network
    tr = mooncake_trace(trace, num_requests)
    cfg = SimConfig(model=model, gpu=gpu, tensor_parallel=tensor_parallel, block_size=16, num_blocks=num_blocks,
                    enable_host_tier=True, swap_space_gib=swap_space_gib)
    rows = [{**SimFleet(cfg, p, num_replicas=num_replicas, pooled=net).run(tr).summary, "pooled": net is not None}
            for p in policies for net in (None, Network() if network is None else network)]
    return pd.DataFrame(rows)
