"""LLaMA-family models on the paged KV cache, and their loaders: ``load_model("smollm2")`` (the embedded
SmolLM2-135M-Instruct, Q4_1 weights dequantized to the compute dtype) or ``load_model(path)`` (a local
GGUF file or Hugging Face directory: llama, mistral, qwen2).
"""
from .config import ModelConfig
from .dense import DenseCausalAttention, dense_logits, mean_nll
from paged.errors import ModelLoadError
from .llama import AttentionBackend, LlamaForCausalLM
from .loader import LoadedModel, embedded_gguf_path, load_model, resolve_model_path

__all__ = [
    "AttentionBackend", "DenseCausalAttention", "LlamaForCausalLM", "LoadedModel", "ModelConfig",
    "ModelLoadError", "dense_logits", "embedded_gguf_path", "load_model", "mean_nll",
    "resolve_model_path",
]
