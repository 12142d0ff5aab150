"""Prefill/decode apart: the KV transfer a disaggregated request pays, and SLO attainment / goodput.

    kv_transfer_bytes("llama-2-13b", 2048)                 # KV bytes of a 2,048-token prompt (all layers)
    transfer_seconds(nbytes, 50e9, layers=40, prefill_s=0.3, layerwise=True)
    slo_metrics(requests, ttft_slo_s=2.0, tpot_slo_s=0.1)  # attainment of each SLO, of both, goodput

Goodput as DistServe and Splitwise define it: requests that meet both the TTFT and the TBT (time per
output token after the first) SLO, per second of the run. The transfer of a prompt's KV from the
prefill GPU to the decode GPU takes ``bytes / bandwidth``; with layer-wise overlap (each layer's KV
is sent as soon as that layer's prefill finishes, as Splitwise does) only what outlasts the prefill
is exposed, plus one layer's share: ``max(0, x - prefill_s) + x / layers``.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from paged.errors import ConfigError
from paged.sim.specs import get_model


def kv_transfer_bytes(model: Any, prompt_tokens: int, kv_format: str = "fp16") -> float:
    """KV bytes of ``prompt_tokens`` tokens of ``model`` over all its layers and KV heads."""
    if not (isinstance(prompt_tokens, (int, np.integer)) and prompt_tokens >= 0):
        raise ConfigError(f"prompt_tokens must be an integer >= 0, got {prompt_tokens!r}")
    return float(get_model(model).kv_bytes_per_token(kv_format, 1)) * int(prompt_tokens)


def transfer_seconds(nbytes: float, bandwidth: float, layers: int = 1, prefill_s: float = 0.0,
                     layerwise: bool = False, latency_s: float = 0.0) -> float:
    """Exposed seconds of one KV transfer (see the module docstring)."""
    if not (bandwidth > 0 and layers >= 1 and nbytes >= 0 and prefill_s >= 0 and latency_s >= 0):
        raise ConfigError("transfer_seconds needs bandwidth > 0, layers >= 1 and nbytes, prefill_s, latency_s >= 0")
    x = nbytes / bandwidth
    return latency_s + (max(0.0, x - prefill_s) + x / layers if layerwise else x)


def slo_metrics(requests: Any, ttft_slo_s: float, tpot_slo_s: float) -> dict[str, float]:
    """From a request frame (``paged.telemetry`` columns ``arrival_time_s, first_token_s, finish_s,
    num_output_tokens``): each SLO's attainment, both, and goodput (requests meeting both / the span
    from the first arrival to the last finish). Unfinished requests meet neither."""
    if not (ttft_slo_s > 0 and tpot_slo_s > 0):
        raise ConfigError(f"SLOs must be > 0 seconds, got ttft {ttft_slo_s!r}, tpot {tpot_slo_s!r}")
    n = len(requests)
    if n == 0:
        raise ConfigError("slo_metrics needs at least one request")
    arr = requests["arrival_time_s"].to_numpy(float)
    first = requests["first_token_s"].to_numpy(float)
    fin = requests["finish_s"].to_numpy(float)
    out = requests["num_output_tokens"].to_numpy(float)
    ttft = first - arr
    tpot = np.where(out > 1, (fin - first) / np.maximum(out - 1, 1), 0.0)
    ok_t = np.nan_to_num(ttft, nan=math.inf) <= ttft_slo_s
    ok_p = np.where(np.isnan(fin), False, tpot <= tpot_slo_s)
    both = ok_t & ok_p
    span = float(np.nanmax(fin) - arr.min()) if np.isfinite(fin).any() else math.nan
    return {"ttft_attain": float(ok_t.mean()), "tpot_attain": float(ok_p.mean()), "slo_attain": float(both.mean()),
            "goodput_rps": float(both.sum() / span) if span and span > 0 else math.nan,
            "tpot_p50_s": float(np.nanquantile(tpot[~np.isnan(fin)], 0.5)) if np.isfinite(fin).any() else math.nan}


def colocated_slo(chunked: bool, num_gpus: int = 4, model: str = "llama-2-13b", gpu: str = "a100-80gb",
                  num_requests: int = 200, rate: float = 4.0, prompt_tokens: int = 2048, output_tokens: int = 128,
                  ttft_slo_s: float = 2.0, tpot_slo_s: float = 0.1, token_budget: int = 512, seed: int = 0
                  ) -> dict[str, Any]:
    """Colocated serving on ``num_gpus`` one-GPU replicas (least outstanding routing), with or without
    chunked prefill (Sarathi-Serve's ``token_budget``): the SLO metrics of ``slo_metrics``."""
    from paged.sim.config import SimConfig

    from .sim import SimFleet
    from .workloads import shared_prefix_trace
    kw = dict(enable_chunked_prefill=True, max_num_batched_tokens=token_budget) if chunked else \
        dict(enable_chunked_prefill=False)
    cfg = SimConfig(model=model, gpu=gpu, enable_prefix_caching=False, prompt_seed=seed, **kw)
    trace = shared_prefix_trace(num_requests, rate, 1, prompt_tokens, 0, output_tokens, seed=seed)
    trace["prefix_id"], trace["prefix_tokens"] = -1, 0     # no shared prefix: every prompt its own
    res = SimFleet(cfg, "least_outstanding", num_replicas=num_gpus, precise=False, seed=seed).run(trace)
    return {"mode": "colocated_chunked" if chunked else "colocated", "gpus": num_gpus, "rate": rate,
            "prompt_tokens": prompt_tokens, **slo_metrics(res.requests, ttft_slo_s, tpot_slo_s),
            "ttft_p99_s": res.summary["ttft_p99_s"]}
