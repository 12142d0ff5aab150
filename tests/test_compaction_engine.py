"""Block compaction on the real engine path (tiny random Llama): greedy outputs are identical with
compaction on and off (fp32 and int4_kivi caches, shared prefixes, n > 1, preemption; SmolLM2 once),
the copies show in the step records of both executors, a failed pass aborts exactly the requests it
moved, and nothing leaks."""
from __future__ import annotations

import pytest
import torch

from paged import telemetry
from paged.engine.llm import LLM
from paged.engine.sampling import SamplingParams
from paged.models import load_model
from paged.models.testing import make_tiny_checkpoint

pytest.importorskip("transformers")  # make_tiny_checkpoint writes the HF checkpoint with it

ON = dict(enable_block_compaction=True, compaction_threshold=0.0, compaction_interval=1)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama", num_heads=4, num_kv_heads=2,
                                           head_dim=16))


def _prompts():
    g = torch.Generator().manual_seed(3)
    system = torch.randint(0, 256, (9,), generator=g).tolist()
    return [(system if i % 2 else []) + torch.randint(0, 256, (n,), generator=g).tolist()
            for i, n in enumerate((3, 9, 14, 21, 6, 30, 5, 11))]


def _run(model, compaction: bool, **kw):
    llm = LLM(model=model, block_size=4, max_num_batched_tokens=48, **(ON if compaction else {}), **kw)
    greedy = llm.generate(_prompts(), SamplingParams(temperature=0.0, max_tokens=18))
    sampled = llm.generate([_prompts()[3]], SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=10))
    kv = llm.kv_manager
    assert kv.num_used_blocks == 0
    kv.check_invariants()
    return [o.outputs[0].token_ids for o in greedy] + [o.token_ids for o in sampled[0].outputs], llm


@pytest.mark.parametrize("kw", [dict(num_blocks=40), dict(num_blocks=36, preemption_mode="swap", num_cpu_blocks=64),
                                dict(num_blocks=36, preemption_mode="swap", num_cpu_blocks=64, swap_mode="overlap"),
                                dict(num_blocks=40, kv_cache_dtype="int4_kivi")],
                         ids=["fp32", "swap", "swap-overlap", "int4_kivi"])
def test_greedy_outputs_identical_with_compaction_on_and_off(model, kw):
    off, _ = _run(model, False, **kw)
    on, llm = _run(model, True, **kw)
    assert on == off
    assert llm.kv_manager.num_compaction_copies > 0, "compaction was meant to run"
    if llm.engine.runner.staged:
        assert sum(layer.staging.num_used for layer in llm.engine.runner.layers) == 0


def test_step_records_carry_compaction_copies(model):
    llm = LLM(model=model, block_size=4, num_blocks=40, max_num_batched_tokens=48, **ON)
    engine = llm.engine
    for i, p in enumerate(_prompts()):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=12))
    rows = []
    while engine.has_unfinished_requests():
        out = engine.step()
        rows.append(out.to_row())
        assert sum(e.kind == "compact" for e in out.events) == out.num_compaction_copies
    frame = telemetry.steps_frame(rows)
    assert list(frame.columns) == list(telemetry.STEP_COLUMNS)
    assert frame["num_compaction_copies"].sum() == llm.kv_manager.num_compaction_copies > 0


def test_simulator_runs_compaction_and_charges_the_copies():
    from paged.sim.simulator import SimConfig, simulate
    import pandas as pd
    trace = pd.DataFrame([dict(arrival_time=0.0, prompt_tokens=40 + 13 * i, output_tokens=60) for i in range(24)])
    off = simulate(trace, SimConfig(model="llama-2-7b", num_blocks=400))
    on = simulate(trace, SimConfig(model="llama-2-7b", num_blocks=400, **ON))
    assert list(on.steps.columns)[:len(telemetry.STEP_COLUMNS)] == list(telemetry.STEP_COLUMNS)
    assert on.steps["num_compaction_copies"].sum() > 0 and off.steps["num_compaction_copies"].sum() == 0
    assert len(on.steps) == len(off.steps)                      # same schedule (no arrival depends on time)
    assert on.steps["step_time_s"].sum() > off.steps["step_time_s"].sum()  # the copies cost HBM time


def test_smollm2_greedy_outputs_identical_with_compaction(smollm2):
    system = "You are a helpful assistant. Answer briefly.\n"
    prompts = [system + q for q in ("What is the capital of France?", "Why is the sky blue?")]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = []
    for on in (False, True):
        llm = LLM(model=smollm2, block_size=2, num_blocks=96, **(ON if on else {}))
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        assert llm.kv_manager.num_used_blocks == 0
    assert outs[0] == outs[1] and llm.kv_manager.num_compaction_copies > 0


def test_failed_compaction_copies_abort_the_moved_requests_and_drop_their_prefix_entries(model):
    """A step whose cache ops fail never applied its compaction copies: the requests whose blocks
    moved are aborted, the moved blocks lose their prefix entries, the rest keep running."""
    from paged.errors import StepFailedError
    params = SamplingParams(temperature=0.0, max_tokens=18)
    roomy = LLM(model=model, block_size=4, num_blocks=80)
    reference = [o.outputs[0].token_ids for o in roomy.generate(_prompts(), params)]
    llm = LLM(model=model, block_size=4, num_blocks=40, max_num_batched_tokens=48, **ON)
    eng = llm.engine
    for i, p in enumerate(_prompts()):
        eng.add_request(str(i), p, params)
    apply, failed = eng.runner.apply_cache_ops, []

    def flaky(plan):
        if plan.compaction_copies and not failed:
            failed.append(plan)
            raise RuntimeError("injected cache-ops failure")
        return apply(plan)

    eng.runner.apply_cache_ops = flaky
    while eng.has_unfinished_requests():
        try:
            eng.step()
        except StepFailedError:
            kv = llm.kv_manager
            moved = [kv.pool.blocks[d] for _, d in failed[0].compaction_copies]
            assert not [b for b in moved if b.block_hash is not None and kv.pool.lookup(b.block_hash) is b]
            assert not any(kv.has(r.request_id) and set(kv.block_table(r.request_id)) & {b.block_id for b in moved}
                           for r in eng.scheduler.running)
            kv.check_invariants()
    assert failed
    assert llm.kv_manager.num_used_blocks == 0
    again = llm.generate(_prompts(), params)  # no prefix hit reads K/V the failed step never moved
    assert [o.outputs[0].token_ids for o in again] == reference


def test_compaction_with_the_host_tier_stays_lossless(model):
    """Compaction copies run before the host tier's copies (tier_out reads cached-free blocks, which
    compaction never moves): waves of shared prefixes are demoted and brought back either way."""
    import random
    rng = random.Random(0)
    pre = [[rng.randrange(256) for _ in range(12)] for _ in range(4)]
    waves = [[0, 1, 2], [3, 0, 1], [2, 3, 0], [1, 2, 3]]
    prompts = [[pre[p] + [rng.randrange(256) for _ in range(rng.randrange(1, 6))] for p in w] for w in waves]
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    runs = []
    for on in (False, True):
        llm = LLM(model=model, block_size=4, num_blocks=24, max_num_seqs=3, enable_host_tier=True, num_cpu_blocks=16,
                  **(ON if on else {}))
        runs.append([[o.outputs[0].token_ids for o in llm.generate(w, params)] for w in prompts])
        kv = llm.kv_manager
        kv.check_invariants()
        assert kv.num_used_blocks == 0 and kv.host.num_tier_in_blocks > 0
    assert runs[0] == runs[1] and kv.num_compaction_copies > 0
