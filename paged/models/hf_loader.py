"""Load a local Hugging Face checkpoint directory (``config.json`` + ``*.safetensors``; nothing is
downloaded): llama, mistral, qwen2 (q/k/v biases). Mistral/Qwen2 sliding windows cap ``max_model_len``
at the window (attention is exact as long as no context exceeds it).
"""
from __future__ import annotations

import glob
import json
import os
from typing import Any

import torch

from .config import SUPPORTED_HF_ARCHITECTURES, ModelConfig
from paged.errors import ModelLoadError


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    rp = cfg.get("rope_parameters") or {}
    theta = float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    sc = dict(cfg.get("rope_scaling") or {k: v for k, v in rp.items() if k != "rope_theta"})
    sc["rope_type"] = sc.get("rope_type", sc.get("type", "default"))
    return theta, (None if sc["rope_type"] == "default" else sc)


def hf_config(path: str) -> tuple[ModelConfig, int]:
    """ModelConfig and the max model length (sliding-window aware) of a HF directory."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelLoadError(f"{path!r} has no config.json; expected a Hugging Face checkpoint "
                             "directory (config.json + *.safetensors) or a .gguf file")
    try:
        with open(cfg_path) as f:
            c = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {cfg_path}: {e}") from e
    if not isinstance(c, dict):
        raise ModelLoadError(f"{cfg_path} is not a JSON object")
    mt = c.get("model_type")
    if mt not in SUPPORTED_HF_ARCHITECTURES:
        raise ModelLoadError(f"model_type {mt!r} in {cfg_path} is not supported; "
                             f"supported: {SUPPORTED_HF_ARCHITECTURES}")
    if c.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"hidden_act {c.get('hidden_act')!r} is not supported (silu only)")
    missing = [k for k in ("num_attention_heads", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "vocab_size") if k not in c]
    if missing:
        raise ModelLoadError(f"{cfg_path} lacks {', '.join(missing)}; is it a complete {mt} config?")
    nh = int(c["num_attention_heads"])
    head_dim = c.get("head_dim") or c["hidden_size"] // nh
    theta, scaling = _rope(c)
    eos = c.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    max_pos = max_len = int(c.get("max_position_embeddings", 2048))
    window = c.get("sliding_window")
    if window and (mt == "mistral" or c.get("use_sliding_window", False)):
        max_len = min(max_len, int(window))
    if mt == "llama" and c.get("mlp_bias"):
        raise ModelLoadError("llama checkpoints with mlp_bias=True are not supported")
    try:
        cfg = ModelConfig(
            vocab_size=int(c["vocab_size"]), hidden_size=int(c["hidden_size"]),
            intermediate_size=int(c["intermediate_size"]), num_layers=int(c["num_hidden_layers"]),
            num_heads=nh, num_kv_heads=int(c.get("num_key_value_heads") or nh),
            head_dim=int(head_dim), rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            rope_theta=theta, rope_scaling=scaling,
            qkv_bias=(mt == "qwen2") or bool(c.get("attention_bias", False)),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            max_position_embeddings=max_pos, bos_token_id=c.get("bos_token_id"),
            eos_token_ids=eos_ids, architecture=mt, name=os.path.basename(os.path.normpath(path)),
        )
    except ValueError as e:
        raise ModelLoadError(f"{cfg_path}: {e}") from e
    if mt == "llama" and c.get("attention_bias"):
        raise ModelLoadError("llama checkpoints with attention_bias=True (o_proj bias) are not supported")
    return cfg, max_len


def hf_weights(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"{path!r} has no *.safetensors files (pytorch .bin is not supported)")
    return {k: v for f in files for k, v in load_file(f).items()}
