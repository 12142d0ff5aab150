"""The KV quantization study: scheme grammar and storage costs, bad input, and on SmolLM2 the
baseline's zero error and per-format error bounds (the CI-sized run's cost is measured by
benchmarks/time_budgets.py, not asserted here).

Bounds are ~2-3x the values measured on this machine (ctx 256, first chunk of each shipped
source, 381 scored tokens): KLD fp16 7e-7, int8 1.0e-3, fp8_e4m3 (scale 1) 1.4e-2,
int4_kivi 1.8e-2, int4+rot 3.9e-2, int4 8.2e-2; 4.5 bits: kivi_g64/int4_g64+vrot 2.6e-2,
kiviq_g32/int4_g64+vrot (4.49) 2.1e-2, int4sym (q4_0-like) 0.13.
"""
from __future__ import annotations

import pytest

from paged.errors import ConfigError
from paged.quant import describe_formats, make_chunks, parse_scheme, study
from paged.quant.schemes import DEFAULT_SCHEMES


def test_scheme_names_round_trip_and_bits():
    for name in DEFAULT_SCHEMES:
        assert parse_scheme(name).name == name
    s = parse_scheme("int8/int4_g64+rot")
    assert (s.k.kind, s.v.kind, s.v.group, s.rotate) == ("int8", "int4", 64, True)
    assert parse_scheme("kivi/int4").name == "int4_kivi" and parse_scheme("int4_kivi").engine_format == "int4_kivi"
    hd = 64
    assert parse_scheme("int8").bits_per_value(hd) == 8.25      # 8 + fp16 scale / 64
    assert parse_scheme("int4").bits_per_value(hd) == 5.0       # 4 + (scale + zero) / 32
    assert parse_scheme("int4_g64").bits_per_value(hd) == 4.5
    assert parse_scheme("int4_kivi").bits_per_value(hd) == 5.5  # K 6 (per channel over 16), V 5
    assert parse_scheme("int8").engine_format == "int8" and parse_scheme("int4+rot").engine_format is None


def test_bytes_per_token_agree_with_the_kernels():
    import kernels
    for fmt in ("fp16", "int8", "int4", "int4_kivi"):
        ours = parse_scheme(fmt).bytes_per_token(1, 3, 64)
        assert ours == kernels.bytes_per_token(fmt, 3, 64, dtype=kernels.get_format("fp16").storage_dtype)


@pytest.mark.parametrize("bad, match", [("bogus", "unknown KV format"), ("int4_g48", "divide head_dim"),
                                        ("int8_cal", "only fp8"), ("int4/kivi", "keys per channel"),
                                        ("", "non-empty"), ("a/b/c", "one '/'")])
def test_bad_formats(bad, match):
    with pytest.raises(ConfigError, match=match):
        parse_scheme(bad).check(64)


class _Tok:
    add_bos, bos_token_id = False, 1

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def test_bad_texts_and_contexts():
    with pytest.raises(ConfigError, match="empty"):
        make_chunks({"x": "   "}, _Tok(), 8)
    with pytest.raises(ConfigError, match="fewer than one chunk"):
        make_chunks({"x": "abc"}, _Tok(), 8)
    with pytest.raises(ConfigError, match="longer than the model"):
        make_chunks({"x": "a" * 100}, _Tok(), 64, max_model_len=32)
    with pytest.raises(ConfigError, match="no texts"):
        make_chunks({}, _Tok(), 8)
    chunks = make_chunks({"x": "a" * 20}, _Tok(), 8)
    assert len(chunks) == 2 and chunks[0].ids == tuple([97] * 8)


@pytest.fixture(scope="module")
def smol():
    from paged.quant.runs import load
    return load()


@pytest.fixture(scope="module")
def table(smol):
    df = study(smol, formats=["fp16", "int8", "fp8_e4m3", "int4_kivi", "int4", "int4+rot", "kivi_g64/int4_g64+vrot",
                              "kiviq_g32/int4_g64+vrot", "int4sym"],
               context_lengths=(256,), max_chunks=1, divergence_tokens=8, progress=False)
    return df[df.source == "all"].set_index("format")


def test_study_baseline_is_exact_and_formats_within_bounds(table):
    df = table
    base = df.loc["fp32"]
    assert base.kld_mean == 0.0 and base.delta_nll == 0.0 and base.same_top1_pct == 100.0
    assert base.first_div_median == 8 and base.role == "base"
    bounds = {"fp16": 1e-5, "int8": 3e-3, "fp8_e4m3": 0.04, "int4_kivi": 0.05, "int4+rot": 0.1, "int4": 0.2,
              "kivi_g64/int4_g64+vrot": 0.06, "kiviq_g32/int4_g64+vrot": 0.05, "int4sym": 0.3}
    for fmt, b in bounds.items():
        assert 0 < df.loc[fmt].kld_mean < b, (fmt, df.loc[fmt].kld_mean)
    # keys per channel (KIVI) and rotation both beat plain per-token int4; int8 beats every 4-bit
    assert df.loc["int8"].kld_mean < df.loc["int4_kivi"].kld_mean < df.loc["int4"].kld_mean
    assert df.loc["int4+rot"].kld_mean < df.loc["int4"].kld_mean
    # 4.5 bits: KIVI keys over 64 tokens beat q4_0's layout (int4sym) and even 5-bit per-token int4
    assert df.loc["kivi_g64/int4_g64+vrot"].kld_mean < df.loc["int4"].kld_mean < df.loc["int4sym"].kld_mean
    assert df.loc["fp16"].role == "noise_floor" and set(df.n_tokens) == {3 * 127}


def test_describe_formats(smol):
    d = describe_formats(["int8", "int4_kivi"], smol).set_index("format")
    assert d.loc["int8"].bytes_per_token == 30 * 2 * 3 * 64 * 8.25 / 8
    assert d.loc["int4_kivi"].staging_bytes_per_seq == 30 * 3 * 64 * 16 * 2
    assert d.loc["int8"].tokens_per_gib == 2 ** 30 / d.loc["int8"].bytes_per_token
