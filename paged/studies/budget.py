"""KV-cache budget: how many bytes a request's K/V take, what preallocation wastes, and circulating
claims checked. Pure numbers (no plotting); the figures and the sliders panel are in ``paged.viz.budget``.

Invariants:
- ``kv_bytes(layers, tokens, kv_heads, head_dim, bytes_per_element)`` is exactly
  ``2 x layers x tokens x kv_heads x head_dim x bytes`` (the 2 is K and V): linear in tokens.
- ``request_kv_bytes(model, tokens, kv_format)`` = ``tokens x ModelSpec.kv_bytes_per_token(kv_format)``
  for a full-attention model (the package's one sizing rule, scale overhead of int8/int4 included);
  for today's layouts (sliding windows, state layers) the layout's content bytes
  (``paged.core.kv_groups.KVLayout.content_bytes``: a sliding layer holds its window, a state its state).
- ``reservation_waste(used, reserved)`` = ``1 - used / reserved``: the share of a contiguous
  reservation holding no token; ``paged_waste`` is the same for the last partly filled block only.
- GB are decimal (1e9 bytes), as articles quote them; GiB = 2**30 where the GPU's driver figure is meant.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from paged.errors import ConfigError
from paged.sim.specs import GiB, MODEL_PRESETS, ModelSpec, get_gpu, get_kv_format, get_model
from paged.studies.layouts import content_bytes

GB = 1e9

# LLaMA-1 65B (Touvron et al. 2023, Table 2): 80 layers, dim 8192, 64 heads; multi-head attention (no GQA).
LLAMA_65B = ModelSpec("llama-65b", 80, 8192, 64, 64, 22016, 32000, max_model_len=2048)


def kv_bytes(layers: int, tokens: int | np.ndarray, kv_heads: int, head_dim: int,
             bytes_per_element: float = 2.0) -> float | np.ndarray:
    """``2 x layers x tokens x kv_heads x head_dim x bytes``: K and V of every layer for ``tokens`` tokens."""
    for name, v in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim),
                    ("bytes_per_element", bytes_per_element)):
        if v <= 0:
            raise ConfigError(f"{name} must be positive, got {v}")
    out = 2.0 * layers * np.asarray(tokens, dtype=np.float64) * kv_heads * head_dim * bytes_per_element
    return out if isinstance(tokens, np.ndarray) else float(out)


def model_spec(model: str | ModelSpec) -> ModelSpec:
    """A preset by name (LLaMA-65B included), or the spec given."""
    return LLAMA_65B if isinstance(model, str) and model.lower() == LLAMA_65B.name else get_model(model)


def model_choices() -> list[str]:
    """Preset names a panel offers: the package's presets plus LLaMA-65B (for the 160 GB claim)."""
    return sorted([*MODEL_PRESETS, LLAMA_65B.name])


def request_kv_bytes(model: str | ModelSpec, tokens: int | np.ndarray, kv_format: str = "fp16",
                     tensor_parallel: int = 1) -> float | np.ndarray:
    """KV bytes of one request holding ``tokens`` tokens (per GPU under tensor parallelism)."""
    m = model_spec(model)
    per_tok = m.kv_bytes_per_token(kv_format, tensor_parallel)
    if m.layer_pattern:  # windows or state layers: not linear in tokens
        return content_bytes(m, tokens, kv_format, tensor_parallel)
    return np.asarray(tokens, dtype=np.float64) * per_tok if isinstance(tokens, np.ndarray) else tokens * per_tok


def reservation_waste(used: float | np.ndarray, reserved: float) -> float | np.ndarray:
    """Share of a contiguous reservation of ``reserved`` slots that holds no token (0..1)."""
    if reserved <= 0:
        raise ConfigError(f"reserved must be positive, got {reserved}")
    if np.any(np.asarray(used) > reserved) or np.any(np.asarray(used) < 0):
        raise ConfigError(f"used tokens must lie in [0, {reserved}]; raise the reservation")
    return 1.0 - np.asarray(used, dtype=np.float64) / reserved if isinstance(used, np.ndarray) else 1.0 - used / reserved


def paged_waste(used: int | np.ndarray, block_size: int) -> float | np.ndarray:
    """Share of a request's paged slots (whole blocks) holding no token: only its last block is partly empty."""
    if block_size <= 0:
        raise ConfigError(f"block_size must be positive, got {block_size}")
    u = np.asarray(used, dtype=np.float64)
    slots = np.ceil(u / block_size) * block_size
    out = np.where(slots > 0, 1.0 - u / np.maximum(slots, 1), 0.0)
    return out if isinstance(used, np.ndarray) else float(out)


def tokens_for_waste(waste: float, reserved: int) -> float:
    """The request length at which a ``reserved``-slot reservation wastes ``waste`` (inverse of reservation_waste)."""
    return reserved * (1.0 - waste)


def batch_budget(model: str | ModelSpec, context: int, batch: int, kv_format: str = "fp16",
                 gpu: str = "a100-80gb", tensor_parallel: int = 1) -> dict[str, float]:
    """One configuration in numbers, per GPU: KV bytes per token, request and batch, and the GPU's room for it:
    ``kv_room_bytes`` = HBM x 0.9 - weights/tp (vLLM's default utilisation; activations ignored), floored at 0."""
    m, g = model_spec(model), get_gpu(gpu)
    per_tok = m.kv_bytes_per_token(kv_format, tensor_parallel)
    per_request = float(request_kv_bytes(m, context, kv_format, tensor_parallel))
    heads = 1 if m.kv_lora_rank else max(1, m.num_kv_heads // tensor_parallel)
    room = max(0.0, 0.9 * g.hbm_bytes - m.weight_bytes() / tensor_parallel)
    return {"model": m.name, "kv_format": get_kv_format(kv_format).name, "context": context, "batch": batch,
            "layers": m.num_layers, "kv_heads": m.num_kv_heads, "kv_heads_per_gpu": heads, "head_dim": m.head_dim,
            "bytes_per_element": get_kv_format(kv_format, m.dtype_bytes).bits / 8,
            "bytes_per_token": per_tok, "bytes_per_request": per_request, "bytes_per_batch": per_request * batch,
            "weight_bytes": m.weight_bytes() / tensor_parallel, "gpu": g.name, "tensor_parallel": tensor_parallel, "hbm_bytes": g.hbm_bytes,
            "kv_room_bytes": room, "requests_fit": room / per_request if per_request else math.inf,
            "layout_formula": layout_formula(m, context, kv_format, tensor_parallel)}


def layout_formula(m: ModelSpec, context: int, kv_format: str = "fp16", tensor_parallel: int = 1) -> str:
    """The per-request sizing as one line of arithmetic for ``m``'s layout (plain text), or "" for a
    plain GQA/MHA model (whose formula is the module's ``kv_bytes``)."""
    b = get_kv_format(kv_format, m.dtype_bytes).bits / 8
    if m.kv_lora_rank:
        return (f"MLA: {m.num_layers} layers x {context:,} tokens x ({m.kv_lora_rank} latent + {m.qk_rope_head_dim} "
                f"RoPE) x {b:g} bytes, the same on every GPU")
    if not m.layer_pattern:
        return ""
    from paged.sim.layouts import layer_kinds

    kinds = layer_kinds(m)
    per_layer = m.layer_bytes_per_token(kv_format, tensor_parallel)
    parts = []
    if kinds.count("full"):
        parts.append(f"{kinds.count('full')} full layers x {context:,} tokens")
    if kinds.count("sliding"):
        held = min(context, m.sliding_window - 1)
        parts.append(f"{kinds.count('sliding')} sliding layers x {held:,} tokens (window {m.sliding_window:,})")
    text = " + ".join(parts) + f", x {per_layer:,} bytes per layer-token"
    if kinds.count("state"):
        state = -(-m.state_bytes_per_layer // tensor_parallel)
        text += f"; + {kinds.count('state')} state layers x {state:,} bytes whatever the length"
    return text


def check_claims() -> pd.DataFrame:
    """Figures that circulate in articles about KV caches, recomputed by this package (columns: claim,
    published, computed, verdict; each computed value comes from the functions above)."""
    l2 = get_model("llama-2-70b")
    rows = []
    gb70 = float(request_kv_bytes(l2, 4096, "fp16")) / GB
    rows.append(("LLaMA-2-70B (80 layers, 8 KV heads, head_dim 128), 4,096 tokens, FP16: KV per request",
                 "1.34 GB", f"{gb70:.2f} GB ({gb70 * GB / GiB:.2f} GiB)",
                 "right (decimal GB)" if round(gb70, 2) == 1.34 else "wrong"))
    for published, tokens in ((0.988, 150), (0.951, 3200)):
        w = float(reservation_waste(tokens, 4096))
        rows.append((f"{tokens:,}-token request in a 4,096-token reservation: share wasted", f"{published:.1%}",
                     f"{w:.1%}", f"wrong: {published:.1%} is a ~{tokens_for_waste(published, 4096):.0f}-token request"))
    r = float(request_kv_bytes(l2, 8192)) / float(request_kv_bytes(l2, 4096))
    rows.append(("KV size grows with the square of the sequence length", "x4 when the length doubles",
                 f"x{r:.2f} when the length doubles",
                 "wrong: KV bytes are linear in tokens (the attention compute over them is quadratic in prefill)"))
    gb65 = float(request_kv_bytes(LLAMA_65B, 2048, "fp16")) / GB
    rows.append(("LLaMA-65B (80 layers, 64 heads, no GQA), 2,048 tokens, FP16: KV needed", "160 GB",
                 f"{gb65:.2f} GB per request; 160 GB = {160 / gb65:.1f} requests",
                 "wrong for one request; right only for a batch of ~30"))
    return pd.DataFrame(rows, columns=["claim", "published", "computed", "verdict"])


def workload_lengths(workload: str = "sharegpt", num_requests: int = 1000, max_len: int = 4096,
                     seed: int = 0) -> np.ndarray:
    """Tokens per request (prompt + output) of a seeded synthetic trace fitted to ``max_len``."""
    from paged.sim.workload import synthetic_trace

    tr = synthetic_trace(workload, num_requests, trace_seed=seed, max_model_len=max_len)
    return (tr["prompt_tokens"] + tr["output_tokens"]).to_numpy()


__all__ = ["GB", "LLAMA_65B", "batch_budget", "layout_formula", "check_claims", "kv_bytes", "model_choices", "model_spec", "paged_waste",
           "request_kv_bytes", "reservation_waste", "tokens_for_waste", "workload_lengths"]
