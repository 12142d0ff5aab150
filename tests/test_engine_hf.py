"""The engine on tiny random HF checkpoints: equality with transformers, invariance, sampling,
fork / beam search, bad input. CPU-cheap: 2-layer models, torch reference kernels."""
from __future__ import annotations

import pytest
import torch

from paged.core import events as ev
from paged.errors import ConfigError, InvalidRequestError, PagedError
from paged.telemetry import steps_frame
from paged.engine.llm import LLM
from paged.models import ModelLoadError, dense_logits, load_model
from paged.models.testing import make_tiny_checkpoint
from paged.engine.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def _prompts(seed: int, lengths, vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _hf_greedy(path: str, prompts, max_new: int) -> list[list[int]]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        with torch.no_grad():
            ids = hf.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False,
                              pad_token_id=0, eos_token_id=None)
        out.append(ids[0, len(p):].tolist())
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A Llama with GQA 4:2, loaded once; its HF greedy references for a few prompts."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama", num_heads=4, num_kv_heads=2)
    prompts = _prompts(0, (1, 5, 17, 33, 9, 40))
    return {"path": path, "model": load_model(path), "prompts": prompts,
            "ref": _hf_greedy(path, prompts, GREEDY.max_tokens)}


def _check_all_free(llm: LLM) -> None:
    kv = llm.kv_manager
    kv.check_invariants()
    assert kv.num_used_blocks == 0 and kv.num_free_cpu_blocks == kv.num_cpu_blocks
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("arch,nh,nkv,hd,tie", [
    ("llama", 8, 1, 8, False),     # MQA, head_dim 8
    ("qwen2", 4, 2, 16, True),     # q/k/v bias, tied embeddings
    ("mistral", 6, 3, 32, False),  # GQA 2:1, head_dim 32
])
def test_greedy_equals_transformers(tmp_path, arch, nh, nkv, hd, tie):
    path = make_tiny_checkpoint(tmp_path, arch, num_heads=nh, num_kv_heads=nkv, head_dim=hd,
                                hidden_size=48 if nh == 6 else 64, tie_word_embeddings=tie)
    prompts = _prompts(1, (3, 11, 26))
    llm = LLM(path, num_blocks=48, block_size=8, device="cpu")
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == _hf_greedy(path, prompts, GREEDY.max_tokens)
    _check_all_free(llm)


def test_greedy_equals_transformers_batched_with_prefix_hits(tiny):
    llm = LLM(tiny["model"], num_blocks=64, block_size=4)
    outs = llm.generate(tiny["prompts"], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == tiny["ref"]
    # the same prompts again hit the prefix cache and give the same tokens
    again = llm.generate(tiny["prompts"], GREEDY)
    assert [o.outputs[0].token_ids for o in again] == tiny["ref"]
    assert sum(o.num_cached_tokens for o in again) > 0
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    _check_all_free(llm)


@pytest.mark.parametrize("kw", [
    dict(enable_prefix_caching=False),
    dict(max_num_batched_tokens=7),                                      # chunked prefill
    dict(enable_chunked_prefill=False, max_num_batched_tokens=128),
    dict(num_blocks=20, preemption_mode="recompute"),                    # memory pressure
    dict(num_blocks=20, preemption_mode="swap", num_cpu_blocks=40),
    dict(num_blocks=20, preemption_mode="swap", num_cpu_blocks=4),       # swap falls back to recompute
    dict(max_num_seqs=2, block_size=16),
    dict(split_prefill_decode=True),
])
def test_invariance(tiny, kw):
    base = dict(num_blocks=64, block_size=4)
    llm = LLM(tiny["model"], **{**base, **kw})
    # two rounds: the second reuses cached prefixes
    for _ in range(2):
        outs = llm.generate(tiny["prompts"], GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == tiny["ref"]
    if "preemption_mode" in kw:
        assert sum(llm.engine.scheduler.num_preemptions.values()) > 0
        if kw.get("num_cpu_blocks") == 40:
            assert llm.engine.scheduler.num_preemptions["swap"] > 0
    _check_all_free(llm)


def test_memory_budget_sizes_the_pool(tiny):
    cfg = tiny["model"].config  # 2 layers x 2 kv heads x head_dim 32, float32: 512 B per token
    per_block = cfg.num_layers * 4 * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    llm = LLM(tiny["model"], block_size=4, kv_cache_memory_bytes=10 * per_block + 7)
    assert llm.kv_manager.num_blocks == 10
    assert llm.engine.runner.cache_bytes() == 10 * per_block
    half = LLM(tiny["model"], block_size=4, kv_cache_memory_bytes=10 * per_block, kv_cache_dtype="fp8_e4m3")
    assert half.kv_manager.num_blocks == 40  # 1 byte per value instead of 4


def test_quantized_kv_formats_run(tiny):
    for fmt in ("int8", "fp8_e5m2", "fp8_e4m3", "int4"):
        llm = LLM(tiny["model"], num_blocks=64, block_size=4, kv_cache_dtype=fmt)
        outs = llm.generate(tiny["prompts"][:3], GREEDY)
        first = [o.outputs[0].token_ids[0] for o in outs]
        if fmt == "int8":
            assert first == [r[0] for r in tiny["ref"][:3]]
        assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outs)
        _check_all_free(llm)


def test_sampling_seeds_topk_topp(tiny):
    llm = LLM(tiny["model"], num_blocks=64, block_size=4)
    p = tiny["prompts"][2]
    sp = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=12)
    a = llm.generate([p], sp)[0].outputs[0].token_ids
    # same seed, different batch company: same tokens
    b = llm.generate([tiny["prompts"][0], p, tiny["prompts"][3]],
                     [SamplingParams(temperature=1.0, max_tokens=5), sp, GREEDY])[1].outputs[0].token_ids
    assert a == b
    c = llm.generate([p], SamplingParams(temperature=0.8, top_p=0.9, seed=8, max_tokens=12))[0]
    assert c.outputs[0].token_ids != a
    top1 = llm.generate([p], SamplingParams(temperature=1.0, top_k=1, seed=3, max_tokens=24))[0]
    assert top1.outputs[0].token_ids == tiny["ref"][2]
    tiny_p = llm.generate([p], SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=24))[0]
    assert tiny_p.outputs[0].token_ids == tiny["ref"][2]
    _check_all_free(llm)


def test_stop_tokens(tiny):
    llm = LLM(tiny["model"], num_blocks=64, block_size=4)
    ref = tiny["ref"][3]
    stop = ref[5]
    out = llm.generate([tiny["prompts"][3]], SamplingParams(temperature=0, max_tokens=24,
                                                            stop_token_ids=[stop]))[0].outputs[0]
    assert out.token_ids == ref[:ref.index(stop) + 1] and out.finish_reason == "stop"


def test_parallel_sampling_forks_and_shares_blocks(tiny):
    llm = LLM(tiny["model"], num_blocks=64, block_size=4)
    p = tiny["prompts"][4]
    mark = len(llm.engine.recorder)
    out = llm.generate([p], SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=10))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 10 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    kinds = [e.kind for e in llm.engine.recorder.since(mark)]
    assert kinds.count(ev.FORK) == 3 and kinds.count(ev.COW) >= 1  # 9-token prompt: partial block shared
    again = llm.generate([p], SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=10))[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]
    greedy = llm.generate([p], SamplingParams(n=3, temperature=0, max_tokens=24))[0]
    assert all(o.token_ids == tiny["ref"][4] for o in greedy.outputs)
    _check_all_free(llm)


def _reference_beam(model, prompt, width, max_tokens):
    """Plain beam search on dense logits (no cache): n finished-or-max-length beams."""
    beams = [(0.0, [])]
    for _ in range(max_tokens):
        cands = []
        for score, toks in beams:
            lp = torch.log_softmax(dense_logits(model, [prompt + toks])[0][-1], -1)
            top = torch.topk(lp, 2 * width + 1)
            cands += [(score + float(v), toks + [int(t)]) for v, t in zip(top.values, top.indices)]
        cands.sort(key=lambda c: -c[0])
        beams = cands[:width]
    return sorted(beams, key=lambda b: -b[0] / len(b[1]))


def test_beam_search_matches_reference_and_uses_cow(tiny):
    llm = LLM(tiny["model"], num_blocks=64, block_size=4)
    p = tiny["prompts"][2]
    one = llm.generate([p], SamplingParams(n=1, use_beam_search=True, max_tokens=24))[0]
    assert one.outputs[0].token_ids == tiny["ref"][2]
    mark = len(llm.engine.recorder)
    out = llm.generate([p], SamplingParams(n=3, use_beam_search=True, max_tokens=8))[0]
    ref = _reference_beam(tiny["model"].model, p, 3, 8)
    assert [o.token_ids for o in out.outputs] == [t for _, t in ref]
    for o, (score, _) in zip(out.outputs, ref):
        assert o.cumulative_logprob == pytest.approx(score, abs=1e-3)
    kinds = [e.kind for e in llm.engine.recorder.since(mark)]
    assert ev.FORK in kinds and ev.COW in kinds
    _check_all_free(llm)


def test_step_api_and_abort(tiny):
    llm = LLM(tiny["model"], num_blocks=64, block_size=4, max_num_batched_tokens=16)
    eng = llm.engine
    eng.add_request("a", tiny["prompts"][3], GREEDY)
    eng.add_request("b", tiny["prompts"][5], GREEDY)
    s1 = eng.step()
    assert s1.step == 1 and s1.num_prefill_tokens == 16 and s1.num_decode_tokens == 0
    assert [c.request_id for c in s1.scheduled] == ["a"] and s1.new_tokens == {}
    assert any(e.kind == ev.ALLOCATE for e in s1.events) and s1.forward_s > 0
    assert eng.kv_manager.block_table("a")
    steps = [eng.step() for _ in range(4)]
    assert any(s.num_decode_tokens and s.num_prefill_tokens for s in steps)  # mixed batch
    aborted = eng.abort("b")
    assert aborted.outputs[0].finish_reason == "abort"
    assert not eng.kv_manager.has("b")
    finished = []
    while eng.has_unfinished_requests():
        finished += eng.step().finished
    assert [f.request_id for f in finished] == ["a"] and finished[0].outputs[0].token_ids == tiny["ref"][3]
    df = steps_frame([s1, *steps])
    assert list(df["step"]) == [1, 2, 3, 4, 5] and df["num_prefill_tokens"].iloc[0] == 16
    _check_all_free(llm)


def test_bad_input_keeps_engine_serving(tiny):
    llm = LLM(tiny["model"], num_blocks=64, block_size=4, max_model_len=64)
    eng = llm.engine
    eng.add_request("good", tiny["prompts"][2], GREEDY)
    eng.step()
    bad = [
        ([], GREEDY),
        (list(range(65)), GREEDY),
        (tiny["prompts"][1], SamplingParams(max_tokens=0)),
        (tiny["prompts"][1], SamplingParams(n=0)),
        (tiny["prompts"][1], SamplingParams(top_p=0.0)),
        (tiny["prompts"][1], SamplingParams(top_p=1.5)),
        (tiny["prompts"][1], SamplingParams(temperature=-1)),
        (tiny["prompts"][1], SamplingParams(stop_token_ids=5)),
        ([1, 2, 999], GREEDY),                       # token id outside the vocabulary
        ("text prompt", GREEDY),                      # this checkpoint has no tokenizer
        (tiny["prompts"][1], SamplingParams(max_tokens=60)),  # prompt + max_tokens > max_model_len
    ]
    for i, (prompt, sp) in enumerate(bad):
        with pytest.raises(InvalidRequestError):
            eng.add_request(f"bad{i}", prompt, sp)
    with pytest.raises(PagedError):
        eng.add_request("good", tiny["prompts"][1], GREEDY)  # duplicate id
    with pytest.raises(InvalidRequestError):  # generate validates everything before queuing
        llm.generate([tiny["prompts"][0], []], GREEDY)
    with pytest.raises(ModelLoadError):
        LLM("definitely/not/a/model")
    with pytest.raises(ConfigError):
        LLM(tiny["model"], num_blocks=8, kv_cache_dtype="fp7")
    with pytest.raises(ConfigError):
        LLM(tiny["model"], kv_cache_memory_bytes=100)  # less than one block
    with pytest.raises(ConfigError, match="unknown backend"):  # was a KernelError in the first step
        LLM(tiny["model"], num_blocks=8, attention_backend="bogus")
    out = []
    while eng.has_unfinished_requests():
        out += eng.step().finished
    assert [o.outputs[0].token_ids for o in out] == [tiny["ref"][2]]
    _check_all_free(llm)


def test_triton_kernels_in_the_interpreter_give_the_same_tokens(tiny):
    """The engine on our Triton kernels (run by Triton's interpreter on CPU): same greedy tokens."""
    pytest.importorskip("triton")
    from kernels.backend import interpreter_enabled
    if not interpreter_enabled():
        pytest.skip("TRITON_INTERPRET=1 was not set before kernels loaded")
    prompts = [tiny["prompts"][1], tiny["prompts"][2][:13]]
    sp = SamplingParams(temperature=0, max_tokens=6)
    ref = [o.outputs[0].token_ids for o in LLM(tiny["model"], num_blocks=32, block_size=4).generate(prompts, sp)]
    llm = LLM(tiny["model"], num_blocks=32, block_size=4, attention_backend="interpreter",
              max_num_batched_tokens=8)  # chunked prefill, mixed and decode-only batches
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == ref
    _check_all_free(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_fork_and_beams_under_memory_pressure(tiny, mode):
    """n > 1 and beam search keep working (and free everything) when preemption strikes."""
    llm = LLM(tiny["model"], num_blocks=24, block_size=4, preemption_mode=mode)
    ps = tiny["prompts"][1:5]
    outs = llm.generate(ps, SamplingParams(n=3, temperature=0, max_tokens=24))
    for o, ref in zip(outs, tiny["ref"][1:5]):
        assert [c.token_ids for c in o.outputs] == [ref] * 3
    assert sum(llm.engine.scheduler.num_preemptions.values()) > 0
    beams = llm.generate(ps, SamplingParams(n=2, use_beam_search=True, max_tokens=12))
    assert all(len(o.outputs) == 2 and all(len(c.token_ids) == 12 for c in o.outputs) for o in beams)
    _check_all_free(llm)


def test_parallel_sampling_children_get_max_tokens_and_report_first_tokens(tiny):
    """Every sample of n > 1 gets max_tokens tokens (children were cut one short when the
    parent's first token was counted twice), and the fork step reports each sample's token."""
    llm = LLM(tiny["model"], num_blocks=64, block_size=4)
    p = tiny["prompts"][4]
    for max_tokens in (2, 3):
        out = llm.generate([p], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=max_tokens))[0]
        assert [len(o.token_ids) for o in out.outputs] == [max_tokens] * 3
        assert all(o.finish_reason == "length" for o in out.outputs)
    eng = llm.engine
    eng.add_request("x", p, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4))
    first = eng.step().new_tokens
    assert set(first) == {"x", "x#1", "x#2"}
    while eng.has_unfinished_requests():
        done = eng.step().finished
    outs = done[0].outputs
    assert sorted(first.values()) == sorted(o.token_ids[0] for o in outs)
    _check_all_free(llm)


def test_reserved_request_ids_and_non_integer_tokens_are_rejected(tiny):
    """'#' is reserved for forked sequences: a user id 'y#1' would collide with the child of
    'y' (n=2) in the middle of a step. Token ids must be integers, not 1.7 or '5'."""
    llm = LLM(tiny["model"], num_blocks=64, block_size=4)
    eng = llm.engine
    for i, bad in enumerate(([1.7, 2], ["3", "4"], 5, None)):
        with pytest.raises(InvalidRequestError):
            eng.add_request(f"bad{i}", bad, GREEDY)
    with pytest.raises(InvalidRequestError, match="reserve"):
        eng.add_request("y#1", tiny["prompts"][1], GREEDY)
    eng.add_request("y", tiny["prompts"][2], SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=6))
    eng.add_request("z", tiny["prompts"][1], GREEDY)
    out = {}
    while eng.has_unfinished_requests():
        out.update({o.request_id: o for o in eng.step().finished})
    assert len(out["y"].outputs) == 2 and out["z"].outputs[0].token_ids == tiny["ref"][1]
    _check_all_free(llm)


def test_skip_special_tokens_reaches_the_tokenizer(tiny):
    import dataclasses

    class Echo:  # decodes to the flag it was given
        eos_token_id = None

        def decode(self, ids, skip_special_tokens=True):
            return f"skip={skip_special_tokens}"

    llm = LLM(dataclasses.replace(tiny["model"], tokenizer=Echo()), num_blocks=16, block_size=4)
    p = tiny["prompts"][1]
    assert llm.generate([p], SamplingParams(max_tokens=2))[0].outputs[0].text == "skip=True"
    keep = SamplingParams(max_tokens=2, skip_special_tokens=False)
    assert llm.generate([p], keep)[0].outputs[0].text == "skip=False"


def test_device_and_dtype_errors(tiny):
    with pytest.raises(ConfigError, match="device"):
        LLM(tiny["path"], device="bogus")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            LLM(tiny["path"], device="cuda")
    with pytest.raises(ConfigError, match="already loaded"):  # was silently ignored
        LLM(tiny["model"], dtype="float16")
    with pytest.raises(ConfigError):  # "already loaded on cpu" (or "CUDA is not available")
        LLM(tiny["model"], device="cuda")
    with pytest.raises(ConfigError, match="not supported"):
        LLM(tiny["path"], dtype=torch.float64)
    assert LLM(tiny["model"], num_blocks=8, block_size=4, device="cpu", dtype="float32").engine.dtype == torch.float32


def test_abort_of_beam_search_returns_every_live_beam(tiny):
    llm = LLM(tiny["model"], num_blocks=64, block_size=4)
    eng = llm.engine
    eng.add_request("b", tiny["prompts"][3], SamplingParams(n=3, use_beam_search=True, max_tokens=20))
    steps = [eng.step() for _ in range(3)]
    assert [len(s.new_tokens) for s in steps] == [3, 3, 3]  # forked beams report their first token
    out = eng.abort("b")
    assert len(out.outputs) == 3 and all(o.finish_reason == "abort" for o in out.outputs)
    assert all(len(o.token_ids) == 3 for o in out.outputs)  # prefill + 2 decode steps
    _check_all_free(llm)


def test_interrupted_generate_leaves_no_orphans(tiny):
    """A KeyboardInterrupt (or an on_step error) inside generate used to leave its requests
    queued: they held blocks and were silently computed by the next generate call."""
    llm = LLM(tiny["model"], num_blocks=64, block_size=4)

    def interrupt(step):
        if step.step == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        llm.generate(tiny["prompts"][:3], GREEDY, on_step=interrupt)
    _check_all_free(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(tiny["prompts"][:2], GREEDY)] == tiny["ref"][:2]
    import numpy as np  # one prompt of numpy ints is one prompt, not one prompt per token
    assert llm.generate(np.array(tiny["prompts"][1]), GREEDY)[0].outputs[0].token_ids == tiny["ref"][1]


def test_split_prefill_decode_under_preemption_with_identical_samples(tiny):
    """Identical greedy samples readmitted after recompute preemption hit blocks that a sibling's
    prefill writes in the same step, with one token left: a decode-sized chunk. Run in the
    decode pass before the prefill pass, it read unwritten K/V and changed the tokens."""
    llm = LLM(tiny["model"], num_blocks=20, block_size=4, split_prefill_decode=True)
    outs = llm.generate(tiny["prompts"][1:5], SamplingParams(n=3, temperature=0, max_tokens=24))
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[r] * 3 for r in tiny["ref"][1:5]]
    assert llm.engine.scheduler.num_preemptions["recompute"] > 0
    _check_all_free(llm)


def test_non_integer_priority_is_rejected_before_queueing(tiny):
    """A str priority used to be registered by the scheduler and then fail the heap push:
    the request was neither waiting nor rejected, and the engine could not finish."""
    llm = LLM(tiny["model"], num_blocks=64, block_size=4, policy="priority")
    eng = llm.engine
    eng.add_request("a", tiny["prompts"][1], GREEDY, priority=1)
    with pytest.raises(InvalidRequestError, match="priority"):
        eng.add_request("b", tiny["prompts"][2], GREEDY, priority="high")
    out = []
    while eng.has_unfinished_requests():
        out += eng.step().finished
    assert [o.request_id for o in out] == ["a"] and out[0].outputs[0].token_ids == tiny["ref"][1]
    _check_all_free(llm)


def test_params_changed_after_add_request_do_not_affect_it(tiny):
    llm = LLM(tiny["model"], num_blocks=64, block_size=4)
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=24)
    eng.add_request("a", tiny["prompts"][2], sp)
    sp.max_tokens, sp.temperature = 3, 1.0  # reused for the next request
    eng.add_request("b", tiny["prompts"][2], sp)
    out = {}
    while eng.has_unfinished_requests():
        out.update({o.request_id: o for o in eng.step().finished})
    assert out["a"].outputs[0].token_ids == tiny["ref"][2] and len(out["b"].outputs[0].token_ids) == 3


def test_abort_while_swapped_frees_cpu_blocks_and_others_finish(tiny):
    llm = LLM(tiny["model"], num_blocks=20, block_size=4, preemption_mode="swap", num_cpu_blocks=40)
    eng = llm.engine
    for i, p in enumerate(tiny["prompts"]):
        eng.add_request(str(i), p, GREEDY)
    out, aborted = {}, None
    while eng.has_unfinished_requests():
        out.update({o.request_id: o for o in eng.step().finished})
        if aborted is None and eng.scheduler.swapped:
            aborted = eng.scheduler.swapped[0].request_id
            assert eng.abort(aborted).outputs[0].finish_reason == "abort"
            assert not eng.kv_manager.is_swapped(aborted)
    assert aborted is not None, "the pool was meant to force a swap"
    assert {k: o.outputs[0].token_ids for k, o in out.items()} == {
        str(i): r for i, r in enumerate(tiny["ref"]) if str(i) != aborted}
    _check_all_free(llm)


def test_abort_from_on_step_is_a_clear_error(tiny):
    """Aborting one of generate's own requests from on_step used to spin until the misleading
    'no progress ... raise num_blocks' error once the others had finished."""
    llm = LLM(tiny["model"], num_blocks=64, block_size=4)
    with pytest.raises(PagedError, match="aborted inside generate"):
        llm.generate(tiny["prompts"][:2], GREEDY, on_step=lambda s: s.step == 2 and llm.engine.abort("gen-1"))
    _check_all_free(llm)
