"""Today's KV layouts as numbers: what a request costs per model, and what a sliding window does to a pool.

- ``layout_table(models, contexts)``: one row per model: its layout (MLA, GQA, local/global,
  state), bytes per token, and a request's KV at each context, its content (what the layers hold)
  and its pool bytes (whole pages of the hybrid pool), beside the same model with every layer full
  attention (what a cache without groups would hold, vLLM's ``--disable-hybrid-kv-cache-manager``).
- ``content_bytes(model, tokens)``: a request's KV content per GPU (vectorised over ``tokens``).
- ``hybrid_vs_full(trace, model, gpu)``: the simulator on one trace, same GPU memory, with the
  hybrid pool (window blocks freed as they leave the window) and with every layer full:
  concurrency, throughput and prefix hits side by side, with ratios.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np
import pandas as pd

from paged.sim.specs import ModelSpec, get_model
from paged.sim import layouts as _layouts

__all__ = ["MODERN_MODELS", "layout_name", "content_bytes", "every_layer_full", "layout_table", "hybrid_vs_full"]

MODERN_MODELS = ("llama-3-70b", "qwen2.5-72b", "deepseek-v3", "gemma-3-27b", "gpt-oss-120b", "qwen3-next-80b-a3b")


def layout_name(model: str | ModelSpec) -> str:
    """A short description of the model's KV layout, e.g. ``"local/global: 52 x window 1,024 + 10 full"``."""
    m = get_model(model)
    if m.kv_lora_rank:
        return f"MLA: latent {m.kv_lora_rank} + RoPE {m.qk_rope_head_dim} per layer"
    kinds = _layouts.layer_kinds(m)
    full, sliding, state = (kinds.count(k) for k in ("full", "sliding", "state"))
    if state:
        return f"hybrid: {state} fixed-state + {full} full attention"
    if sliding:
        return f"local/global: {sliding} x window {m.sliding_window:,}" + (f" + {full} full" if full else "")
    return f"GQA: {m.num_kv_heads} KV heads x {m.head_dim}"


def every_layer_full(model: str | ModelSpec) -> ModelSpec:
    """The same model with every cache layer full attention (state layers stay state)."""
    m = get_model(model)
    pattern = "".join("S" if k == "state" else "F" for k in _layouts.layer_kinds(m)) if m.layer_pattern else ""
    return replace(m, name=f"{m.name} (every layer full)", layer_pattern=pattern)


def content_bytes(model: str | ModelSpec, tokens, kv_format: str = "fp16", tensor_parallel: int = 1):
    """KV bytes one request of ``tokens`` tokens holds per GPU (its layers' content: full layers every
    token, sliding layers their window, state layers their state); an array for an array."""
    layout = get_model(model).kv_layout(kv_format, tensor_parallel)
    if isinstance(tokens, np.ndarray):
        return np.array([layout.content_bytes(int(t)) for t in tokens.ravel()], dtype=np.float64).reshape(tokens.shape)
    return layout.content_bytes(int(tokens))


def layout_table(models: Sequence[str] = MODERN_MODELS, contexts: Sequence[int] = (4096, 131072),
                 kv_format: str = "bf16", tensor_parallel: int = 1, block_size: int = 16) -> pd.DataFrame:
    """One row per model (see the module docstring); bytes per GPU, GB decimal."""
    rows = []
    for name in models:
        m = get_model(name)
        layout = m.kv_layout(kv_format, tensor_parallel, block_size)
        full = every_layer_full(m).kv_layout(kv_format, tensor_parallel, block_size)
        row = {"model": m.name, "layout": layout_name(m), "groups": len(layout.groups),
               "kv_bytes_per_token": m.kv_bytes_per_token(kv_format, tensor_parallel, block_size),
               "page_bytes": layout.page_bytes}
        for c in contexts:
            row[f"content_gb_{c // 1024}k"] = layout.content_bytes(c) / 1e9
            row[f"pool_gb_{c // 1024}k"] = layout.request_bytes(c) / 1e9
            row[f"every_layer_full_gb_{c // 1024}k"] = full.request_bytes(c) / 1e9
            row[f"saved_{c // 1024}k"] = 1 - layout.request_bytes(c) / full.request_bytes(c)
        rows.append(row)
    return pd.DataFrame(rows)


def hybrid_vs_full(trace: pd.DataFrame, model: str = "gpt-oss-120b", gpu: str = "h100-sxm",
                   kv_cache_memory_bytes: int | None = None, tensor_parallel: int = 1, **sim_kw) -> pd.DataFrame:
    """The trace through the simulator twice on the same KV memory: the hybrid pool and every layer
    full. Rows: ``variant``, ``num_kv_pages``, ``page_bytes``, ``max_running``, ``mean_running``,
    ``throughput_tok_s``, ``prefix_cache_hit_rate``, ``num_preemptions``, ``duration_s``, ``rejected``
    (requests too long for the pool), and the
    hybrid pool's ratios over the full one (``*_vs_full``)."""
    from paged.sim.config import SimConfig
    from paged.sim.simulator import Simulator

    m = get_model(model)
    rows = []
    for variant, spec in (("hybrid pool", m), ("every layer full", every_layer_full(m))):
        sim = Simulator(SimConfig(model=spec, gpu=gpu, tensor_parallel=tensor_parallel,
                                  kv_cache_memory_bytes=kv_cache_memory_bytes, **sim_kw))
        res = sim.run(trace)
        s, steps = res.summary, res.steps
        rows.append({"variant": variant, "num_kv_pages": sim.num_blocks, "page_bytes": sim.block_bytes,
                     "max_running": int(steps["num_running"].max()) if len(steps) else 0,
                     "mean_running": float(steps["num_running"].mean()) if len(steps) else 0.0,
                     "rejected": int(res.requests["rejected"].sum()),
                     "throughput_tok_s": s["throughput_tok_s"], "prefix_cache_hit_rate": s["prefix_cache_hit_rate"],
                     "num_preemptions": s["num_preemptions"], "duration_s": s["duration_s"],
                     "blocks_in_use_at_end": s["num_blocks_in_use_at_end"]})
    df = pd.DataFrame(rows)
    for col in ("max_running", "mean_running", "throughput_tok_s"):
        df[f"{col}_vs_full"] = df[col] / df[col].iloc[1]
    return df
