"""Presets of today's KV layouts, each from the model's ``config.json`` on the Hugging Face Hub.

Plain ``ModelSpec`` keyword arguments (``paged.sim.specs`` builds them; ``paged.sim.layouts`` says
what the layout fields mean). Positional order of the shape: ``name, num_layers, hidden_size,
num_heads, num_kv_heads, intermediate_size, vocab_size``. Bytes per token of each are checked
against a figure computed by hand in ``tests/test_layouts_presets.py``.
"""
from __future__ import annotations

from typing import Any

__all__ = ["MODERN_CONFIGS"]


def _shape(name: str, layers: int, hidden: int, heads: int, kv_heads: int, inter: int, vocab: int,
           **kw: Any) -> dict[str, Any]:
    return dict(name=name, num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads,
                intermediate_size=inter, vocab_size=vocab, **kw)


MODERN_CONFIGS: tuple[dict[str, Any], ...] = (
    # deepseek-ai/DeepSeek-V3: num_hidden_layers 61, hidden_size 7168, num_attention_heads 128,
    # num_key_value_heads 128, intermediate_size 18432, vocab_size 129280, max_position_embeddings
    # 163840, kv_lora_rank 512, qk_rope_head_dim 64 (qk_nope_head_dim 128: 192 dims per head for Q.K).
    # MoE: the technical report's 671B total, 36.6B active including the 0.9B output head; FP8
    # weights (its quantization_config, e4m3), the KV cache at bf16.
    _shape("deepseek-v3", 61, 7168, 128, 128, 18432, 129280, head_dim=192, max_model_len=163840,
           kv_lora_rank=512, qk_rope_head_dim=64, total_params=671_000_000_000,
           active_params=35_700_000_000, weight_bytes_per_param=1.0),
    # Qwen/Qwen2.5-72B-Instruct: 80 layers, hidden 8192, 64 heads, 8 KV heads, intermediate 29568,
    # vocab 152064, QKV bias; config max_position_embeddings 32768, the model card's 131,072 with YaRN x4.
    _shape("qwen2.5-72b", 80, 8192, 64, 8, 29568, 152064, max_model_len=131072, qkv_bias=True),
    # google/gemma-3-27b-it text_config: 62 layers, hidden 5376, 32 heads, 16 KV heads, head_dim 128,
    # intermediate 21504, vocab 262208, max_position_embeddings 131072, sliding_window 1024,
    # sliding_window_pattern 6 (layer i is global when (i + 1) % 6 == 0), tied embeddings.
    _shape("gemma-3-27b", 62, 5376, 32, 16, 21504, 262208, head_dim=128, max_model_len=131072,
           tie_word_embeddings=True, layer_pattern="WWWWWF", sliding_window=1024),
    # openai/gpt-oss-120b: 36 layers, hidden 2880, 64 heads, 8 KV heads, head_dim 64, intermediate
    # 2880 (per expert; 128 experts, 4 per token), vocab 201088, max_position_embeddings 131072,
    # attention bias, layer_types alternating sliding_attention / full_attention from layer 0,
    # sliding_window 128. Model card: 117B total, 5.1B active; MXFP4 experts (4.25 bits) beside bf16
    # attention and embeddings: about 0.55 bytes per parameter (approximate).
    _shape("gpt-oss-120b", 36, 2880, 64, 8, 2880, 201088, head_dim=64, max_model_len=131072, qkv_bias=True,
           layer_pattern="WF", sliding_window=128, total_params=117_000_000_000,
           active_params=5_100_000_000, weight_bytes_per_param=0.55),
    # mistralai/Mistral-7B-v0.1: 32 layers, hidden 4096, 32 heads, 8 KV heads (head_dim 128),
    # intermediate 14336, vocab 32000, max_position_embeddings 32768, sliding_window 4096 on every
    # layer (no full-attention layer; v0.2 and later dropped the window: the "mistral-7b" preset).
    _shape("mistral-7b-v0.1", 32, 4096, 32, 8, 14336, 32000, max_model_len=32768, layer_pattern="W",
           sliding_window=4096),
    # Qwen/Qwen3-Next-80B-A3B-Instruct: 48 layers, hidden 2048, 16 heads, 2 KV heads, head_dim 256,
    # intermediate 5120, vocab 151936, max_position_embeddings 262144, full_attention_interval 4
    # (layers 3, 7, ... full attention, the rest Gated DeltaNet). One DeltaNet layer's state per
    # request: conv (2 x 16 key heads x 128 + 32 value heads x 128) x (linear_conv_kernel_dim 4 - 1) =
    # 24,576 values and recurrent 32 value heads x 128 x 128 = 524,288 values; at bf16 1,097,728
    # bytes. 80B total, 3B active (the model's name and card).
    _shape("qwen3-next-80b-a3b", 48, 2048, 16, 2, 5120, 151936, head_dim=256, max_model_len=262144,
           layer_pattern="SSSF", state_bytes_per_layer=(24_576 + 524_288) * 2,
           total_params=80_000_000_000, active_params=3_000_000_000),
)
