"""The engine on the int4_kivi cache: staging slots are released as the manager frees
blocks, and swap preemption (an exact copy) does not change greedy outputs."""
from __future__ import annotations

import pytest
import torch

from paged.engine.llm import LLM
from paged.models import load_model
from paged.models.testing import make_tiny_checkpoint
from paged.engine.sampling import SamplingParams

pytest.importorskip("transformers")  # make_tiny_checkpoint writes the HF checkpoint with it


def _staging_in_use(llm: LLM) -> int:
    return sum(layer.staging.num_used for layer in llm.engine.runner.layers)


def test_int4_kivi_releases_staging_and_is_exact_under_swap(tmp_path):
    model = load_model(make_tiny_checkpoint(tmp_path, "llama", num_heads=4, num_kv_heads=2, head_dim=16))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 9, 14, 21, 6, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=20)
    common = dict(kv_cache_dtype="int4_kivi", block_size=4, enable_chunked_prefill=False,
                  max_num_batched_tokens=64, enable_prefix_caching=False)
    roomy = LLM(model=model, num_blocks=256, **common)
    tight = LLM(model=model, num_blocks=24, preemption_mode="swap", num_cpu_blocks=64, **common)
    ref = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    out = tight.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in out] == ref
    assert tight.engine.scheduler.num_preemptions["swap"] > 0, "the pool was meant to be too small"
    assert _staging_in_use(roomy) == 0 and _staging_in_use(tight) == 0
    assert tight.kv_manager.num_used_blocks == 0
    # n > 1 shares the prompt's blocks; copy-on-write of a staged partial block stays exact
    forked = roomy.generate([prompts[2]], SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=9))
    assert len(forked[0].outputs) == 3 and _staging_in_use(roomy) == 0


def test_int4_kivi_staging_grows_for_many_forks(tmp_path):
    """Forks for n > 1 are not bounded by max_num_seqs: n=30 with max_num_seqs=2 needs ~30
    unfilled blocks at once, more than the staging pool starts with; it grows, and all of it
    is released at the end."""
    model = load_model(make_tiny_checkpoint(tmp_path, "llama", num_heads=4, num_kv_heads=2, head_dim=16))
    llm = LLM(model=model, num_blocks=256, block_size=4, kv_cache_dtype="int4_kivi", max_num_seqs=2)
    start = llm.engine.runner.layers[0].staging.num_slots
    out = llm.generate([[1, 2, 3, 4, 5, 6], [7, 8, 9]], SamplingParams(n=30, temperature=1.0, seed=0, max_tokens=7))
    assert all(len(o.token_ids) == 7 for r in out for o in r.outputs) and len(out[1].outputs) == 30
    assert llm.engine.runner.layers[0].staging.num_slots > start
    assert _staging_in_use(llm) == 0 and llm.kv_manager.num_used_blocks == 0
