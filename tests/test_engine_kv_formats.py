"""Quantized KV formats in the engine: logits stay within a per-format bound of the
full-precision cache, and int4_kivi forks equal independent requests token for token.

Logits are compared step by step for as long as the greedy tokens agree (the contexts
are then identical; the step where they part is still compared). The error is the RMS
of the logit difference over the RMS of the reference logits, per request; the bound is
on its mean over 4 requests (and twice that on the worst one). Measured on this model
(CPU, torch kernels), mean (max): int8 0.0083 (0.011), fp8_e4m3 0.041 (0.051), fp8_e5m2
0.081 (0.104), int4 0.120 (0.145), int4_kivi 0.101 (0.128); an int8 scale twice too large
gives 0.0176 (0.024).
"""
from __future__ import annotations

import pytest
import torch

from paged.engine.llm import LLM
from paged.engine.sampling import SamplingParams
from paged.models import load_model
from paged.models.testing import make_tiny_checkpoint

pytest.importorskip("transformers")  # make_tiny_checkpoint writes the HF checkpoint with it

BOUNDS = {"int8": 0.012, "fp8_e4m3": 0.06, "fp8_e5m2": 0.11, "int4": 0.16, "int4_kivi": 0.14}  # mean


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_checkpoint(tmp_path_factory.mktemp("q"), "llama", num_heads=4, num_kv_heads=2,
                                           head_dim=32))


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 17, 33, 9)]


def _run(model, prompts, fmt: str, max_tokens: int = 12):
    """Greedy tokens and the logits of every sampled row, per request."""
    llm = LLM(model=model, num_blocks=64, block_size=4, kv_cache_dtype=fmt, max_num_batched_tokens=16)
    rows: dict[str, list[torch.Tensor]] = {}
    forward = llm.engine.runner.forward

    def recording(chunks):
        r = forward(chunks)
        for rid, row in zip(r.sample_ids, r.logits):
            rows.setdefault(rid, []).append(row.float().clone())
        return r

    llm.engine.runner.forward = recording
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    assert llm.kv_manager.num_used_blocks == 0
    return [o.outputs[0].token_ids for o in outs], [torch.stack(rows[o.request_id]) for o in outs]


@pytest.fixture(scope="module")
def reference(model, prompts):
    return _run(model, prompts, "auto")


def _errors(reference, got) -> list[float]:
    errs = []
    for ref_toks, ref, toks, out in zip(*reference, *got):
        same = next((i for i, (a, b) in enumerate(zip(ref_toks, toks)) if a != b), len(ref_toks))
        k = min(same + 1, len(ref))
        errs.append(float((out[:k] - ref[:k]).square().mean().sqrt() / ref[:k].square().mean().sqrt()))
    return errs


@pytest.mark.parametrize("fmt", sorted(BOUNDS))
def test_logit_error_against_the_full_precision_cache(model, prompts, reference, fmt):
    """Catches an int8 scale twice too large (mean error 0.0176 > 0.012) and any format
    whose cache is written or read wrongly (errors of order 1)."""
    errs = _errors(reference, _run(model, prompts, fmt))
    assert sum(errs) / len(errs) <= BOUNDS[fmt] and max(errs) <= 2 * BOUNDS[fmt], (fmt, errs)
    assert min(errs) > 0, "a quantized cache that is exact was not quantized"


def test_more_mantissa_bits_mean_smaller_errors(model, prompts, reference):
    fmts = ("int8", "fp8_e4m3", "fp8_e5m2")
    mean = {f: sum(_errors(reference, _run(model, prompts, f))) / len(prompts) for f in fmts}
    assert mean["int8"] < mean["fp8_e4m3"] < mean["fp8_e5m2"], mean


def test_int4_kivi_forks_equal_independent_requests(model):
    """Greedy n=3 forks share the prompt's blocks (the last one partial and staged) and
    copy it on their first write; each must produce exactly the tokens of an independent
    request with the same prompt. Catches skipping the block copies (the forks then read
    another block's K/V)."""
    common = dict(model=model, num_blocks=64, block_size=4, kv_cache_dtype="int4_kivi", enable_prefix_caching=False)
    g = torch.Generator().manual_seed(3)
    for n_prompt in (6, 14):
        prompt = torch.randint(0, 256, (n_prompt,), generator=g).tolist()
        forked = LLM(**common).generate([prompt], SamplingParams(n=3, temperature=0.0, max_tokens=9))[0]
        alone = LLM(**common).generate([prompt] * 3, SamplingParams(temperature=0.0, max_tokens=9))
        assert [o.token_ids for o in forked.outputs] == [a.outputs[0].token_ids for a in alone]
