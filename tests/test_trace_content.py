"""Traces with block-level content (Mooncake's hash_ids): equal block ids make equal prompt tokens,
and the simulator's prefix cache sees exactly the reuse the trace's ids say (computed here
independently from the ids), for KV block sizes that divide the trace's and for larger ones."""
from __future__ import annotations

import gzip
import json
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from paged.sim.arrivals import SyntheticPrompts
from paged.sim.content_blocks import block_tokens
from paged.sim.simulator import SimConfig, simulate
from paged.sim.specs import get_model
from paged.sim.workload import TraceFormatError, fit_to_context, load_trace, normalize_trace, save_trace

sys.path.insert(0, str(Path(__file__).parent))
from content_helpers import expected_hits  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONV = ROOT / "data" / "traces" / "mooncake" / "conversation_trace.jsonl.gz"
SYNTH = ROOT / "data" / "traces" / "mooncake" / "synthetic_trace.jsonl.gz"


def _unlimited(trace: pd.DataFrame, block_size: int, **kw) -> dict:
    need = int(np.ceil((trace["prompt_tokens"] + trace["output_tokens"]) / block_size).sum())  # never evicts
    cfg = SimConfig(model="llama-3.1-70b", gpu="a100-80gb", tensor_parallel=8, block_size=block_size,
                    num_blocks=need, **kw)
    return simulate(trace, cfg).summary


# ---- tokens from blocks ----------------------------------------------------------------------

def test_equal_ids_make_equal_tokens_and_a_partial_block_is_a_prefix():
    a = block_tokens([7, 9, 11], 1200, 512, seed=3, lo=17, hi=1000)
    b = block_tokens([7, 9, 12], 1300, 512, seed=3, lo=17, hi=1000)
    assert a.shape == (1200,) and a.min() >= 17 and a.max() < 1000
    assert np.array_equal(a[:1024], b[:1024])                 # ids 7, 9 shared
    assert (a[1024:1200] != b[1024:1200]).mean() > 0.95       # 11 vs 12: different content
    full = block_tokens([7, 9, 11], 1536, 512, seed=3, lo=17, hi=1000)
    assert np.array_equal(full[:1200], a)                     # a partial block is a prefix of the full one
    moved = block_tokens([9], 512, 512, seed=3, lo=17, hi=1000)
    assert np.array_equal(moved, a[512:1024])                 # an id's content does not depend on its position
    other_seed = block_tokens([7, 9, 11], 1200, 512, seed=4, lo=17, hi=1000)
    assert (other_seed != a).mean() > 0.95
    wide = block_tokens([5], 512, 512, seed=0, lo=17, hi=128256)
    assert len(set(wide.tolist())) >= 505                     # ~511 expected from 512 draws: no short cycle


def test_synthetic_prompts_from_blocks_use_the_vocabulary():
    toks = SyntheticPrompts(get_model("llama-3.1-8b").vocab_size, seed=0)
    p = toks.from_blocks(np.array([1, 2]), 700, 512)
    assert len(p) == 700 and min(p) >= 17 and max(p) <= 256 and isinstance(p[0], int)
    assert len(set(p)) > 200  # the 240 small ids are all in use
    tiny = SyntheticPrompts(100, seed=0).from_blocks(np.array([1]), 300, 512)
    assert max(tiny) < 100   # a vocabulary below 257 ids bounds them


# ---- loading and checking ---------------------------------------------------------------------

def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_mooncake_rows_load_with_their_blocks(tmp_path):
    rows = [{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]},
            {"timestamp": 2500, "input_length": 513, "output_length": 1, "hash_ids": [0, 2]}]
    tr = load_trace(_write(tmp_path / "m.jsonl", rows))
    assert tr.attrs["content_block_size"] == 512 and tr["arrival_time"].tolist() == [0.0, 2.5]
    assert [ids.tolist() for ids in tr["block_hashes"]] == [[0, 1], [0, 2]]
    # by content, not by name: gzip and an unrelated extension load the same
    gz = tmp_path / "trace.data"
    gz.write_bytes(gzip.compress((tmp_path / "m.jsonl").read_bytes()))
    again = load_trace(gz)
    assert again["prompt_tokens"].tolist() == [1000, 513] and again["block_hashes"][1].tolist() == [0, 2]


@pytest.mark.parametrize("bad, match", [
    ({"hash_ids": [0]}, r"row 2, column 'hash_ids': 1 block ids of 512 tokens for a prompt of 1000 tokens; "
                        r"need ceil\(1000 / 512\) = 2 ids"),
    ({"hash_ids": [0, 1, 2]}, r"row 2, column 'hash_ids': 3 block ids"),
    ({"hash_ids": [0, -1]}, r"row 2, column 'hash_ids': got \[0, -1\], need a list of integer block ids"),
    ({"hash_ids": "0 1"}, r"row 2, column 'hash_ids': got '0 1'"),
    ({"hash_ids": [0, 1.5]}, r"row 2, column 'hash_ids'"),
    ({"hash_ids": [0, True]}, r"row 2, column 'hash_ids'"),
    ({"hash_ids": [0, 2**63]}, r"row 2, column 'hash_ids'"),
    ({"hash_ids": None}, r"row 2, column 'hash_ids': got None"),
    ({"timestamp": -5}, r"row 2, column 'timestamp': got -5, need a number >= 0"),
    ({"input_length": 0}, r"row 2, column 'input_length': got 0, need an integer >= 1"),
    ({"output_length": "7"}, r"row 2, column 'output_length': got '7'"),
])
def test_malformed_mooncake_rows_are_named(tmp_path, bad, match):
    good = {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}
    with pytest.raises(TraceFormatError, match=match):
        load_trace(_write(tmp_path / "m.jsonl", [good, {**good, **bad}]))


def test_missing_hash_ids_and_bad_gzip_are_named(tmp_path):
    good = {"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [3]}
    rows = [good, {"timestamp": 1, "input_length": 10, "output_length": 5}]
    with pytest.raises(TraceFormatError, match=r"m.jsonl: row 2: missing 'hash_ids'"):
        load_trace(_write(tmp_path / "m.jsonl", rows))
    broken = tmp_path / "b.jsonl.gz"
    whole = gzip.compress("".join(json.dumps({**good, "timestamp": i}) + "\n" for i in range(500)).encode())
    broken.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(TraceFormatError, match="b.jsonl.gz: a damaged gzip file"):
        load_trace(broken)


def test_dataframe_checks_name_rows_and_need_the_block_size():
    df = pd.DataFrame({"arrival_time": [0.0, 1.0], "prompt_tokens": [100, 70], "output_tokens": [1, 1],
                       "block_hashes": [[1, 2], [1, 3]]})
    with pytest.raises(TraceFormatError, match=r"needs trace.attrs\['content_block_size'\]"):
        normalize_trace(df)
    df.attrs["content_block_size"] = 64
    tr = normalize_trace(df)
    assert tr["block_hashes"][1].tolist() == [1, 3]
    with pytest.raises(ValueError):
        tr["block_hashes"][0][0] = 5                       # the checked ids are read-only
    both = df.assign(prefix_id=[-1, 0], prefix_tokens=[0, 10])
    with pytest.raises(TraceFormatError, match="row 1: give either 'block_hashes' or prefix_id"):
        normalize_trace(both)


def test_paged_csv_round_trips_blocks_and_fit_cuts_them(tmp_path):
    df = pd.DataFrame({"arrival_time": [0.0, 1.0], "prompt_tokens": [100, 200], "output_tokens": [5, 5],
                       "block_hashes": [[1, 2], [1, 3, 4, 5]]})
    df.attrs["content_block_size"] = 64
    save_trace(df, tmp_path / "t.csv")
    assert "content_block_size" in (tmp_path / "t.csv").read_text().splitlines()[0]
    back = load_trace(tmp_path / "t.csv")
    assert back.attrs["content_block_size"] == 64 and back["block_hashes"][1].tolist() == [1, 3, 4, 5]
    cut = fit_to_context(normalize_trace(df), 129)
    assert cut["prompt_tokens"].tolist() == [100, 128] and cut["block_hashes"][1].tolist() == [1, 3]
    normalize_trace(cut)  # still valid
    (tmp_path / "bad.csv").write_text("arrival_time,prompt_tokens,output_tokens,block_hashes,content_block_size\n"
                                      "0,100,5,1 2,64\n0,100,5,1 x,64\n")
    with pytest.raises(TraceFormatError, match=r"bad.csv: row 3, column 'block_hashes': got '1 x'"):
        load_trace(tmp_path / "bad.csv")


def test_azure_2024_timestamps_with_offsets_load(tmp_path):
    f = tmp_path / "week.csv"
    f.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 00:00:00.009930+00:00,100,10\n"
                 "2024-05-10 00:00:02+00:00,200,20\n2024-05-10 00:00:01.500000+00:00,300,30\n")
    tr = load_trace(f)
    assert tr["arrival_time"].tolist() == pytest.approx([0.0, 1.49007, 1.99007])
    assert tr["prompt_tokens"].tolist() == [100, 300, 200]


def test_shipped_traces_match_their_published_statistics():
    """Mooncake's README and Table 2 (FAST'25): 12,031 / 3,993 requests, mean input 12,035 / 15,325,
    output 343 / 149; Azure 2023 (ANCHORS): conversation 19,366 requests, input mean 1155, code 8,819."""
    conv, synth = load_trace(CONV), load_trace(SYNTH)
    assert len(conv) == 12031 and round(conv["prompt_tokens"].mean()) == 12035
    assert round(conv["output_tokens"].mean()) == 343
    assert len(synth) == 3993 and round(synth["prompt_tokens"].mean()) == 15325
    assert round(synth["output_tokens"].mean()) == 149
    az = ROOT / "data" / "traces" / "azure2023"
    a = load_trace(az / "AzureLLMInferenceTrace_conv.csv.gz")
    c = load_trace(az / "AzureLLMInferenceTrace_code.csv.gz")
    assert (len(a), round(a["prompt_tokens"].mean()), len(c), round(c["prompt_tokens"].mean())) == (19366, 1155, 8819, 2048)
    for p in list((ROOT / "data" / "traces").rglob("*.gz")):
        assert p.stat().st_size < 2 * 2**20, p


# ---- the simulator sees exactly the trace's reuse ------------------------------------------------

@pytest.mark.parametrize("block_size", [16, 512])
def test_unlimited_cache_hits_equal_the_trace_count_when_the_block_size_divides(block_size):
    tr = load_trace(CONV).iloc[:600]
    s = _unlimited(tr, block_size)
    hits, queries = expected_hits(tr, block_size, 131072)
    assert s["requests_finished"] == 600 and s["num_preemptions"] == 0
    assert (s["prefix_cache_hit_tokens"], s["prefix_cache_query_tokens"]) == (hits, queries)
    assert hits > 0.15 * queries  # the trace does reuse: multi-turn conversations


def test_a_block_size_above_the_traces_sees_the_reuse_floored_to_whole_blocks():
    """1,024-token KV blocks over 512-token content blocks: the documented approximation (hits are
    the trace's shared tokens floored to whole KV blocks) — fewer hits than at 512, and exactly
    the count made from the ids."""
    tr = load_trace(SYNTH).iloc[:300]
    s = _unlimited(tr, 1024)
    hits, queries = expected_hits(tr, 1024, 131072)
    assert (s["prefix_cache_hit_tokens"], s["prefix_cache_query_tokens"]) == (hits, queries)
    assert hits < expected_hits(tr, 512, 131072)[0]
    assert s["requests_rejected"] == int(((tr["prompt_tokens"] + tr["output_tokens"]) > 131072).sum())


def test_llama_31_presets_have_their_real_kv_size_and_context():
    """Bytes per token by hand: 2 (K and V) x layers x 8 KV heads x head_dim 128 x 2 bytes (bf16)."""
    from paged.sim.specs import kv_cache_sizing

    for name, layers, by_hand in (("llama-3.1-8b", 32, 131072), ("llama-3.1-70b", 80, 327680)):
        m = get_model(name)
        assert (m.num_layers, m.num_kv_heads, m.head_dim, m.max_model_len) == (layers, 8, 128, 131072)
        assert 2 * layers * 8 * 128 * 2 == by_hand
        sz = kv_cache_sizing(m, "a100-80gb", 16, tensor_parallel=8)
        assert sz.bytes_per_block == by_hand // 8 * 16
    assert math.isclose(327680 / 1024, 320.0)  # the Mooncake paper's "320 KB per token" for LLaMA3-70B


def test_the_engine_given_the_same_prompts_hits_what_the_ids_say(smollm2):
    """The torch engine (SmolLM2, real forward passes, prefix caching on) on a small block trace,
    one request at a time: its prefix-cache hit tokens equal the count made from the ids."""
    from paged.engine import EngineConfig, LLMEngine, SamplingParams
    from paged.sim.arrivals import trace_prompts

    df = pd.DataFrame({"arrival_time": [0.0] * 6, "prompt_tokens": [70, 90, 100, 40, 95, 64],
                       "output_tokens": [2] * 6,
                       "block_hashes": [[1, 2, 3], [1, 2, 4], [1, 2, 4, 5], [6, 7], [1, 2, 4], [1, 2]]})
    df.attrs["content_block_size"] = 32
    tr = normalize_trace(df)
    prompts = trace_prompts(tr, smollm2.config.vocab_size, seed=0)
    assert prompts[1][:64] == prompts[2][:64] == prompts[0][:64] and prompts[1] == prompts[4][:90]
    eng = LLMEngine(smollm2, EngineConfig(block_size=16, num_blocks=256, enable_prefix_caching=True))
    for i, ids in enumerate(prompts):
        eng.add_request(f"r{i}", ids, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        while eng.has_unfinished_requests():
            eng.step()
    hits, queries = expected_hits(tr, 16, 10**9)
    assert (eng.kv.prefix_cache_hits, eng.kv.prefix_cache_queries) == (hits, queries) and hits >= 4 * 64


def test_merging_block_traces_is_refused_rather_than_mixing_their_ids():
    from paged.errors import ConfigError
    from paged.sim.workload import concat_traces

    df = pd.DataFrame({"arrival_time": [0.0], "prompt_tokens": [10], "output_tokens": [1], "block_hashes": [[4]]})
    df.attrs["content_block_size"] = 512
    with pytest.raises(ConfigError, match="does not merge traces with content blocks"):
        concat_traces([df, df])
