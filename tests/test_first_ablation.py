"""Issue 30, a researcher's first ablation: each thing that got in the way, as a test that failed
before its fix. Imports sit inside the tests so each one fails on its own on the old code."""
from __future__ import annotations

import warnings
from pathlib import Path

import pandas as pd
import pytest

from paged.errors import ConfigError, PagedError

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"model": "llama-2-7b", "gpu": "a100-40gb", "num_requests": 20}


# ---- 1: a typo in a sweep grid key fails before any point runs ---------------------------------
def test_a_typo_in_a_grid_key_fails_before_any_point_runs(tmp_path):
    import paged

    with pytest.raises(ConfigError, match=r"unknown key\(s\) blok_size; valid keys: block_size") as e:
        paged.sweep("simulate", {**SMALL, "blok_size": [16, 32]}, store=tmp_path, progress=False)
    assert "trace_seed" in str(e.value) and "prefix_zipf" in str(e.value)  # the trace keys are listed too
    assert not list(tmp_path.rglob("*.parquet"))  # nothing ran, nothing was stored
    with pytest.raises(ConfigError, match=r"study 'memory_story': unknown key\(s\) blocksize"):
        paged.sweep("memory_story", {"blocksize": [8]}, store=False, progress=False)
    df = paged.sweep("simulate", {**SMALL, "block_size": [16, 32]}, store=False, progress=False)
    assert df["status"].tolist() == ["ok", "ok"]


# ---- 2: an ambiguous GPU name is refused, a preset name is echoed canonically -----------------
def test_an_ambiguous_gpu_is_refused_and_the_summary_names_the_preset():
    from paged.sim.simulator import SimConfig, Simulator

    with pytest.raises(ConfigError, match=r"'a100' is ambiguous: it may be 'a100-40gb' or 'a100-80gb'"):
        SimConfig(gpu="a100")
    with pytest.raises(ConfigError, match=r"did you mean 'h100-sxm'"):
        SimConfig(gpu="h100")
    sim = Simulator(SimConfig(model="llama-2-7b", gpu="A100-80GB", num_blocks=50))
    trace = pd.DataFrame({"arrival_time": [0.0], "prompt_tokens": [20], "output_tokens": [2]})
    assert sim.config.gpu == sim.run(trace).summary["gpu"] == "a100-80gb"


# ---- 3: kvq2 at the defaults: staging rows eat the budget, and the engine says so -------------
def test_a_staged_format_whose_staging_eats_the_budget_warns_with_the_fix():
    import paged
    from paged.errors import PagedWarning

    kw = dict(kv_cache_dtype="kvq2", block_size=32, enable_prefix_caching=False)
    with pytest.warns(PagedWarning, match=r"staging rows of max_num_seqs=256 .* max_num_seqs=(\d+) gives") as w:
        small = paged.LLM(**kw)
    facts = paged.memory_facts(small)
    assert facts.staging_bytes > facts.pool_bytes  # what the warning is about, readable as facts
    assert round(facts.cache_bytes_per_pool_token) == 29359  # the number: 29,359 cache bytes per token
    suggested = int(__import__("re").search(r"max_num_seqs=(\d+) gives", str(w[0].message)).group(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", PagedWarning)  # the suggested setting does not warn
        fixed = paged.memory_facts(paged.LLM(**kw, max_num_seqs=suggested))
        int8 = paged.memory_facts(paged.LLM(kv_cache_dtype="int8", block_size=32, enable_prefix_caching=False))
    assert fixed.pool_tokens > 2 * int8.pool_tokens > 2 * facts.pool_tokens  # 2 bits then hold more than int8


# ---- 4: format names agree between the engine and the quantization study -----------------------
def test_the_study_reads_the_engines_format_names():
    import paged
    from paged.quant import describe_formats, study

    row = describe_formats(["kvq2"]).set_index("format").loc["kvq2"]
    engine = paged.memory_facts(paged.LLM(kv_cache_dtype="kvq2", block_size=32, enable_prefix_caching=False,
                                          max_num_seqs=8))
    assert row["bytes_per_token"] == engine.bytes_per_token and row["engine_block_size"] == 32
    with pytest.raises(ConfigError) as e:
        study(formats=["kvq4"], progress=False)
    assert "unknown KV format" not in str(e.value) and "describe_formats" in str(e.value)


def test_the_readme_says_what_block_size_the_front_needs():
    """The README said the front formats need block_size=32, yet block_size=16 runs."""
    import paged

    text = " ".join((ROOT / "README.md").read_text().split())
    assert "They need `block_size=32" not in text
    at16 = paged.memory_facts(paged.LLM(kv_cache_dtype="kvq2", block_size=16, enable_prefix_caching=False,
                                        max_num_seqs=8))
    assert at16.bytes_per_token > 3450  # runs, and stores more per token than at 32 (what the README says)


# ---- 5: one unit and one name per concept (the general check is tests/test_names.py) ------------
def test_memory_knobs_state_their_unit_and_seeds_say_what_they_seed():
    from paged.engine import EngineConfig
    from paged.sim.simulator import SimConfig

    for cls in (EngineConfig, SimConfig):
        names = set(cls.knob_fields())
        assert {"kv_cache_memory_bytes", "swap_space_gib"} <= names and not {"kv_cache_memory", "swap_space"} & names
        assert "seed" not in names
    assert "sampling_seed" in EngineConfig.knob_fields() and "prompt_seed" in SimConfig.knob_fields()


def test_the_cli_lists_the_eviction_policies():
    from paged.cli import build_parser

    text = build_parser()._subparsers._group_actions[0].choices["simulate"].format_help()  # noqa: SLF001
    assert "lru, lfu, weighted, score" in " ".join(text.split())


# ---- 6: what the researcher wrote by hand --------------------------------------------------------
def test_zipf_tenants_in_synthetic_trace_the_sweep_and_the_cli(tmp_path, capsys):
    import json

    import paged
    from paged.cli import main
    from paged.sim.workload import synthetic_trace

    tr = synthetic_trace("sharegpt", 4000, num_prefixes=8, prefix_tokens=16, prefix_zipf=1.2, trace_seed=3)
    share = tr["prefix_id"].value_counts(normalize=True).sort_index().to_numpy()
    want = [1 / (i + 1) ** 1.2 for i in range(8)]
    assert share == pytest.approx([w / sum(want) for w in want], abs=0.02)
    uniform = synthetic_trace("sharegpt", 4000, num_prefixes=8, prefix_tokens=16, trace_seed=3)
    assert uniform["prefix_id"].value_counts(normalize=True).max() < 0.15 < share[0]
    df = paged.sweep("simulate", {**SMALL, "num_prefixes": 32, "prefix_tokens": 64, "prefix_zipf": [0.0, 2.0]},
                     store=False, progress=False)
    hits = df["prefix_cache_hit_rate"].tolist()
    assert df["status"].tolist() == ["ok", "ok"] and hits[1] > hits[0]  # a skewed mix reuses more prefixes
    assert main(["simulate", "--model", "llama-2-7b", "--gpu", "a100-40gb", "-n", "20", "--num-prefixes", "32",
                 "--prefix-tokens", "64", "--prefix-zipf", "2.0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prefix_cache_hit_rate"] == pytest.approx(hits[1])


def test_memory_facts_and_step_times_of_a_simulated_run():
    import paged
    from paged.sim.simulator import SimConfig, Simulator
    from paged.sim.workload import synthetic_trace

    sim = Simulator(SimConfig(model="llama-2-7b", gpu="a100-40gb", num_blocks=200))
    facts = paged.memory_facts(sim)
    assert facts.pool_tokens == 200 * 16 and facts.bytes_per_token == sim.model.kv_bytes_per_token() == 524288
    steps = sim.run(synthetic_trace("sharegpt", 40, rate=8.0)).steps
    t = paged.step_times(steps).set_index("kind")
    assert t["steps"].sum() == (steps["num_batched_tokens"] > 0).sum()
    decode = steps[(steps["num_prefill_tokens"] == 0) & (steps["num_decode_tokens"] > 0)]
    assert t.loc["decode", "steps"] == len(decode) and t.loc["decode", "mean_s"] == decode["step_time_s"].mean()
    assert t.loc["mixed", "mean_s"] > t.loc["decode", "mean_s"]  # a prefill chunk makes a step slower


def test_figures_export_to_png_offline(tmp_path):
    import plotly.graph_objects as go

    from paged.viz.export import save_figure

    fig = go.Figure(go.Bar(x=["a", "b"], y=[1, 2]), layout=dict(width=320, height=240))
    png = save_figure(fig, tmp_path / "fig.png", scale=1)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert int.from_bytes(png.read_bytes()[16:20], "big") == 320  # drawn at the figure's own width
    assert "plotly" in save_figure(fig, tmp_path / "fig.html").read_text()[:100000]
    with pytest.raises(ConfigError, match="suffix"):
        save_figure(fig, tmp_path / "fig.bmp")


# ---- 7: errors that name what is wrong ------------------------------------------------------------
def test_a_trace_missing_a_column_names_it(tmp_path):
    from paged.sim.workload import load_trace

    p = tmp_path / "t.csv"
    p.write_text("arrival_time,prompt_tokens\n0.0,5\n")
    with pytest.raises(PagedError, match=r"missing column\(s\) output_tokens"):
        load_trace(str(p))


def test_a_model_path_that_does_not_exist_says_so():
    from paged.engine import LLM

    with pytest.raises(ConfigError, match=r"model path '/no/such/dir' does not exist"):
        LLM(model="/no/such/dir")
