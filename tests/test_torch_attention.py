"""The planned torch attention path (paged/engine/torch_attention.py) computes what the kernels'
reference path computes, for every unquantized cache dtype: in particular a fresh prompt attends
over its K/V *as the cache stores it* (an fp16 cache under an fp32 model is not an fp32 cache)."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from paged.engine import LLM, SamplingParams  # noqa: E402
from paged.models.testing import make_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama")


def _prompt_logprobs(path, kv_cache_dtype: str, planned: bool) -> torch.Tensor:
    llm = LLM(path, device="cpu", kv_cache_dtype=kv_cache_dtype, num_blocks=64, block_size=8,
              enable_prefix_caching=False, max_num_batched_tokens=24)  # chunks after cached context too
    llm.engine.runner.planned = planned
    prompts = [list(range(3, 40)), list(range(50, 60))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=0))
    # prompt_logprobs=0: one {token: logprob} per prompt position after the first
    return torch.tensor([next(iter(d.values())) for o in outs for d in o.prompt_logprobs[1:]])


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "bf16"])
def test_planned_path_matches_reference(tiny, fmt):
    ref = _prompt_logprobs(tiny, fmt, planned=False)
    got = _prompt_logprobs(tiny, fmt, planned=True)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=0)

