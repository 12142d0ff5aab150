"""A step whose cache operations fail (swap-in never copied the host blocks back) must not
leave prefix-cache entries on the GPU blocks the swap-in allocated: those blocks hold no K/V
of the request, and a later prompt with the same prefix would attend over garbage."""
from __future__ import annotations

import pytest
import torch

from paged.engine.llm import LLM
from paged.engine.sampling import SamplingParams
from paged.errors import StepFailedError
from paged.models import load_model
from paged.models.testing import make_tiny_checkpoint

pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0.0, max_tokens=10)


class Boom(RuntimeError):
    pass


def test_failed_swap_in_leaves_no_cached_blocks_without_kv(tmp_path):
    model = load_model(make_tiny_checkpoint(tmp_path, "llama", num_heads=4, num_kv_heads=2))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (21, 17, 25, 19, 23)]
    roomy = LLM(model=model, num_blocks=256, block_size=4)
    reference = [o.outputs[0].token_ids for o in roomy.generate(prompts, GREEDY)]
    llm = LLM(model=model, num_blocks=14, block_size=4, preemption_mode="swap", max_num_batched_tokens=24)
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, GREEDY)
    apply = eng.runner.apply_cache_ops
    failed = []

    def flaky(plan):
        if plan.swap_in and not failed:
            failed.append(plan)
            raise Boom("injected cache-ops failure")
        return apply(plan)

    eng.runner.apply_cache_ops = flaky
    for _ in range(500):
        if not eng.has_unfinished_requests():
            break
        try:
            eng.step()
        except StepFailedError:
            kv = llm.kv_manager
            stale = [gpu for _, gpu in failed[0].swap_in
                     if kv.pool.blocks[gpu].block_hash is not None and kv.pool.lookup(kv.pool.blocks[gpu].block_hash)
                     is kv.pool.blocks[gpu]]
            assert not stale, f"blocks {stale} are cached but their swap-in never ran"
            kv.check_invariants()
    assert failed, "no step swapped in: the pool was meant to be too small"
    again = llm.generate(prompts, GREEDY)  # no prefix hit returns K/V the failed step never restored
    assert [o.outputs[0].token_ids for o in again] == reference
