"""Write a loaded model as a Hugging Face directory that both ``paged.LLM(model=dir)`` and vLLM load.

    path = export_hf("smollm2", ".cache/models/smollm2-135m-hf")   # the embedded GGUF, dequantized

``config.json`` (``LlamaForCausalLM``), ``model.safetensors`` (our weights as held, float32 by
default), ``tokenizer.json`` (the loader's ``tokenizers`` object), ``tokenizer_config.json`` and
``generation_config.json``. Invariants: the export loads to the same tensors, so greedy outputs are
identical (tests/test_connect_export.py); a complete directory whose ``paged_export.json`` names the
same source and dtype is reused as is.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from paged.errors import ConfigError, ModelLoadError

from .loader import LoadedModel, load_model

_STAMP = "paged_export.json"
_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def hf_state_dict(loaded: LoadedModel) -> dict[str, torch.Tensor]:
    """HF-named tensors (``model.layers.0.self_attn.q_proj.weight`` ...) from our fused parameters;
    ``lm_head.weight`` only when the embeddings are not tied."""
    cfg, m = loaded.config, loaded.model
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": m.embed_tokens.weight,
                                    "model.norm.weight": m.norm.weight}
    if m.lm_head is not None:
        out["lm_head.weight"] = m.lm_head.weight
    for i, layer in enumerate(m.layers):
        p = f"model.layers.{i}."
        attn = layer.self_attn
        wq, wk, wv = attn.qkv_proj.weight.split([q, kv, kv])
        out.update({p + "self_attn.q_proj.weight": wq, p + "self_attn.k_proj.weight": wk,
                    p + "self_attn.v_proj.weight": wv, p + "self_attn.o_proj.weight": attn.o_proj.weight,
                    p + "input_layernorm.weight": layer.input_layernorm.weight,
                    p + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight})
        if getattr(attn.qkv_proj, "bias", None) is not None:
            bq, bk, bv = attn.qkv_proj.bias.split([q, kv, kv])
            out.update({p + "self_attn.q_proj.bias": bq, p + "self_attn.k_proj.bias": bk,
                        p + "self_attn.v_proj.bias": bv})
        inter = cfg.intermediate_size
        gate, up = layer.mlp.gate_up_proj.weight.split([inter, inter])
        out.update({p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                    p + "mlp.down_proj.weight": layer.mlp.down_proj.weight})
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in out.items()}


def hf_config_dict(loaded: LoadedModel, dtype: torch.dtype) -> dict:
    """``config.json`` of a llama-architecture export (what transformers and vLLM read)."""
    c = loaded.config
    if c.architecture != "llama" or c.qkv_bias:
        raise ConfigError(f"export_hf writes llama checkpoints; this model is {c.architecture!r}"
                          f"{' with q/k/v biases' if c.qkv_bias else ''}")
    if c.rope_freq_factors is not None:
        raise ConfigError("export_hf does not write GGUF rope_freqs (llama3 scaling) yet")
    eos = list(c.eos_token_ids)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling,
        "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
        "bos_token_id": c.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "torch_dtype": str(dtype).removeprefix("torch."), "use_cache": True,
    }


def _tokenizer_files(loaded: LoadedModel, out: Path) -> None:
    tok = loaded.tokenizer
    if tok is None:
        raise ConfigError(f"{loaded.source} has no tokenizer to export; vLLM needs one (tokenizer.json)")
    tok.save(str(out / "tokenizer.json"))  # the tokenizers object the loader built

    def content(i: int | None) -> str | None:
        return None if i is None else tok.id_to_token(i)

    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": content(tok.bos_token_id),
           "eos_token": content(tok.eos_token_id), "unk_token": None, "pad_token": content(tok.eos_token_id),
           "add_bos_token": bool(tok.add_bos), "add_eos_token": False, "clean_up_tokenization_spaces": False,
           "model_max_length": loaded.max_model_len}
    if tok.chat_template:
        cfg["chat_template"] = tok.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def export_hf(model: str | LoadedModel | None = "smollm2", path: str | os.PathLike[str] = ".cache/models/smollm2-hf",
              *, dtype: torch.dtype = torch.float32, overwrite: bool = False) -> Path:
    """Write ``model`` (a name/path for ``load_model`` or a ``LoadedModel``) as an HF directory at
    ``path`` and return it. Reuses a complete earlier export of the same source and dtype unless
    ``overwrite``; raises ConfigError if ``path`` exists and holds something else."""
    from safetensors.torch import save_file
    out = Path(path)
    source = model.source if isinstance(model, LoadedModel) else str(model)
    stamp = {"source": source, "dtype": str(dtype), "format": "paged-export-hf/1"}
    if out.exists() and not overwrite:
        try:
            old = json.loads((out / _STAMP).read_text())
        except (OSError, ValueError):
            old = None
        if old == stamp and all((out / f).is_file() for f in _FILES):
            return out
        if old is None and any(out.iterdir()):
            raise ConfigError(f"{out} exists and is not an export of this workbench; pick an empty path "
                              "or pass overwrite=True")
    loaded = model if isinstance(model, LoadedModel) else load_model(model, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    (out / _STAMP).unlink(missing_ok=True)  # incomplete until the stamp is written last
    weights = {k: v.to(dtype) for k, v in hf_state_dict(loaded).items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config_dict(loaded, dtype), indent=2))
    _tokenizer_files(loaded, out)
    eos = list(loaded.config.eos_token_ids)
    gen = {"bos_token_id": loaded.config.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos,
           "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    (out / _STAMP).write_text(json.dumps(stamp))
    return out


def check_export(path: str | os.PathLike[str]) -> None:
    """Raise ModelLoadError naming what an export directory lacks."""
    p = Path(path)
    missing = [f for f in _FILES if not (p / f).is_file()]
    if missing:
        raise ModelLoadError(f"{p} is not a complete HF export (missing {', '.join(missing)}); "
                             "run paged.models.export_hf.export_hf(...)")
