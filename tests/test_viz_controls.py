"""The class-facing pieces of issue 20: tables that fit (paged.viz.tables), precomputed full-size
results (paged.studies.precomputed), 05's study panel and 00's scenario picker."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from paged.errors import ConfigError
import figure_check as check
from paged.viz import tables


def test_fit_table_wraps_headers_keeps_every_value_and_fits_a_laptop() -> None:
    wide = pd.DataFrame({f"a_rather_long_column_name_{i}": [1.234567, 149130.81] for i in range(9)})
    wide["outputs_identical"] = [True, False]
    assert check.table_problems(wide)  # 16 unbreakable headers: wider than the screen
    sty = tables.fit_table(wide)
    assert check.table_problems(sty) == []
    html = sty.to_html()
    assert "outputs identical" in html and "149,131" in html and "1.23" in html and ">no<" in html
    with pytest.raises(ConfigError, match="no columns"):
        tables.fit_table(wide, ["missing"])


def test_number_formatting() -> None:
    assert [tables.number(v) for v in (0.5, 149130.8, 1.2345, 12.345, 3, 2.0, float("nan"), True, np.inf)] == \
        ["0.500", "149,131", "1.23", "12.3", "3", "2", "–", "yes", "∞"]


def test_precomputed_round_trip_and_a_clear_error(tmp_path) -> None:
    from paged.studies import precomputed as P
    df = pd.DataFrame({"variant": ["a", "b"], "rate": [np.inf, 2.0], "first_div": ["[1, 2]", "[3]"]})
    df.attrs["config"] = {"model": "llama-2-70b", "pressures": (0.5, 0.25), "rate": float("inf")}
    P.save("99", {"study": df}, root=tmp_path)
    back = P.load("99", "study", root=tmp_path)
    assert back["rate"].tolist() == [np.inf, 2.0] and back.attrs["config"]["model"] == "llama-2-70b"
    with pytest.raises(P.DataError, match=r"python -m paged.studies.precomputed 99"):
        P.load("99", "missing", root=tmp_path)
    assert "data/precomputed/99_*.csv" in P.describe("99", root=tmp_path)
    assert str(tmp_path) not in P.describe("99", root=tmp_path)  # no path of this machine
    with pytest.raises(ConfigError):
        P.make("42", root=tmp_path)


@pytest.mark.parametrize("nb", ["05", "08"])
def test_shipped_precomputed_tables_load(nb) -> None:
    from paged.studies import precomputed as P
    names = {"05": ("study", "layer_errors", "sensitivity", "key_channels", "key_layers", "formats", "front",
                    "llamacpp"),
             "08": ("tiers", "engine_tiers", "offload", "streaming", "engine_swap", "swap_error", "sharing",
                    "compaction_reads", "compaction_copies", "compaction_sim")}[nb]
    for name in names:
        df = P.load(nb, name)
        assert len(df), f"{nb}_{name}.csv is empty"
        assert not check.output_problems(df.to_string() + str(df.attrs)), f"{nb}_{name} holds a machine path"


def test_full_05_supports_its_notebook_sentences() -> None:
    """The precomputed 05 study has two contexts (so context_trend says something) and int8/int4 rows."""
    from paged.studies import precomputed as P
    from paged.viz import prose
    full = P.load("05", "study")
    assert sorted(full.context_length.unique()) == [512, 2048]
    assert "Only one context" not in prose.context_trend(full).data
    assert "int8 has a mean KL divergence" in prose.format_errors(full).data


def test_front_goals_follow_the_shipped_front() -> None:
    """05's goal sentences come from the shipped front and change with it."""
    from paged.studies import precomputed as P
    from paged.viz import prose
    front, llama = P.load("05", "front"), P.load("05", "llamacpp")
    assert {"kvq4", "kvq3", "kvq2"} <= set(front.format) and set(llama.rotation) == {"on", "off"}
    text = prose.front_goals(front, llama).data
    kvq3 = front[(front.format == "kvq3")]
    met = "**met**" if kvq3.kld_mean.max() <= 0.01 else "**not met**"
    assert f"at most 4 bits per value with KLD ≤ 0.01 — {met}" in text and "`kvq3`" in text
    worse = front.assign(kld_mean=front.kld_mean * 100)  # the same table, 100x the error: no goal is met
    assert "**met**" not in prose.front_goals(worse, llama).data
    assert "No served format" in prose.front_goals(front, llama, goals=[(1.0, 0.1)]).data


@pytest.fixture(scope="module")
def lm():
    from paged.quant.runs import load
    return load()


def test_study_panel_runs_the_chosen_settings(lm) -> None:
    from paged.viz.quant_panel import StudyPanel
    p = StudyPanel(lm, ["int8"], contexts=(32,), sources=["kjv"], max_chunks=1, divergence_tokens=0)
    p.formats.value, p.contexts.value = ("int8", "int4"), (32,)
    df = p.run()
    assert set(df.format) >= {"int8", "int4"} and set(df.context_length) == {32} and "done in" in p.status.value
    assert len(p.out.outputs) == 3  # table, two sentences
    assert list(p.plot.figure.data[0].text) == ["int4", "int8"]  # the Pareto figure, by bits
    p.formats.value = ()
    assert p.run() is df and "pick at least one format" in p.status.value  # nothing changed
    with pytest.raises(ConfigError, match="unknown text source"):
        StudyPanel(lm, ["int8"], sources=["nope"])


def test_scenario_panel_builds_a_dashboard() -> None:
    import paged
    from paged import runs
    from paged.viz.scenarios import ScenarioPanel
    llm = paged.LLM(num_blocks=32)
    base = runs.Run(llm, runs.chat_workload(llm.tokenizer, 1, max_tokens=2))
    panel = ScenarioPanel(base, "memory pressure", autoplay=False)
    assert "preempted" in panel.about.value
    dash = panel.start()
    assert dash.run.engine.config.num_blocks == 16 and len(dash.run.workload) == 10
    panel.choice.value = "long prompts"
    assert "chunked prefill" in panel.about.value
    with pytest.raises(ConfigError):
        ScenarioPanel(base, "nope")


def test_chat_panel_serves_the_picked_format_beside_fp32(lm) -> None:
    from paged.viz.quant_panel import ChatPanel
    p = ChatPanel(lm, ["kvq3", "nope"], "The three most important ideas in operating systems are", max_tokens=4)
    df = p.run()
    assert list(df.format) == ["fp32", "kvq3"] and (df.num_tokens == 4).all()
    assert "kvq3" in p.view.value and "fp32" in p.view.value and "fp32 vs kvq3" in p.status.value
    assert (df.decode_tokens_per_s > 0).all()  # 3 decode steps each, timed
    assert all(f"{f} {r:.1f} tokens/s" in p.status.value for f, r in zip(df.format, df.decode_tokens_per_s))
    p.format.value = "nope"
    assert p.run() is df and "unknown KV format" in p.status.value and not p.button.disabled  # nothing changed
    with pytest.raises(ConfigError, match="at least one format"):
        ChatPanel(lm, [], "x")
