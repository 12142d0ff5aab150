"""Architecture description shared by every loader (HF directories and GGUF files).

One frozen dataclass holds what the forward pass needs; loaders translate their
formats into it. Invariant: ``num_heads % num_kv_heads == 0``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_HF_ARCHITECTURES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and numerics of a LLaMA-family decoder.

    ``rope_scaling`` is None or a dict with ``rope_type`` in SUPPORTED_ROPE_TYPES
    plus that type's parameters (``factor``; for llama3 also ``low_freq_factor``,
    ``high_freq_factor``, ``original_max_position_embeddings``).
    ``rope_freq_factors`` (GGUF ``rope_freqs.weight``) divides the inverse
    frequencies element-wise when present; it is how GGUF files store llama3 scaling.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rope_freq_factors: tuple[float, ...] | None = None
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    architecture: str = "llama"
    name: str = ""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.rope_scaling is not None:
            rt = self.rope_scaling.get("rope_type", "default")
            if rt not in SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"rope scaling type {rt!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
