"""Split KV formats served by the engine: the study's cache reproduces the engine (prompt
log-probs), greedy outputs against fp32, the cache stays in its byte budget, swap preemption and
block compaction keep outputs, the Triton kernels drive the engine, and bad input (names,
geometry, calibration artefacts, prefix caching) is a clear error."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import kernels
from paged.engine.llm import LLM
from paged.engine.sampling import SamplingParams
from paged.errors import ConfigError
from paged.quant import chunk_nll, load_texts, make_chunks
from paged.quant.artefact import ENV, fit, for_model
from paged.quant.calibration import collect
from paged.quant.runs import chunk_logits
from paged.quant.split_cache import FRONT, SplitCache, served_bits, tables_for


@pytest.fixture(scope="module")
def ids(smollm2):
    return smollm2.tokenizer.encode(load_texts(["kjv"])["kjv"][:6000], add_special_tokens=False)


def _llm(smol, fmt, **kw):
    return LLM(smol, **{**dict(num_blocks=40, block_size=32, kv_cache_dtype=fmt, max_num_batched_tokens=2048,
                               enable_prefix_caching=False), **kw})


def _study_nll(smol, fmt, chunk, n):
    art = for_model(smol.model, kernels.get_format(fmt), 32) if kernels.get_format(fmt).calibrated else None
    cache = SplitCache(fmt, smol.model, tables_for(fmt, smol.model, art, 32), 32)
    lg = chunk_logits(smol.model, chunk.ids, cache, slice(n // 2, n - 1))
    return (-torch.log_softmax(lg, -1)[torch.arange(lg.shape[0]), torch.tensor(chunk.ids[n // 2 + 1:])]).numpy()


@pytest.mark.parametrize("alias", sorted(FRONT))
def test_front_formats_store_and_attend_what_the_study_measured(smollm2, ids, alias):
    """Prompt NLL through the engine == the study's SplitCache (measured: bit-identical), on a
    150-token prompt: sealed and unsealed KIVI blocks, the sink and a retiring window; and the
    format's bytes per token are the study's bits (codes, scales, zeros, block-spread side tensors)."""
    fmt = kernels.get_format(alias)
    n = 150
    chunk = make_chunks({"kjv": ids[:n]}, smollm2.tokenizer, n, max_chunks=1)[0]
    engine = chunk_nll(_llm(smollm2, alias), [chunk])[0]
    assert np.abs(_study_nll(smollm2, alias, chunk, n) - engine).max() < 1e-4
    h, d = smollm2.config.num_kv_heads, smollm2.config.head_dim
    kb, vb, _ = served_bits(fmt, 32, h, d, context=1 << 40)  # no staging: per-token bytes only
    assert abs(kernels.bytes_per_token(fmt, h, d, block_size=32) - (kb + vb) * h * d / 8) < 1


KVQ25 = "kivi2.5+pre+alloc+q8/cb2+rot@sink4@win32"  # kvq2 with half a bit more per key on average


def test_a_fractional_key_mean_is_served_as_the_study_measures_it(smollm2, ids):
    """kivi2.5: the shipped artefact's widths hold 160 bits per head row (2.5 x 64: 20 bytes), the
    engine's prompt NLL is the study's, and the format costs kvq2's bytes plus 4 per token-head
    (20 - 16 B of K codes), i.e. half a bit more on the K side."""
    fmt, h, d = kernels.get_format(KVQ25), smollm2.config.num_kv_heads, smollm2.config.head_dim
    widths = for_model(smollm2.model, fmt, 32).entries["k:kivi2.5+pre+alloc+q8@bs32"]
    assert widths.shape == (30, h, d) and set(widths.long().sum(-1).flatten().tolist()) == {160}
    assert int(widths.min()) >= 0 and int(widths.max()) <= 8 and len(set(widths.flatten().tolist())) > 2
    n = 150
    chunk = make_chunks({"kjv": ids[:n]}, smollm2.tokenizer, n, max_chunks=1)[0]
    engine = chunk_nll(_llm(smollm2, KVQ25), [chunk])[0]
    assert np.abs(_study_nll(smollm2, KVQ25, chunk, n) - engine).max() < 1e-4
    kvq2 = kernels.bytes_per_token("kvq2", h, d, block_size=32)
    assert kernels.bytes_per_token(fmt, h, d, block_size=32) == kvq2 + 4 * h
    kb, vb, _ = served_bits(fmt, 32, h, d, context=2048)
    kb2, vb2, _ = served_bits("kvq2", 32, h, d, context=2048)
    assert (kb - kb2, vb) == (0.5, vb2)


def test_greedy_outputs_against_fp32(smollm2, ids):
    """First divergence from fp32's greedy continuation on 3 prompts (see docs/quant.md for the
    measured table): the 4.9-bit format keeps at least 8 tokens on every prompt; the 2.9-bit one
    diverges earlier on average than the 4.9-bit one."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [ids[i:i + 96] for i in (0, 500, 1000)]
    ref = [o.outputs[0].token_ids for o in LLM(smollm2, num_blocks=40, block_size=32).generate(prompts, params)]

    def first_div(alias):
        out = [o.outputs[0].token_ids for o in _llm(smollm2, alias).generate(prompts, params)]
        return [next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), len(r)) for r, o in zip(ref, out)]

    hi, lo = first_div("kvq4"), first_div("kvq2")
    assert min(hi) >= 8, hi
    assert np.mean(hi) >= np.mean(lo), (hi, lo)


def test_cache_bytes_stay_within_the_budget(smollm2):
    budget = 24 << 20
    llm = LLM(smollm2, kv_cache_memory_bytes=budget, block_size=32, kv_cache_dtype="kvq3", enable_prefix_caching=False,
              max_num_seqs=8)
    used = llm.engine.runner.cache_bytes()
    assert 0.8 * budget < used <= budget, (used, budget)
    out = llm.generate([[1, 2, 3] * 40] * 8, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 40 for o in out)
    assert llm.engine.runner.cache_bytes() == used  # the pools were sized in the budget: nothing grew


def _tiny(tmp_path, monkeypatch, formats):
    """A tiny model and a calibration artefact fitted on it (random tokens), set as the one to use."""
    pytest.importorskip("transformers")
    from paged.models import load_model
    from paged.models.testing import make_tiny_checkpoint
    lm = load_model(make_tiny_checkpoint(tmp_path, "llama", num_heads=4, num_kv_heads=2, head_dim=16))
    g = torch.Generator().manual_seed(0)
    calib = collect(lm, [torch.randint(0, 256, (64,), generator=g).tolist() for _ in range(4)])
    path = tmp_path / "kv.safetensors"
    fit(calib, formats, [4, 8], lm.model).save(path)
    monkeypatch.setenv(ENV, str(path))
    return lm


def test_swap_preemption_and_compaction_keep_greedy_outputs(tmp_path, monkeypatch):
    fmt = "kivi3+pre+alloc+q8/cb3_g16+rot@sink2@win8"
    lm = _tiny(tmp_path, monkeypatch, [fmt])
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 9, 14, 21, 6, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=20)
    common = dict(kv_cache_dtype=fmt, block_size=4, enable_chunked_prefill=False, max_num_batched_tokens=64,
                  enable_prefix_caching=False)
    roomy = LLM(model=lm, num_blocks=256, **common)
    ref = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    tight = LLM(model=lm, num_blocks=24, preemption_mode="swap", num_cpu_blocks=64, **common)
    assert [o.outputs[0].token_ids for o in tight.generate(prompts, params)] == ref
    assert tight.engine.scheduler.num_preemptions["swap"] > 0, "the pool was meant to be too small"
    packed = LLM(model=lm, num_blocks=64, enable_block_compaction=True, compaction_interval=1,
                 compaction_threshold=0.0, **common)
    copies, apply = [], packed.engine.runner.apply_cache_ops

    def spy(plan):
        copies.append(len(plan.compaction_copies))
        return apply(plan)
    packed.engine.runner.apply_cache_ops = spy
    assert [o.outputs[0].token_ids for o in packed.generate(prompts, params)] == ref
    assert sum(copies) > 0, "compaction was meant to move blocks (codes, scales, staging and sink rows)"
    for llm in (roomy, tight, packed):
        assert llm.kv_manager.num_used_blocks == 0
        assert all(x.staging.num_used == 0 and x.sink.num_used == 0 for x in llm.engine.runner.layers)


@pytest.mark.parametrize("fmt", ["kivi3+pre+alloc+q8/cb3_g16+rot@sink2@win8",
                                 "kivi2.5+pre+alloc/cb2_g16@sink2@win8"])
def test_triton_kernels_drive_the_engine(tmp_path, monkeypatch, fmt):
    """The same requests through the Triton kernels (interpreter) and the torch path: prompt
    log-probs agree to float rounding and greedy outputs are the same (also with a fractional key
    mean: channel widths of 0..8 bits straddling bytes)."""
    pytest.importorskip("triton")
    from kernels.backend import interpreter_enabled
    if not interpreter_enabled():
        pytest.fail("tests run with TRITON_INTERPRET=1 (tests/conftest.py)")
    lm = _tiny(tmp_path, monkeypatch, [fmt])
    prompt = torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(2)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=0)
    outs = [LLM(model=lm, num_blocks=32, block_size=4, kv_cache_dtype=fmt, enable_prefix_caching=False,
                attention_backend=be).generate([prompt], params)[0] for be in ("torch", "interpreter")]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    lp = [[d[t] for d, t in zip(o.prompt_logprobs[1:], prompt[1:])] for o in outs]
    assert np.abs(np.array(lp[0]) - np.array(lp[1])).max() < 1e-3


@pytest.mark.parametrize("kw,match", [
    (dict(kv_cache_dtype="kivi3/cb9"), "cb bits"),
    (dict(kv_cache_dtype="kivi3+pre/cb3_g48"), "divide head_dim"),
    (dict(kv_cache_dtype="kivi3/cb3@win16", block_size=32), "at least one block"),
    (dict(kv_cache_dtype="kvq3", enable_prefix_caching=True), "enable_prefix_caching=False"),
])
def test_bad_settings_say_what_to_change(smollm2, kw, match):
    with pytest.raises(ConfigError, match=match):
        LLM(smollm2, **{**dict(num_blocks=16, block_size=16, enable_prefix_caching=False), **kw})


def test_an_artefact_of_another_model_or_format_is_refused(smollm2, tmp_path, monkeypatch):
    _tiny(tmp_path, monkeypatch, ["kivi3+pre+alloc+q8/cb3_g16+rot"])  # fitted on the tiny model, set as the one to use
    with pytest.raises(ConfigError, match="another model.*quant-calibrate"):
        LLM(smollm2, num_blocks=16, block_size=32, kv_cache_dtype="kivi3+pre+alloc+q8/cb3_g16+rot",
            enable_prefix_caching=False)
    monkeypatch.delenv(ENV)
    with pytest.raises(ConfigError, match="no table for.*block_size 64"):  # widths are fitted per block size
        LLM(smollm2, num_blocks=16, block_size=64, kv_cache_dtype="kivi3+pre+alloc+q8/cb3+rot",
            enable_prefix_caching=False)
    bad = tmp_path / "not-an-artefact.safetensors"
    bad.write_bytes(b"nonsense")
    monkeypatch.setenv(ENV, str(bad))
    with pytest.raises(ConfigError, match="not a KV calibration artefact"):
        LLM(smollm2, num_blocks=16, block_size=32, kv_cache_dtype="kvq3", enable_prefix_caching=False)


def test_host_tier_keeps_greedy_outputs_for_a_split_format_without_window(tmp_path, monkeypatch):
    """KIVI keys + codebook values without sink/window serve with prefix caching and the host
    tier: cached blocks move to host layers and back, outputs as with the tier off."""
    import random
    from paged import telemetry
    fmt = "kivi3+pre+alloc+q8/cb3_g16+rot"
    lm = _tiny(tmp_path, monkeypatch, [fmt])
    rng = random.Random(0)
    prefixes = [[rng.randrange(256) for _ in range(12)] for _ in range(4)]
    waves = [[0, 1], [2, 3], [0, 1], [2, 3], [0, 2]]
    prompts = [[prefixes[p] + [rng.randrange(256) for _ in range(rng.randrange(1, 6))] for p in w] for w in waves]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def run(**kw):
        llm = LLM(lm, kv_cache_dtype=fmt, block_size=4, num_blocks=14, max_num_batched_tokens=64, max_model_len=64,
                  max_num_seqs=2, **kw)
        eng, outs, rows = llm.engine, [], []
        for i, wave in enumerate(prompts):
            for j, p in enumerate(wave):
                eng.add_request(f"{i}.{j}", p, params)
            while eng.has_unfinished_requests():
                s = eng.step()
                rows.append(s.to_row())
                outs += [(o.request_id, tuple(o.outputs[0].token_ids)) for o in s.finished]
        return sorted(outs), telemetry.steps_frame(rows)

    base, _ = run()
    tier, st = run(enable_host_tier=True, num_cpu_blocks=16)
    assert tier == base
    assert st["num_tier_out_blocks"].sum() > 0 and st["num_tier_in_blocks"].sum() > 0


@pytest.mark.parametrize("fmt", ["fp32/cb4", "bf16/cb4", "fp16/cb3+rot"])
def test_an_exact_key_side_reads_its_keys_as_stored_and_matches_the_engine(smollm2, ids, fmt):
    """An fp32/bf16/fp16 K side keeps each key rounded to its storage dtype, nothing else (over two
    appends, bit for bit), and the study's cache reproduces the engine's prompt NLL for it."""
    f = kernels.get_format(fmt)
    cache = SplitCache(fmt, smollm2.model, tables_for(fmt, smollm2.model, for_model(smollm2.model, f, 32), 32), 32)
    h, d = smollm2.config.num_kv_heads, smollm2.config.head_dim
    k1, k2 = torch.randn(40, h, d, generator=torch.Generator().manual_seed(0)), torch.randn(7, h, d)
    for k in (k1, k2):
        start = 0 if cache.raw[0] is None else cache.raw[0].shape[0]
        got = cache._keys(0, k.to(f.k_side.storage_dtype).float(), start)
    want = torch.cat([k1, k2]).to(f.k_side.storage_dtype).float()
    assert got.shape == want.shape and torch.equal(got, want)
    n = 150
    chunk = make_chunks({"kjv": ids[:n]}, smollm2.tokenizer, n, max_chunks=1)[0]
    engine = chunk_nll(_llm(smollm2, fmt), [chunk])[0]
    assert np.abs(_study_nll(smollm2, fmt, chunk, n) - engine).max() < 1e-4


@pytest.mark.parametrize("context", [512, 2048, 4096, 32768])
def test_served_bits_count_the_sink_and_window_rows_at_real_contexts(context):
    """Bits per value worked out by hand for SmolLM2 (3 KV heads x 64) at block 32.
    kvq3 = kivi3+pre+alloc+q8 / cb3+rot @sink4 @win32: K codes 3 x 64 / 8 = 24 B per token-head, its q8
    per-block side 64 x (uint8 step + int8 zero) + 2 fp16 super-scales = 132 B per block-head; V codes
    24 B + one fp16 scale per 64-group = 26 B per token-head. Staging: the window overlaps
    ceil(32/32) + 1 = 2 blocks (64 rows) plus 4 sink rows = 68 fp16 rows of K and of V per sequence.
    kivi4+pre/cb4 (no sink or window): 32 B + 256 B per block-head for K, 34 B for V, and K alone
    stages its one unfilled block (32 rows)."""
    kb, vb, mean = served_bits("kvq3", 32, 3, 64, context=context)
    k_codes = (3 * 24 + 3 * 132 / 32) * 8 / (3 * 64)   # 3.515625
    v_codes = 3 * 26 * 8 / (3 * 64)                     # 3.25
    assert (kb, vb) == (k_codes + 16 * 68 / context, v_codes + 16 * 68 / context)
    assert mean == (kb + vb) / 2
    if context == 2048:
        assert round(mean, 2) == 3.91  # the figure kernels/format_table.py quotes for kvq3 at 2k
    kb, vb, _ = served_bits("kivi4+pre/cb4", 32, 3, 64, context=context)
    assert (kb, vb) == ((3 * 32 + 3 * 256 / 32) * 8 / (3 * 64) + 16 * 32 / context, 3 * 34 * 8 / (3 * 64))


def test_calibrate_update_adds_tables_and_keeps_what_the_file_holds(smollm2, tmp_path, capsys):
    """``quant-calibrate --update``: the new format's tables are added, the file's own entries stay
    bit for bit; a file fitted on another model is refused before the calibration pass."""
    from kernels.split_artefact import KVArtefact
    from paged.cli import main
    shipped = for_model(smollm2.model, kernels.get_format("kvq2"), 32)
    path = tmp_path / "kv.safetensors"
    start = KVArtefact(shipped.model_tag, shipped.model_fingerprint, shipped.source, shipped.num_tokens,
                       {"v:cb2": shipped.entries["v:cb2"]})
    start.save(path)
    assert main(["quant-calibrate", "--formats", "kivi2.5+alloc/cb3", "--block-size", "16", "--out", str(path),
                 "--update"]) == 0
    art = KVArtefact.load(path)
    assert sorted(art.entries) == ["k:kivi2.5+alloc@bs16", "v:cb2", "v:cb3"]
    assert torch.equal(art.entries["v:cb2"], shipped.entries["v:cb2"])
    assert set(art.entries["k:kivi2.5+alloc@bs16"].long().sum(-1).flatten().tolist()) == {160}
    KVArtefact("L1xH1xD8", "0" * 64, shipped.source, shipped.num_tokens, {}).save(path)
    capsys.readouterr()
    assert main(["quant-calibrate", "--formats", "kvq2", "--out", str(path), "--update"]) == 2
    assert "another model" in capsys.readouterr().err
