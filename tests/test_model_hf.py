"""Our model against transformers on tiny random HF checkpoints (dense path, no cache)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from paged.models import ModelLoadError, dense_logits, load_model
from paged.models.testing import make_tiny_checkpoint

transformers = pytest.importorskip("transformers")

CASES = [
    # arch, heads, kv heads, head_dim, tie, rope scaling
    ("llama", 4, 2, None, False, None),
    ("llama", 8, 1, 8, True, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    ("llama", 4, 4, 32, False, {"rope_type": "linear", "factor": 2.0}),
    ("qwen2", 4, 2, None, True, None),
    ("mistral", 8, 2, 16, False, None),
]


@pytest.mark.parametrize("arch,nh,nkv,hd,tie,scaling", CASES)
def test_dense_logits_match_transformers(tmp_path, arch, nh, nkv, hd, tie, scaling):
    path = make_tiny_checkpoint(tmp_path / arch, arch, num_heads=nh, num_kv_heads=nkv, head_dim=hd,
                                tie_word_embeddings=tie, rope_scaling=scaling, rope_theta=5000.0)
    ours = load_model(path)
    assert ours.config.architecture == arch
    assert ours.config.qkv_bias == (arch == "qwen2")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 7, 40)]
    got = dense_logits(ours.model, seqs)
    for seq, lg in zip(seqs, got):
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0].float()
        torch.testing.assert_close(lg, ref, atol=2e-4, rtol=1e-4)


def test_bad_paths_and_architectures(tmp_path):
    with pytest.raises(ModelLoadError, match="smollm2"):
        load_model("no-such-model-anywhere")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="llama"):
        load_model(tmp_path)
    empty = tmp_path / "empty"
    os.makedirs(empty)
    with pytest.raises(ModelLoadError):
        load_model(empty)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(ModelLoadError, match="lacks num_attention_heads"):  # was a bare KeyError
        load_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read"):
        load_model(tmp_path)


def test_config_edge_cases(tmp_path):
    from paged.models.hf_loader import hf_config
    base = {"model_type": "mistral", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "max_position_embeddings": 4096, "sliding_window": 64, "rope_theta": 1e6,
            "rope_scaling": {"type": "linear", "factor": 2.0}}
    (tmp_path / "config.json").write_text(json.dumps(base))
    cfg, max_len = hf_config(str(tmp_path))
    assert max_len == 64  # attention is exact only within the sliding window
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling == {"type": "linear", "factor": 2.0, "rope_type": "linear"}
    (tmp_path / "config.json").write_text(json.dumps({**base, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}))
    with pytest.raises(ModelLoadError, match="llama3"):
        hf_config(str(tmp_path))


def test_rope_tables_grow_once_per_forward(tmp_path, monkeypatch):
    """Positions beyond the initial RoPE table still work, and the table check (a host sync
    on a GPU) runs once per forward pass instead of once per layer."""
    from paged.models.llama import LlamaForCausalLM
    from paged.models.rope import RotaryEmbedding
    path = make_tiny_checkpoint(tmp_path, "llama", num_layers=3, hidden_size=32, intermediate_size=64,
                                num_heads=2, num_kv_heads=1)
    loaded = load_model(path)
    cfg = loaded.config
    from paged.models.hf_loader import hf_weights
    small = LlamaForCausalLM.from_weights(cfg, hf_weights(path), max_positions=4)
    calls = []
    real = RotaryEmbedding.ensure
    monkeypatch.setattr(RotaryEmbedding, "ensure", lambda self, pos: (calls.append(1), real(self, pos))[1])
    ids = list(range(1, 40))
    got = dense_logits(small, [ids])[0]
    assert len(calls) == 1 and small.rope.cos.shape[0] >= len(ids)
    torch.testing.assert_close(got, dense_logits(loaded.model, [ids])[0])
