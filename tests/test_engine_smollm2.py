"""The engine on the embedded SmolLM2-135M-Instruct (GGUF weights 4-bit Q4_1, dequantized).

Our paged engine's first 32 greedy tokens must equal the argmax of the cache-free dense
model fed the same sequence (teacher forcing), and its logits must match the dense logits;
the dense model itself is checked against transformers in test_model_smollm2.py.
"""
from __future__ import annotations

import pytest
import torch

from paged.engine.llm import LLM
from paged.models import dense_logits
from paged.models.testing import SMOLLM2_PROMPTS
from paged.engine.sampling import SamplingParams

PROMPTS = SMOLLM2_PROMPTS


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", num_blocks=64, block_size=16, max_num_batched_tokens=16)


def test_greedy_tokens_and_logits_match_dense(llm):
    captured: list[tuple[list[str], torch.Tensor]] = []
    forward = llm.engine.runner.forward

    def spy(chunks):
        r = forward(chunks)
        captured.append((r.sample_ids, r.logits.clone()))
        return r
    llm.engine.runner.forward = spy
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    finally:
        llm.engine.runner.forward = forward
    worst = 0.0
    for o, prompt in zip(outs, PROMPTS):
        toks = o.outputs[0].token_ids
        assert len(toks) == 32
        ref = dense_logits(llm.loaded.model, [prompt + toks])[0]
        assert ref[len(prompt) - 1:-1].argmax(-1).tolist() == toks
        rows = [lg[i] for ids, lg in captured for i, rid in enumerate(ids) if rid == o.request_id]
        assert len(rows) == 32
        ours = torch.stack(rows)
        worst = max(worst, (ours - ref[len(prompt) - 1:-1]).abs().max().item())
    print(f"max |logit diff| paged vs dense: {worst:.2e}")
    assert worst < 1e-3, worst
    assert llm.kv_manager.num_used_blocks == 0


def test_text_prompt_through_the_tokenizer(llm):
    tok = llm.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = llm.generate(chat, SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop" and out.token_ids[-1] == tok.eos_token_id
