"""A local llama-architecture GGUF written here from a tiny HF model (Q/K permuted the way
llama.cpp's converter does, matrices stored as Q8_0 and F16) loads back to the same model."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from paged.models import ModelLoadError, dense_logits, load_model
from paged.models.gguf_loader import unpermute_qk
from paged.models.testing import make_tiny_checkpoint

gguf = pytest.importorskip("gguf")


def interleave_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's permutation (rotate-half rows -> interleaved pairs), written independently."""
    out = w.shape[0]
    hd = out // n_head
    heads = w.reshape(n_head, 2, hd // 2, *w.shape[1:])
    return np.swapaxes(heads, 1, 2).reshape(w.shape)


def write_gguf(path, hf_dir, qtype, rope_freqs=None) -> None:
    from safetensors.numpy import load_file
    import json
    cfg = json.load(open(f"{hf_dir}/config.json"))
    w = load_file(f"{hf_dir}/model.safetensors")
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    wr = gguf.GGUFWriter(str(path), "llama")
    wr.add_block_count(cfg["num_hidden_layers"])
    wr.add_context_length(cfg["max_position_embeddings"])
    wr.add_embedding_length(cfg["hidden_size"])
    wr.add_feed_forward_length(cfg["intermediate_size"])
    wr.add_head_count(nh)
    wr.add_head_count_kv(nkv)
    wr.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    wr.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    wr.add_rope_dimension_count(cfg["hidden_size"] // nh)

    def put(name, arr):
        arr = arr.astype(np.float32)
        if arr.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            q = gguf.quants.quantize(arr, qtype)
            wr.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
        else:
            wr.add_tensor(name, arr)
    if rope_freqs is not None:  # llama3 scaling as llama.cpp stores it: per-dimension divisors
        wr.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    put("token_embd.weight", w["model.embed_tokens.weight"])
    put("output_norm.weight", w["model.norm.weight"])
    put("output.weight", w["lm_head.weight"])
    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
             "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_q.weight", interleave_qk(w[p + "self_attn.q_proj.weight"], nh))
        put(f"blk.{i}.attn_k.weight", interleave_qk(w[p + "self_attn.k_proj.weight"], nkv))
        for g, h in names.items():
            put(f"blk.{i}.{g}.weight", w[p + h + ".weight"])
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    back = unpermute_qk(torch.from_numpy(interleave_qk(w, 3)), 3).numpy()
    np.testing.assert_array_equal(back, w)


@pytest.mark.parametrize("qtype,tol", [("F32", 1e-4), ("F16", 2e-2), ("Q8_0", 0.1)])
def test_local_gguf_matches_hf_checkpoint(tmp_path, qtype, tol):
    hf_dir = make_tiny_checkpoint(tmp_path / "hf", "llama", num_heads=4, num_kv_heads=2, hidden_size=64)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf_dir, getattr(gguf.GGMLQuantizationType, qtype))
    ours = load_model(path)
    assert ours.tokenizer is None and ours.weight_format.startswith("gguf:")
    ref = load_model(hf_dir)
    seq = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    a = dense_logits(ours.model, [seq])[0]
    b = dense_logits(ref.model, [seq])[0]
    assert (a - b).abs().max().item() < tol
    if qtype == "F32":
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_unsupported_gguf_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    wr = gguf.GGUFWriter(str(path), "gpt2")
    wr.add_block_count(1)
    wr.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    with pytest.raises(ModelLoadError, match="llama"):
        load_model(path)


def test_llama3_rope_freqs_tensor(tmp_path):
    """GGUF stores llama3 rope scaling as ``rope_freqs.weight``; it must match HF's llama3 rope."""
    from dataclasses import replace

    from paged.models.rope import inverse_frequencies
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    hf_dir = make_tiny_checkpoint(tmp_path / "hf", "llama", num_heads=4, num_kv_heads=2, rope_scaling=scaling)
    ref = load_model(hf_dir)
    plain = inverse_frequencies(replace(ref.config, rope_scaling=None))
    factors = (plain / inverse_frequencies(ref.config)).numpy()
    assert factors.max() > 7.9 and factors.min() < 2.0  # scaled low, smoothed mid frequencies
    path = tmp_path / "llama3.gguf"
    write_gguf(path, hf_dir, gguf.GGMLQuantizationType.F32, rope_freqs=factors)
    ours = load_model(path)
    assert ours.config.rope_freq_factors is not None
    seq = list(range(3, 60))
    torch.testing.assert_close(dense_logits(ours.model, [seq])[0], dense_logits(ref.model, [seq])[0],
                               atol=1e-4, rtol=1e-4)
