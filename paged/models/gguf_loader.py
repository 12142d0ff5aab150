"""Load llama-architecture GGUF files (the embedded SmolLM2-135M and local files).

Quantized tensors (Q4_0/Q4_1/Q8_0/K-quants ...) are dequantized with
``gguf.quants.dequantize`` to float32 and then cast to the compute dtype. The
activations therefore come from the *dequantized* weights: for the embedded
SmolLM2 file most matrices are 4-bit (Q4_1) in the file, the embedding is Q8_0.

GGUF (llama.cpp's converter) stores the Q and K projections with the rows of each
head permuted for *interleaved* RoPE (pairs ``(2i, 2i+1)``); our model uses the
rotate-half convention (pairs ``(i, i + head_dim/2)``), so ``unpermute_qk`` undoes it.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from paged.errors import ModelLoadError
from .config import ModelConfig

SUPPORTED_GGUF_ARCHITECTURES = ("llama",)

_LAYER_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_MAP = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's ``reshape(n_head, 2, hd/2, in).swapaxes(1, 2)``:
    rows ``[h, i, pair]`` (interleaved) -> ``[h, pair, i]`` (rotate-half)."""
    out, *rest = w.shape
    hd = out // n_head
    return w.reshape(n_head, hd // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v


def read_metadata(reader: Any) -> dict[str, Any]:
    """All scalar/string metadata (token arrays excluded) as a plain dict."""
    out: dict[str, Any] = {}
    for k in reader.fields:
        if k.startswith("tokenizer.ggml.") and k.split(".")[-1] in ("tokens", "merges", "token_type", "scores"):
            continue
        try:
            out[k] = reader.fields[k].contents()
        except Exception:  # noqa: BLE001 - metadata we cannot decode is just skipped
            pass
    return out


def gguf_config(reader: Any, name: str = "") -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported; supported: {SUPPORTED_GGUF_ARCHITECTURES}")
    a = arch

    def req(key: str) -> Any:
        v = _field(reader, f"{a}.{key}")
        if v is None:
            raise ModelLoadError(f"GGUF file lacks metadata {a}.{key}")
        return v

    hidden = int(req("embedding_length"))
    n_head = int(req("attention.head_count"))
    n_kv = int(_field(reader, f"{a}.attention.head_count_kv", n_head))
    head_dim = int(_field(reader, f"{a}.attention.key_length", hidden // n_head))
    emb = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if emb is None:
        raise ModelLoadError("GGUF file lacks tensor token_embd.weight")
    vocab = int(_field(reader, f"{a}.vocab_size", int(emb.shape[1])))
    scaling = None
    st = _field(reader, f"{a}.rope.scaling.type")
    if st == "linear":
        scaling = {"rope_type": "linear", "factor": float(req("rope.scaling.factor"))}
    elif st not in (None, "none"):
        raise ModelLoadError(f"GGUF rope scaling {st!r} is not supported (linear, llama3 via rope_freqs)")
    names = {t.name for t in reader.tensors}
    freq_factors = None
    if "rope_freqs.weight" in names:
        t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        freq_factors = tuple(float(x) for x in np.asarray(t.data, dtype=np.float32).reshape(-1))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    return ModelConfig(
        vocab_size=vocab, hidden_size=hidden,
        intermediate_size=int(req("feed_forward_length")),
        num_layers=int(req("block_count")), num_heads=n_head, num_kv_heads=n_kv,
        head_dim=head_dim,
        rms_norm_eps=float(_field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, f"{a}.rope.freq_base", 10000.0)),
        rope_scaling=scaling, rope_freq_factors=freq_factors,
        qkv_bias="blk.0.attn_q.bias" in names,
        tie_word_embeddings="output.weight" not in names,
        max_position_embeddings=int(_field(reader, f"{a}.context_length", 2048)),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
        architecture=str(arch), name=name or str(_field(reader, "general.name", "")),
    )


def _dequantize(t: Any) -> np.ndarray:
    from gguf.quants import dequantize
    arr = dequantize(t.data, t.tensor_type)
    shape = tuple(int(x) for x in reversed(list(t.shape)))  # GGUF ne0 is the fastest axis
    arr = np.asarray(arr, dtype=np.float32).reshape(shape)
    return arr if arr.flags.writeable else arr.copy()


def gguf_weights(reader: Any, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF-named float32 tensors with Q/K rows un-permuted."""
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        if t.name in _GLOBAL_MAP:
            hf = _GLOBAL_MAP[t.name]
        elif t.name.startswith("blk."):
            _, idx, rest = t.name.split(".", 2)
            if rest not in _LAYER_MAP:
                raise ModelLoadError(f"GGUF tensor {t.name!r} has no counterpart in the llama model")
            hf = f"layers.{idx}.{_LAYER_MAP[rest]}"
        else:
            raise ModelLoadError(f"GGUF tensor {t.name!r} has no counterpart in the llama model")
        w = torch.from_numpy(_dequantize(t))
        if rest_is(t.name, "attn_q."):
            w = unpermute_qk(w, cfg.num_heads)
        elif rest_is(t.name, "attn_k."):
            w = unpermute_qk(w, cfg.num_kv_heads)
        out[hf] = w
    return out


def rest_is(name: str, prefix: str) -> bool:
    return name.startswith("blk.") and name.split(".", 2)[2].startswith(prefix)


def open_gguf(path: str | os.PathLike[str]) -> Any:
    from gguf import GGUFReader
    if not os.path.isfile(path):
        raise ModelLoadError(f"GGUF file {os.fspath(path)!r} does not exist")
    return GGUFReader(os.fspath(path))
