"""A failing forward pass (OOM, a kernel error, Ctrl-C inside the model) leaves the engine
consistent: exactly the requests of that step are aborted (their blocks freed, the blocks
they were computing dropped from the prefix cache), the error names them, and every other
request still finishes with its reference tokens."""
from __future__ import annotations

import random

import pytest
import torch

from paged.engine.llm import LLM
from paged.engine.sampling import SamplingParams
from paged.errors import PagedError, StepFailedError
from paged.models import load_model
from paged.models.testing import make_tiny_checkpoint

pytest.importorskip("transformers")  # make_tiny_checkpoint writes the HF checkpoint with it

GREEDY = SamplingParams(temperature=0.0, max_tokens=10)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_checkpoint(tmp_path_factory.mktemp("f"), "llama", num_heads=4, num_kv_heads=2))


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(4)
    system = torch.randint(0, 256, (9,), generator=g).tolist()  # shared: prefix hits on blocks of failed steps
    return [system + torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 12, 1, 20, 7, 15, 5, 9)]


@pytest.fixture(scope="module")
def reference(model, prompts):
    roomy = LLM(model=model, num_blocks=256, block_size=4)
    return {i: o.outputs[0].token_ids for i, o in enumerate(roomy.generate(prompts, GREEDY))}


def _check(llm: LLM) -> None:
    kv = llm.kv_manager
    kv.check_invariants()
    live = sum(len(kv.block_table(r)) for r in llm.engine.scheduler.requests if kv.has(r) and not kv.is_swapped(r))
    assert kv.num_used_blocks <= live


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("mode, exc, seed", [("recompute", Boom, 0), ("swap", Boom, 1),
                                             ("recompute", KeyboardInterrupt, 2), ("swap", torch.cuda.OutOfMemoryError, 3)])
def test_a_failing_forward_pass_aborts_exactly_that_steps_requests(model, prompts, reference, mode, exc, seed):
    """Catches a step that raises with its plan scheduled but never applied (blocks leak,
    the next step reschedules tokens that were never computed, and blocks registered in
    the prefix cache during the failed step hold garbage K/V that later requests hit)."""
    rng = random.Random(seed)
    llm = LLM(model=model, num_blocks=14, block_size=4, preemption_mode=mode, max_num_batched_tokens=24)
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, GREEDY)
    fail_at = {1 + seed % 2, rng.randrange(3, 12), rng.randrange(12, 25)}  # step 1 or 2: the shared prefix
    forward = eng.runner.forward
    calls = {"n": 0}

    def flaky(chunks, *a, **k):
        calls["n"] += 1
        if calls["n"] in fail_at:
            raise exc("injected failure")
        return forward(chunks, *a, **k)

    eng.runner.forward = flaky
    done, aborted, failures = {}, set(), 0
    for _ in range(500):
        if not eng.has_unfinished_requests():
            break
        try:
            out = eng.step()
        except (StepFailedError, KeyboardInterrupt) as e:
            failures += 1
            err = e if isinstance(e, StepFailedError) else e.__context__
            assert isinstance(err, StepFailedError), e
            assert err.request_ids and "injected failure" in str(err)
            assert not any(eng.has_request(r) for r in err.request_ids)
            aborted.update(err.request_ids)
            _check(llm)
            for rid in err.request_ids:  # resubmitted at once: prefix hits on what the failed step cached
                if not rid.startswith("again-"):
                    eng.add_request(f"again-{rid}", prompts[int(rid)], GREEDY)
            continue
        done.update({o.request_id: o.outputs[0].token_ids for o in out.finished})
        _check(llm)
    assert failures == len(fail_at)
    originals = {r for r in set(done) | aborted if not r.startswith("again-")}
    assert aborted and originals == {str(i) for i in range(len(prompts))} and not set(done) & aborted
    assert any(r.startswith("again-") for r in done)
    assert llm.engine.scheduler.num_preemptions[mode] > 0, "the pool was meant to be too small"
    for rid, toks in done.items():
        assert toks == reference[int(rid.removeprefix("again-"))], rid
    kv = llm.kv_manager
    assert kv.num_used_blocks == 0 and kv.num_free_cpu_blocks == kv.num_cpu_blocks
    kv.check_invariants()
    # the engine is still usable, and no cached block from a failed step poisons a prefix hit
    again = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in again] == [reference[i] for i in range(len(prompts))]


def test_step_failed_error_is_a_paged_error():
    assert issubclass(StepFailedError, PagedError)
