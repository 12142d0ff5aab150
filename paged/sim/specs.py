"""Model, GPU and KV-format specifications, and KV-cache sizing.

Invariants:
- ``ModelSpec.kv_bytes_per_token(fmt, block_size=B)`` = layers x
  ``kernels.format_table.bytes_per_token(fmt, kv_heads, head_dim, block_size=B)``: the one KV-format
  table the engine sizes its blocks with (2 x kv_heads x head_dim x bytes per element plus the
  format's per-token scales; int4_kivi's per-block K scales spread over the block), so both
  executors give the same model the same block bytes for every format.
- ``num_kv_blocks`` never returns a negative number; it raises ``SizingError`` (a
  ``ConfigError``) when the weights and activation reserve do not fit, naming what to change.

Figures: GPU peaks are NVIDIA datasheet values (dense FP16/BF16 tensor-core FLOP/s, no
sparsity). HBM bandwidths for A100-80GB (2,039 GB/s), H100 SXM (3,352 GB/s) and H200
(4.8 TB/s) are the ones listed in ANCHORS.md. HBM capacity is the total the driver reports
(``nvidia-smi``: A100 40,960 / 81,920 MiB, H200 143,771 MiB), which ``gpu_memory_utilization``
scales, as in vLLM.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

from paged._kernels import kernels as _kernels  # checks that `kernels` is ours; imports no torch
from paged.errors import ConfigError

from kernels import format_table as _formats
from kernels.format_table import KVFormat
from paged.core.kv_groups import KVLayout
from paged.sim import layouts as _layouts
from paged.sim.presets_modern import MODERN_CONFIGS
from paged.sim.gpus import GiB, GPU_PRESETS, GPUSpec, MiB, get_gpu, preset_key  # noqa: F401 - re-exported


class SizingError(ConfigError):
    """The model does not fit in GPU memory with the requested settings."""


# ---- KV formats --------------------------------------------------------------------------------


# The format table is kernels.format_table (shared with the engine); "fp8" is the CLI's name for e4m3.
KV_FORMATS: dict[str, KVFormat] = {**_formats.FORMATS, "fp8": _formats.FORMATS["fp8_e4m3"]}


def get_kv_format(name: str | KVFormat, dtype_bytes: int = 2) -> KVFormat:
    """Look up a KV format by name or alias (``fp16``, ``bf16``, ``fp8``, ``int8``, ``int4``,
    ``int4_kivi``, ...); ``"auto"`` is the model dtype (fp32 when ``dtype_bytes`` is 4, else fp16)."""
    if isinstance(name, KVFormat):
        return name
    try:
        return _formats.lookup(name, "float32" if dtype_bytes == 4 else "float16")
    except _kernels.KVFormatError:
        raise ConfigError(f"unknown kv format {name!r}; choose one of {sorted(KV_FORMATS)}") from None


# ---- Models ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Shape of a LLaMA-family decoder (GQA, SwiGLU MLP, RMSNorm)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    max_model_len: int = 4096
    dtype_bytes: int = 2
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    # layers that hold a KV cache: fewer than num_layers under cross-layer KV sharing (the engine's
    # kv_share_with); 0 = num_layers. Capacity (kv_bytes_per_token) counts these; every layer still reads K/V
    kv_layers: int = 0
    # today's layouts (paged.sim.layouts): MLA latent, sliding/local-global patterns, fixed state layers
    kv_lora_rank: int = 0            # MLA: the cached latent's width (0: GQA K/V per head)
    qk_rope_head_dim: int = 0        # MLA: RoPE dims cached beside the latent
    layer_pattern: str = ""          # per layer, cycled: F full, W sliding window, S fixed state ("": all F)
    sliding_window: int = 0          # tokens a W layer's query attends, its own included
    state_bytes_per_layer: int = 0   # S layers: bytes of one layer's state per request (tensor parallel 1)
    # MoE / quantized checkpoints, from the model card (0: the LLaMA formulas below)
    total_params: int = 0            # all parameters
    active_params: int = 0           # parameters one token's matmuls touch, LM head excluded
    weight_bytes_per_param: float = 0.0  # checkpoint bytes per parameter (0: dtype_bytes)

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.kv_layers == 0:
            object.__setattr__(self, "kv_layers", self.num_layers)
        if not 0 < self.kv_layers <= self.num_layers:
            raise ConfigError(f"ModelSpec {self.name!r}: kv_layers must lie in 1..num_layers={self.num_layers}, "
                              f"got {self.kv_layers}")
        for f in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "intermediate_size",
                  "vocab_size", "head_dim", "max_model_len", "dtype_bytes"):
            if getattr(self, f) <= 0:
                raise ConfigError(f"ModelSpec {self.name!r}: {f} must be positive, got {getattr(self, f)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"ModelSpec {self.name!r}: num_heads={self.num_heads} is not a multiple "
                              f"of num_kv_heads={self.num_kv_heads}")
        _layouts.check_spec(self)

    # -- parameter counts ----------------------------------------------------------------------
    @property
    def params_per_layer(self) -> int:
        h, d = self.hidden_size, self.head_dim
        q = h * self.num_heads * d
        kv = 2 * h * self.num_kv_heads * d
        o = self.num_heads * d * h
        bias = (self.num_heads + 2 * self.num_kv_heads) * d if self.qkv_bias else 0
        mlp = 3 * h * self.intermediate_size
        return q + kv + o + bias + mlp + 2 * h

    @property
    def lm_head_params(self) -> int:
        """Parameters of the LM head, as many as of the token embedding."""
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """Total parameters (tied embeddings counted once); ``total_params`` when the preset gives it."""
        if self.total_params:
            return self.total_params
        n = self.num_layers * self.params_per_layer + self.vocab_size * self.hidden_size + self.hidden_size
        return n if self.tie_word_embeddings else n + self.lm_head_params

    @property
    def matmul_params_per_token(self) -> int:
        """Parameters touched by matmuls for every token (all layers; not the LM head);
        ``active_params`` when the preset gives it (MoE: the routed experts a token uses)."""
        return self.active_params or self.num_layers * self.params_per_layer

    def weight_bytes(self) -> int:
        return int(self.num_params * (self.weight_bytes_per_param or self.dtype_bytes))

    # -- KV sizing ------------------------------------------------------------------------------
    def kv_bytes_per_token(self, kv_format: str | KVFormat = "fp16", tensor_parallel: int = 1,
                           block_size: int = 16) -> int:
        """KV bytes per token on one GPU, all attention cache layers (full and sliding; state layers
        are a fixed cost per request, see ``kv_layout``), as the engine allocates them: attention
        layers x ``layer_bytes_per_token`` (see the module's invariants). ``block_size`` matters only
        for ``int4_kivi`` (its per-block K scales). A sliding layer counts here as long as the token
        is inside its window.

        With tensor parallelism the KV heads are split across GPUs (replicated when
        ``num_kv_heads < tensor_parallel``, as in vLLM); an MLA latent is never split.
        """
        return _layouts.attention_layers(self) * self.layer_bytes_per_token(kv_format, tensor_parallel, block_size)

    def layer_bytes_per_token(self, kv_format: str | KVFormat = "fp16", tensor_parallel: int = 1,
                              block_size: int = 16) -> int:
        """One attention layer's KV bytes per token on one GPU: GQA K and V of its share of the KV
        heads, or MLA's one latent + RoPE vector, whole on every GPU (``paged.sim.layouts``)."""
        fmt = get_kv_format(kv_format, self.dtype_bytes)
        self.check_tensor_parallel(tensor_parallel)
        if self.kv_lora_rank:
            return _layouts.mla_bytes_per_token(self, fmt)
        heads = max(1, self.num_kv_heads // tensor_parallel) if tensor_parallel > 1 else self.num_kv_heads
        try:
            return _formats.bytes_per_token(fmt, heads, self.head_dim, block_size=block_size)
        except _kernels.KernelError as e:
            raise ConfigError(f"{self.name} with kv format {fmt.name!r}: {e}") from e

    def kv_layout(self, kv_format: str | KVFormat = "fp16", tensor_parallel: int = 1,
                  block_size: int = 16) -> "KVLayout":
        """The cache's groups on one GPU (``paged.core.kv_groups.KVLayout``): one full-attention
        group for a LLaMA-style model, several for sliding-window and state hybrids."""
        return _layouts.layout_of(self, kv_format, tensor_parallel, block_size)

    def check_tensor_parallel(self, tensor_parallel: int) -> None:
        """Raise ConfigError unless the heads split evenly over ``tensor_parallel`` GPUs (vLLM's rule:
        query heads divisible by tp; KV heads divisible by tp, or tp divisible by KV heads when
        they are replicated). Otherwise per-GPU KV bytes and attention FLOPs would be fractions."""
        tp = tensor_parallel
        if isinstance(tp, bool) or not isinstance(tp, (int, float)) or tp < 1 or int(tp) != tp:
            raise ConfigError(f"tensor_parallel must be a positive integer, got {tp!r}")
        tp, kv = int(tp), self.num_kv_heads
        if self.num_heads % tp or (kv % tp if kv >= tp else tp % kv):
            ok = [d for d in range(1, self.num_heads + 1)
                  if self.num_heads % d == 0 and (kv % d == 0 if kv >= d else d % kv == 0)]
            raise ConfigError(f"{self.name}: tensor_parallel={tp} does not split {self.num_heads} attention heads "
                              f"and {kv} KV heads evenly; choose one of {ok}")

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, config: str | os.PathLike | Mapping[str, Any], name: str | None = None) -> "ModelSpec":
        """Build from a Hugging Face ``config.json`` (path to the file or its folder, or a dict)."""
        if not isinstance(config, Mapping):
            path = os.fspath(config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            try:
                with open(path, encoding="utf-8") as fh:
                    cfg: Mapping[str, Any] = json.load(fh)
            except (OSError, json.JSONDecodeError) as exc:
                raise ConfigError(f"cannot read HF config {path!r}: {exc}") from exc
            name = name or os.path.basename(os.path.dirname(os.path.abspath(path))) or "hf-model"
        else:
            cfg = config
        required = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
        missing = [k for k in required if k not in cfg]
        if missing:
            raise ConfigError(f"HF config lacks {missing}; only LLaMA-family decoders are supported")
        return cls(
            name=name or str(cfg.get("_name_or_path") or cfg.get("model_type", "hf-model")),
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=int(cfg["hidden_size"]),
            num_heads=int(cfg["num_attention_heads"]),
            num_kv_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            head_dim=int(cfg.get("head_dim") or 0),
            max_model_len=int(cfg.get("max_position_embeddings", 4096)),
            dtype_bytes=4 if "32" in str(cfg.get("torch_dtype", cfg.get("dtype", "bfloat16"))) else 2,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
        )


MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        # LLaMA-1 13B as in the vLLM paper (2,048-token context).
        ModelSpec("llama-13b", 40, 5120, 40, 40, 13824, 32000, max_model_len=2048),
        ModelSpec("llama-2-7b", 32, 4096, 32, 32, 11008, 32000, max_model_len=4096),
        ModelSpec("llama-2-13b", 40, 5120, 40, 40, 13824, 32000, max_model_len=4096),
        ModelSpec("llama-2-70b", 80, 8192, 64, 8, 28672, 32000, max_model_len=4096),
        ModelSpec("llama-3-8b", 32, 4096, 32, 8, 14336, 128256, max_model_len=8192),
        ModelSpec("llama-3-70b", 80, 8192, 64, 8, 28672, 128256, max_model_len=8192),
        # Llama 3.1 (meta-llama/Llama-3.1-{8B,70B} config.json): the 3.0 shapes, 131,072-token context
        ModelSpec("llama-3.1-8b", 32, 4096, 32, 8, 14336, 128256, max_model_len=131072),
        ModelSpec("llama-3.1-70b", 80, 8192, 64, 8, 28672, 128256, max_model_len=131072),
        ModelSpec("mistral-7b", 32, 4096, 32, 8, 14336, 32000, max_model_len=32768),
        ModelSpec("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, max_model_len=32768, qkv_bias=True),
        ModelSpec("smollm2-135m", 30, 576, 9, 3, 1536, 49152, max_model_len=8192, tie_word_embeddings=True),
        *(ModelSpec(**config) for config in MODERN_CONFIGS),  # paged.sim.presets_modern
    )
}


def get_model(name: str | ModelSpec) -> ModelSpec:
    """A preset by name (case-insensitive), or a ModelSpec from a HF ``config.json`` path."""
    if isinstance(name, ModelSpec):
        return name
    key = preset_key(name)
    if key in MODEL_PRESETS:
        return MODEL_PRESETS[key]
    if os.path.exists(name):
        return ModelSpec.from_hf_config(name)
    raise ConfigError(f"unknown model {name!r}; choose one of {sorted(MODEL_PRESETS)} or pass a config.json path")


# ---- Sizing ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KVSizing:
    """How the memory of one GPU is split (bytes, per GPU)."""

    budget_bytes: float
    weight_bytes: float
    activation_bytes: float
    kv_bytes: float
    bytes_per_block: float
    num_blocks: int
    block_size: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


def activation_reserve_bytes(model: ModelSpec, max_num_batched_tokens: int = 2048, max_num_seqs: int = 256,
                             tensor_parallel: int = 1, fixed_overhead: float = 1 * GiB) -> float:
    """Rough peak activation memory of one forward pass, plus a fixed runtime overhead.

    Counts the residual stream and attention projections (4 x hidden), the gate/up MLP
    intermediates (2 x intermediate / tp) per batched token, and fp32 logits for sampled rows.
    """
    per_tok = (4 * model.hidden_size + 2 * model.intermediate_size / tensor_parallel) * model.dtype_bytes
    return max_num_batched_tokens * per_tok + max_num_seqs * model.vocab_size * 4 + fixed_overhead


def kv_cache_sizing(model: ModelSpec | str, gpu: GPUSpec | str, block_size: int = 16,
                    kv_format: str | KVFormat = "fp16", tensor_parallel: int = 1,
                    gpu_memory_utilization: float = 0.9, max_num_batched_tokens: int = 2048,
                    max_num_seqs: int = 256) -> KVSizing:
    """Split one GPU's memory: ``utilization x HBM = weights/tp + activations + KV blocks``."""
    model, gpu = get_model(model), get_gpu(gpu)
    if not 0 < gpu_memory_utilization <= 1:
        raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if block_size <= 0 or tensor_parallel <= 0:
        raise ConfigError(f"block_size and tensor_parallel must be positive, got {block_size}, {tensor_parallel}")
    budget = gpu.hbm_bytes * gpu_memory_utilization
    weights = model.weight_bytes() / tensor_parallel
    act = activation_reserve_bytes(model, max_num_batched_tokens, max_num_seqs, tensor_parallel)
    kv = budget - weights - act
    per_block = model.kv_layout(kv_format, tensor_parallel, block_size).page_bytes  # all layers, or one group's
    if 0 < kv < per_block:
        raise SizingError(
            f"one KV block of {block_size} tokens needs {per_block / GiB:.2f} GiB on each GPU but only "
            f"{kv / GiB:.2f} GiB of GPU memory is left for the KV cache; lower block_size")
    if kv < per_block:
        raise SizingError(
            f"{model.name} needs {weights / GiB:.1f} GiB of weights + {act / GiB:.1f} GiB activations per GPU "
            f"but only {budget / GiB:.1f} GiB of {gpu.name} is usable at utilization {gpu_memory_utilization}; "
            f"raise tensor_parallel, gpu_memory_utilization or pick a larger GPU")
    return KVSizing(budget, weights, act, kv, per_block, int(kv // per_block), block_size)


def num_kv_blocks(model: ModelSpec | str, gpu: GPUSpec | str, block_size: int = 16, **kw: Any) -> int:
    """Number of KV blocks of ``block_size`` tokens that fit on each GPU (see ``kv_cache_sizing``)."""
    return kv_cache_sizing(model, gpu, block_size, **kw).num_blocks


__all__ = [
    "GiB", "MiB", "SizingError", "KVFormat", "KV_FORMATS", "get_kv_format", "ModelSpec", "MODEL_PRESETS", "get_model",
    "GPUSpec", "GPU_PRESETS", "get_gpu", "KVSizing", "activation_reserve_bytes", "kv_cache_sizing", "num_kv_blocks",
]
