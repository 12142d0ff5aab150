"""The embedded SmolLM2-135M (4-bit Q4_1 weights in the GGUF, dequantized to float32).

Perplexity on our own English paragraph catches a wrong Q/K un-permutation (correct:
~2.75 nats; without un-permuting: ~4.7). The transformers oracle loads the same GGUF.
"""
from __future__ import annotations

import os

import pytest
import torch

from paged.models import dense_logits, embedded_gguf_path, load_model, mean_nll
from paged.models.testing import SMOLLM2_PROMPTS

PARAGRAPH = (
    "The library opens at nine in the morning and closes at six in the evening. "
    "Most visitors come to read newspapers, borrow books, or use the computers on the second floor. "
    "On weekends the children's room is busy, because parents bring their kids to story time. "
    "The librarians are friendly and will help you find what you are looking for. "
    "If you want to borrow a book, you need a library card, which is free for everyone who lives "
    "in the city.")
PROMPTS = SMOLLM2_PROMPTS


@pytest.fixture(scope="module")
def smol(smollm2):
    return smollm2  # loaded once per session (conftest)


def test_config_and_perplexity(smol):
    cfg = smol.config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    assert "Q4_1" in smol.weight_format
    ids = smol.tokenizer.encode(PARAGRAPH)
    assert len(ids) == 93
    nll = mean_nll(smol.model, ids)
    assert 2.0 < nll < 3.3, nll  # wrong Q/K permutation gives ~4.7


def test_matches_transformers_on_same_gguf(smol):
    """Our paged engine's greedy tokens are transformers' greedy tokens on the same GGUF, and
    our dense logits match its logits. Greedy decoding picks the argmax of the logits of its
    own output, so one teacher-forced transformers pass over prompt + our tokens checks
    token-for-token equality with ``hf.generate`` (which cost 32 incremental steps per prompt)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to read GGUF files
    from paged.engine.llm import LLM
    from paged.engine.sampling import SamplingParams
    p = embedded_gguf_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(p), gguf_file=os.path.basename(p), dtype=torch.float32).eval()
    engine = LLM(smol, num_blocks=32, block_size=16, max_num_batched_tokens=8)  # chunked prefill
    paged_out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for prompt, got in zip(PROMPTS, paged_out):
        new = got.outputs[0].token_ids
        assert len(new) == 32
        out = prompt + new
        with torch.no_grad():
            ref = hf(torch.tensor([out])).logits[0].float()
        assert ref[len(prompt) - 1:-1].argmax(-1).tolist() == new  # transformers' greedy, token for token
        # teacher-forced: our argmax at every position must equal transformers' greedy token
        ours = dense_logits(smol.model, [out])[0]
        assert ours[len(prompt) - 1:-1].argmax(-1).tolist() == new
        err = (ours - ref).abs().max().item()
        assert err < 1e-3, err  # measured ~6e-5 (float32, logits up to ~35)
