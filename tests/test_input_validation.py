"""Bad input to SamplingParams / LLM / generate: one clear PagedError before any work.

One rule for types: integers are `numbers.Integral` but not `bool` (numpy integers work
everywhere), flags are `bool`, real numbers are finite `numbers.Real` but not `bool`.
Engine settings are checked before the model is loaded.
"""
from __future__ import annotations

import numpy as np
import pytest

from paged.engine import llm as llm_module
from paged.engine.llm import LLM
from paged.engine.sampling import SamplingParams
from paged.errors import ConfigError, InvalidRequestError, ModelLoadError, PagedError
from paged.models import load_model
from paged.models.testing import make_tiny_checkpoint

pytest.importorskip("transformers")  # make_tiny_checkpoint writes the HF checkpoint with it

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("v"), "llama", num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def llm(path):
    return LLM(load_model(path), num_blocks=32, block_size=4)


def _clean(llm: LLM) -> None:
    kv = llm.kv_manager
    kv.check_invariants()
    assert kv.num_used_blocks == 0 and not llm.engine.has_unfinished_requests()


# ---- item 1 and 11: SamplingParams -------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("skip_special_tokens", "no"), ("skip_special_tokens", 1), ("ignore_eos", "yes"), ("ignore_eos", 0),
    ("use_beam_search", "true"), ("length_penalty", "x"), ("length_penalty", float("nan")),
    ("length_penalty", float("inf")), ("length_penalty", True), ("temperature", True), ("temperature", float("nan")),
    ("top_p", True), ("top_p", float("nan")), ("n", True), ("max_tokens", True), ("max_tokens", 2.0),
    ("top_k", True), ("seed", True), ("seed", "x"), ("stop_token_ids", [True]), ("stop_token_ids", [1.0]),
])
def test_bad_sampling_fields_are_rejected_at_add_request(llm, field, value):
    """Catches `skip_special_tokens="no"` / `length_penalty="x"` accepted by add_request and
    failing in `step()` at finish (where the other requests finished in that step vanished)."""
    params = SamplingParams(temperature=0.0, max_tokens=3, n=2 if field == "length_penalty" else 1,
                            use_beam_search=field == "length_penalty")
    setattr(params, field, value)
    with pytest.raises(InvalidRequestError, match=field):
        params.validate()
    with pytest.raises(InvalidRequestError, match=field):
        llm.engine.add_request("bad", [1, 2, 3], params)
    assert not llm.engine.has_request("bad")
    _clean(llm)


def test_numpy_integers_work_wherever_integers_do(llm):
    sp = SamplingParams(temperature=1.0, seed=np.int64(3), max_tokens=np.int32(5), top_k=np.int64(4),
                        n=np.int64(1), stop_token_ids=[np.int64(300)])
    ref = SamplingParams(temperature=1.0, seed=3, max_tokens=5, top_k=4, stop_token_ids=[300])
    a = llm.generate([[1, 2, 3]], sp)[0].outputs[0].token_ids
    b = llm.generate([[1, 2, 3]], ref)[0].outputs[0].token_ids
    assert a == b and len(a) == 5
    _clean(llm)


@pytest.mark.parametrize("priority", [True, 1.5, "1", None])
def test_priority_must_be_an_integer(llm, priority):
    with pytest.raises(InvalidRequestError, match="priority"):
        llm.engine.add_request("p", [1, 2], GREEDY, priority=priority)
    llm.engine.add_request("p", [1, 2], GREEDY, priority=np.int64(2))
    llm.engine.abort("p")
    _clean(llm)


# ---- item 1: step() is safe -------------------------------------------------------------
def test_an_error_finishing_one_request_keeps_the_others(llm, monkeypatch):
    """Whatever goes wrong while building one finished request's output (here: detokenizing
    raises), the others finished in the same step are returned, the failing one is reported
    and no block is left behind. Catches `step()` losing every output of the step."""
    eng = llm.engine
    for rid in ("a", "b", "c"):
        eng.add_request(rid, [1, 2, 3 + len(rid)], SamplingParams(temperature=0.0, max_tokens=2))
    real = eng._text

    def broken(toks, params):
        if params.max_tokens == 2 and broken.calls == 1:
            broken.calls += 1
            raise RuntimeError("detokenizer exploded")
        broken.calls += 1
        return real(toks, params)
    broken.calls = 0
    monkeypatch.setattr(eng._groups, "_detokenize", broken)
    finished, errors = {}, []
    for _ in range(10):
        try:
            out = eng.step()
        except PagedError as e:
            errors.append(e)
            out = e.step_output
        finished.update({o.request_id: o for o in out.finished})
        if not eng.has_unfinished_requests():
            break
    assert len(errors) == 1 and "detokenizer exploded" in str(errors[0])
    failed = errors[0].request_ids
    assert len(failed) == 1 and set(finished) | set(failed) == {"a", "b", "c"}
    assert all(len(o.outputs[0].token_ids) == 2 for o in finished.values())
    _clean(llm)


# ---- item 7: LLM(...) settings, checked before the model is loaded ------------------------
@pytest.mark.parametrize("kw, match", [
    (dict(block_size=0), "block_size"), (dict(block_size="16"), "block_size"), (dict(block_size=True), "block_size"),
    (dict(kv_cache_memory_bytes="1GB"), "kv_cache_memory_bytes"),
    (dict(kv_cache_memory_bytes=-5), "kv_cache_memory_bytes"),
    (dict(max_model_len="100"), "max_model_len"), (dict(max_model_len=0), "max_model_len"),
    (dict(sampling_seed="x"), "sampling_seed"), (dict(sampling_seed=1.5), "sampling_seed"), (dict(num_blocks="10"), "num_blocks"),
    (dict(num_blocks=2.5), "num_blocks"), (dict(num_blocks=0), "num_blocks"),
    (dict(enable_prefix_caching="no"), "enable_prefix_caching"),
    (dict(enable_chunked_prefill=1), "enable_chunked_prefill"),
    (dict(max_num_seqs=True), "max_num_seqs"), (dict(max_num_batched_tokens="8"), "max_num_batched_tokens"),
    (dict(num_cpu_blocks=-1), "num_cpu_blocks"), (dict(watermark="0.1"), "watermark"),
    (dict(watermark=float("nan")), "watermark"), (dict(record_events="yes"), "record_events"),
    (dict(split_prefill_decode="no"), "split_prefill_decode"),
])
def test_bad_engine_settings_fail_before_loading_the_model(path, monkeypatch, kw, match):
    """Catches ZeroDivisionError (block_size=0), TypeErrors (strings), a torch RuntimeError
    after loading (sampling_seed='x') and self-contradicting messages (num_blocks='10')."""
    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the settings were checked")
    monkeypatch.setattr(llm_module, "load_model", no_load)
    with pytest.raises(ConfigError, match=match) as e:
        LLM(path, **kw)
    assert repr(kw[match]) in str(e.value) or str(kw[match]) in str(e.value)


def test_numpy_integer_settings_work(path):
    llm = LLM(path, num_blocks=np.int64(16), block_size=np.int64(4), sampling_seed=np.int64(1), max_model_len=np.int32(32))
    assert llm.kv_manager.num_blocks == 16 and llm.engine.max_model_len == 32
    assert len(llm.generate([[1, 2, 3]], GREEDY)[0].outputs[0].token_ids) == 4


def test_a_pool_too_large_to_allocate_says_how_much_memory_it_needs(path):
    """Catches the raw allocation failure of num_blocks=10**12."""
    with pytest.raises(ConfigError, match=r"num_blocks=1000000000000 .*(GiB|TiB)"):
        LLM(path, num_blocks=10**12, block_size=16)


# ---- item 8: generate() inputs and model files -------------------------------------------
@pytest.mark.parametrize("prompts", [None, 5, {"a": 1}, b"hello", [b"hello"], [None], [[1, "2"]], [1.5], [[True, 2]]])
def test_bad_prompts_are_an_invalid_request(llm, prompts):
    """Catches `KeyError: 0` for a dict and bytes silently taken as token ids."""
    with pytest.raises(InvalidRequestError, match="prompt"):
        llm.generate(prompts, GREEDY)
    _clean(llm)


@pytest.mark.parametrize("params", [{"temperature": 0.0}, "greedy", [{"max_tokens": 2}]])
def test_sampling_params_must_be_sampling_params(llm, params):
    with pytest.raises(InvalidRequestError, match="SamplingParams"):
        llm.generate([[1, 2, 3]], params)
    _clean(llm)


def test_corrupt_weight_files_are_a_model_load_error(path, tmp_path):
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    for f in bad.glob("*.safetensors"):
        f.write_bytes(b"\x00" * 7 + b"not safetensors")
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLM(str(bad))
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40)
    with pytest.raises(ModelLoadError, match="fake.gguf"):
        LLM(str(fake))
    fake.write_bytes(b"hello, not a gguf")
    with pytest.raises(ModelLoadError, match="fake.gguf"):
        LLM(str(fake))


def test_generate_keeps_the_others_when_one_output_cannot_be_built(llm, monkeypatch):
    """Through generate() the whole batch was lost after all the compute."""
    real = llm.engine._groups._detokenize
    monkeypatch.setattr(llm.engine._groups, "_detokenize",
                        lambda toks, p: (_ for _ in ()).throw(RuntimeError("bad text")) if p.max_tokens == 3
                        else real(toks, p))
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in (2, 3, 4)]
    with pytest.raises(PagedError, match="bad text") as e:
        llm.generate([[1, 2], [3, 4], [5, 6]], params)
    outs = e.value.outputs
    assert outs[1] is None and [len(outs[i].outputs[0].token_ids) for i in (0, 2)] == [2, 4]
    _clean(llm)


def test_a_request_larger_than_the_pool_names_the_pool(path):
    """LLM(num_blocks=8, block_size=4) said 'raise max_model_len' when the pool was the limit."""
    small = LLM(path, num_blocks=8, block_size=4)
    with pytest.raises(InvalidRequestError, match="num_blocks") as e:
        small.generate([list(range(1, 30))], GREEDY)
    assert "max_model_len" not in str(e.value)
    _clean(small)
