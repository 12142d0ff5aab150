"""A LLaMA-family decoder (LLaMA, Mistral, Qwen2, SmolLM2) over packed token batches.

All sequences' tokens of a step are packed along one axis ``[T]``; attention is an
``AttentionBackend`` (``__call__(layer_idx, q, k, v) -> out``): the paged one in
``paged.engine.runner``, or ``DenseCausalAttention`` (``dense.py``), the cache-free reference.
Weights use HF names without ``model.``; q/k/v and gate/up are fused at load (fewer matmuls).
"""
from __future__ import annotations

from typing import Mapping, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from paged._kernels import kernels  # noqa: F401  (checks it is the workbench's package)
from kernels import native
from .config import ModelConfig
from . import packed
from .packed import PackedLinear
from .rope import RotaryEmbedding


class AttentionBackend(Protocol):
    """Computes attention for one layer on packed tokens. q ``[T, num_heads, head_dim]``, k/v
    ``[T, num_kv_heads, head_dim]`` (after RoPE), returns ``[T, num_heads, head_dim]``."""

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` computed in float32, returned in the input dtype (float32 CPU rows:
    :func:`kernels.native.rms_norm` where built, else ``F.rms_norm``; equal up to float rounding)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32 and x.device.type == "cpu":
            if x.dim() == 2 and x.is_contiguous() and native.available():
                return native.rms_norm(x, self.weight, self.eps)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one op; same bits (CPU fp32)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.nh * self.hd, self.nkv * self.hd
        self.qkv_proj = PackedLinear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = PackedLinear(self.q_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                attn: AttentionBackend, rot: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``rot``: ``rope.tables(positions)`` when the caller built them once for all layers.
        q and k heads are rotated in one call; backends with ``accepts_strided`` get q/k/v as
        views of the fused projection (others get contiguous tensors)."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        qk = qkv[:, :self.q_size + self.kv_size].view(t, self.nh + self.nkv, self.hd)
        qk = rope.rotate(qk, rope.tables(positions) if rot is None else rot)
        q, k = qk[:, :self.nh], qk[:, self.nh:]
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.nkv, self.hd)
        if not getattr(attn, "accepts_strided", False):
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        return self.o_proj(attn(self.layer_idx, q, k, v).reshape(t, self.q_size))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = PackedLinear(cfg.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = PackedLinear(self.inter, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x)
        if gu.dtype == torch.float32 and gu.device.type == "cpu" and gu.dim() == 2 and native.available():
            return self.down_proj(native.silu_mul(gu.contiguous()))  # one pass instead of silu, split, mul
        gate, up = gu.split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                attn: AttentionBackend, rot: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, attn, rot)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. ``forward`` returns hidden states; ``compute_logits`` the
    float32 logits of selected rows (only sampled positions pay for the LM head)."""

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        # weights always come from a checkpoint (from_weights), so no random init: on the meta device
        # nn.Embedding's normal_ alone cost 2-6 s of first-use imports (torch._refs) per process
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg, min(max_positions or cfg.max_position_embeddings, 1 << 16))
        self.lm_head = None if cfg.tie_word_embeddings else PackedLinear(
            cfg.hidden_size, cfg.vocab_size, bias=False)
        self._lm_pack = packed.PackCache()  # the LM head's packed weight (tied: the embedding's)

    @classmethod
    def from_weights(cls, cfg: ModelConfig, weights: Mapping[str, torch.Tensor],
                     dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                     max_positions: int | None = None) -> "LlamaForCausalLM":
        """Build without random init (meta device), then copy ``weights`` in.
        RoPE tables stay float32 whatever ``dtype`` is."""
        with torch.device("meta"):
            m = cls(cfg, max_positions)
        m = m.to_empty(device=device).to(dtype)
        m.rope.reset(m.rope.cos.shape[0], device)
        try:
            m.load_weights(weights)
        except (KeyError, ValueError) as e:
            from paged.errors import ModelLoadError
            raise ModelLoadError(f"checkpoint does not fit the {cfg.architecture} config: {e}") from e
        return m.eval()

    @property
    def lm_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionBackend) -> torch.Tensor:
        """``input_ids``/``positions`` int64 ``[T]`` -> final-normed hidden ``[T, H]``."""
        x = self.embed_tokens(input_ids)
        self.rope.ensure(positions)  # once per pass, not once per layer
        rot = self.rope.tables(positions)  # cos/sin rows gathered once, shared by all layers
        for layer in self.layers:
            x = layer(x, positions, self.rope, attn, rot)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return packed.linear(hidden, self.lm_weight, None, self._lm_pack).float()

    # ---- weights -------------------------------------------------------------
    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy HF-named tensors (``layers.{i}.self_attn.q_proj.weight`` ...) into the
        fused parameters. ``model.`` prefixes are stripped. Every parameter must be
        covered and no unknown tensor may remain."""
        w = {k.removeprefix("model."): v for k, v in weights.items()}
        used: set[str] = set()

        def take(name: str) -> torch.Tensor:
            if name not in w:
                raise KeyError(f"checkpoint lacks tensor {name!r}")
            used.add(name)
            return w[name]

        def put(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
            if tuple(param.shape) != tuple(value.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != "
                                 f"model shape {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(value.to(param.dtype))

        put(self.embed_tokens.weight, take("embed_tokens.weight"), "embed_tokens.weight")
        put(self.norm.weight, take("norm.weight"), "norm.weight")
        if self.lm_head is not None:
            put(self.lm_head.weight, take("lm_head.weight"), "lm_head.weight")
        elif "lm_head.weight" in w:
            used.add("lm_head.weight")  # tied: HF may still save a copy
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            a = layer.self_attn
            qkv = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"], 0)
            put(a.qkv_proj.weight, qkv, p + "qkv_proj.weight")
            if self.config.qkv_bias:
                b = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"], 0)
                put(a.qkv_proj.bias, b, p + "qkv_proj.bias")
            put(a.o_proj.weight, take(p + "self_attn.o_proj.weight"), p + "o_proj.weight")
            gu = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], 0)
            put(layer.mlp.gate_up_proj.weight, gu, p + "gate_up_proj.weight")
            put(layer.mlp.down_proj.weight, take(p + "mlp.down_proj.weight"), p + "down_proj.weight")
            put(layer.input_layernorm.weight, take(p + "input_layernorm.weight"), p + "input_layernorm")
            put(layer.post_attention_layernorm.weight, take(p + "post_attention_layernorm.weight"),
                p + "post_attention_layernorm")
        leftover = sorted(k for k in w if k not in used and "rotary_emb" not in k)
        if leftover:
            raise ValueError(f"checkpoint has tensors the model does not use: {leftover[:5]}")
