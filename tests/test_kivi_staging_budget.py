"""int4_kivi's staging pool (K of unfilled blocks in the model dtype) is counted inside
``kv_cache_memory_bytes`` and does not grow: the bytes allocated are what the budget allows."""
from __future__ import annotations

import pytest

from paged.engine.llm import LLM
from paged.engine.sampling import SamplingParams
from paged.models import load_model
from paged.models.testing import make_tiny_checkpoint

pytest.importorskip("transformers")  # make_tiny_checkpoint writes the HF checkpoint with it


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_checkpoint(tmp_path_factory.mktemp("k"), "llama", num_heads=4, num_kv_heads=2,
                                           head_dim=32))


@pytest.mark.parametrize("block_size, budget", [(4, 1 << 20), (16, 1 << 20), (256, 4 << 20), (16, 64 << 20)])
def test_cache_with_staging_fits_the_budget(model, block_size, budget):
    """Catches the staging pool allocated beside the budget (2.5-4.5x over it)."""
    llm = LLM(model=model, kv_cache_dtype="int4_kivi", block_size=block_size, kv_cache_memory_bytes=budget,
              max_num_seqs=8)
    runner = llm.engine.runner
    slots = runner.layers[0].staging.num_slots
    assert runner.cache_bytes() <= budget
    assert slots == min(llm.kv_manager.num_blocks, 8 + 16)
    out = llm.generate([[1, 2, 3, 4, 5], list(range(7, 30))], SamplingParams(temperature=0.0, max_tokens=6))
    assert all(len(o.outputs[0].token_ids) == 6 for o in out)
    assert runner.layers[0].staging.num_slots == slots and runner.cache_bytes() <= budget  # did not grow
    # the budget buys at least as many blocks as the explicit-num_blocks cache would hold in it
    fixed = LLM(model=model, kv_cache_dtype="int4_kivi", block_size=block_size, num_blocks=llm.kv_manager.num_blocks,
                max_num_seqs=8)
    assert [o.outputs[0].token_ids for o in fixed.generate([[1, 2, 3, 4, 5], list(range(7, 30))],
                                                           SamplingParams(temperature=0.0, max_tokens=6))] == \
        [o.outputs[0].token_ids for o in out]


def test_forks_beyond_the_fixed_staging_pool_are_a_clear_error(model):
    """A budget-sized pool does not grow: more forks than staging slots abort that step's
    requests with advice naming the knobs (the engine stays consistent and usable)."""
    from paged.errors import PagedError

    llm = LLM(model=model, kv_cache_dtype="int4_kivi", block_size=4, kv_cache_memory_bytes=1 << 20, max_num_seqs=2)
    assert llm.engine.runner.layers[0].staging.num_slots == 18
    with pytest.raises(PagedError, match="max_num_seqs"):
        llm.generate([[1, 2, 3, 4, 5, 6]], SamplingParams(n=30, temperature=1.0, seed=0, max_tokens=7))
    assert llm.kv_manager.num_used_blocks == 0
    assert len(llm.generate([[1, 2, 3]], SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=5))[0].outputs) == 4
