"""The embedded SmolLM2 written as an HF directory (paged.models.export_hf) loads back to the
same tensors, tokenizes the same and gives greedy outputs identical to the GGUF it came from."""
from __future__ import annotations

import json

import pytest
import torch

from paged.errors import ConfigError, ModelLoadError
from paged.models import load_model
from paged.models.export_hf import check_export, export_hf, hf_state_dict


@pytest.fixture(scope="module")
def exported(smollm2, tmp_path_factory):
    return export_hf(smollm2, tmp_path_factory.mktemp("export") / "smollm2-hf")


def test_export_round_trips_tensors_and_tokenizer(smollm2, exported):
    check_export(exported)
    back = load_model(str(exported))
    assert back.config.num_layers == smollm2.config.num_layers
    assert back.config.tie_word_embeddings and back.model.lm_head is None
    a, b = hf_state_dict(smollm2), hf_state_dict(back)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    text = "<|im_start|>user\nWhat is 12345 + 678?<|im_end|>\n<|im_start|>assistant\n"
    assert back.tokenizer.encode(text) == smollm2.tokenizer.encode(text)
    assert back.tokenizer.eos_token_id == smollm2.tokenizer.eos_token_id == 2
    cfg = json.loads((exported / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["torch_dtype"] == "float32"


def test_greedy_outputs_identical_gguf_vs_export(smollm2, exported):
    from paged import LLM, SamplingParams
    prompts = [smollm2.tokenizer.encode(p) for p in ("The capital of France is", "def fibonacci(n):",
                                                       "Paged attention stores the KV cache in")]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in LLM(smollm2, num_blocks=64, block_size=32).generate(prompts, sp)]
    back = [o.outputs[0].token_ids for o in LLM(str(exported), num_blocks=64, block_size=32).generate(prompts, sp)]
    assert ours == back


def test_export_is_cached_and_refuses_foreign_directories(smollm2, exported, tmp_path):
    before = (exported / "model.safetensors").stat().st_mtime_ns
    assert export_hf(smollm2, exported) == exported  # same source and dtype: reused
    assert (exported / "model.safetensors").stat().st_mtime_ns == before
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not an export"):
        export_hf(smollm2, foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"
    with pytest.raises(ModelLoadError, match="missing"):
        check_export(foreign)
