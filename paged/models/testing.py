"""Tiny random-weight Hugging Face checkpoints for tests, benchmarks and notebooks:
``make_tiny_checkpoint(dir, "llama"|"qwen2"|"mistral", ...)`` (``transformers``, a test dependency).
"""
from __future__ import annotations

import os
from typing import Any


def make_tiny_checkpoint(path: str | os.PathLike[str], arch: str = "llama", *, vocab_size: int = 256,
                         hidden_size: int = 64, intermediate_size: int = 128, num_layers: int = 2,
                         num_heads: int = 4, num_kv_heads: int = 2, head_dim: int | None = None,
                         rope_theta: float = 10000.0, rope_scaling: dict[str, Any] | None = None,
                         tie_word_embeddings: bool = False, initializer_range: float = 0.1,
                         max_position_embeddings: int = 1024, seed: int = 0) -> str:
    """Save a random model; returns the directory. ``initializer_range`` is larger than
    HF's default so greedy decoding is not a sea of near-ties."""
    import torch
    import transformers as tf

    cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
           "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
           "mistral": (tf.MistralConfig, tf.MistralForCausalLM)}[arch]
    kw: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range, max_position_embeddings=max_position_embeddings,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if head_dim is not None:
        kw["head_dim"] = head_dim
    kw["rope_parameters"] = {**(rope_scaling or {"rope_type": "default"}), "rope_theta": rope_theta}
    if arch == "mistral":
        kw["sliding_window"] = None
    cfg = cls[0](**kw)
    torch.manual_seed(seed)
    model = cls[1](cfg).eval()
    if arch == "qwen2":  # HF initialises biases to zero; make them matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, initializer_range)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(os.fspath(path))
    return os.fspath(path)


# Token-id prompts for the embedded SmolLM2 (ids from the model's own tokenizer): tests compare
# engines on ids, since transformers' GGUF tokenizer splits digits differently.
SMOLLM2_PROMPTS = [
    [1, 4093, 198, 19556, 905, 17, 378, 2365, 6354, 16438, 30],
    [504, 746, 27901, 8211, 897, 3608, 282, 260, 1646, 29, 3221, 13842],
    [788, 216, 34, 32, 34, 36, 28],
]
