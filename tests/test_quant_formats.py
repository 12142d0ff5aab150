"""The 4.5-bit candidates of the study: V-only rotation (``+vrot``), symmetric int4 (``int4sym``,
q4_0's layout), KIVI key groups over N tokens and how the engine serves them. No model needed."""
from __future__ import annotations

import pytest
import torch

from paged.errors import ConfigError
from paged.quant import parse_scheme
from paged.quant.attention import QuantKVAttention
from paged.quant.codec import int4sym_roundtrip


def test_grammar_bits_and_engine_settings():
    hd = 64
    for name in ("kivi_g64/int4_g64", "kivi_g64/int4_g64+vrot", "kivi_g64/int4sym", "int4sym", "int4sym_g64+vrot",
                 "kivi_g64/int4_g64+rot", "kivi_g32/int4"):
        assert parse_scheme(name).name == name
    s = parse_scheme("kivi_g64/int4sym+vrot")
    assert (s.rotate, s.vrot, s.rotate_k, s.rotate_v) == (False, True, False, True)
    assert (parse_scheme("int4+rot").rotate_k, parse_scheme("int4+rot").rotate_v) == (True, True)
    assert parse_scheme("int4sym").bits_per_value(hd) == 4.5          # 4 + fp16 scale / 32
    assert parse_scheme("int4sym_g64").bits_per_value(hd) == 4.25
    assert parse_scheme("kivi_g64/int4_g64").bits_per_value(hd) == 4.5  # K 4 + 32/64, V 4 + 32/64
    assert parse_scheme("kivi_g32/int4_g64").bits_per_value(hd) == 4.75
    # served: KIVI over N tokens is int4_kivi with block_size=N; study-only sides are not
    assert parse_scheme("kivi_g32/int4").engine_kwargs == {"kv_cache_dtype": "int4_kivi", "block_size": 32}
    assert parse_scheme("int4_kivi").engine_kwargs == {"kv_cache_dtype": "int4_kivi", "block_size": 16}
    assert parse_scheme("int8").engine_kwargs == {"kv_cache_dtype": "int8"}
    for name in ("kivi_g64/int4_g64", "kivi_g48/int4", "int4sym", "int4+vrot", "int8/int4", "kivi_g32/int4+vrot"):
        assert parse_scheme(name).engine_kwargs is None, name
    assert parse_scheme("int4sym").engine_format is None


@pytest.mark.parametrize("bad, match", [("int4sym_g48", "divide head_dim"), ("int4+rot+vrot", "one suffix"),
                                        ("int8_g32", "take '_gN'"), ("int4sym/kivi", "keys per channel")])
def test_bad_names(bad, match):
    with pytest.raises(ConfigError, match=match):
        parse_scheme(bad).check(64)


def test_rotations_are_exact_without_quantization():
    """(qH)(kH)^T = qk^T and softmax(.)(vH)H^T = softmax(.)v: fp32 sides give fp32's output."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(12, h, 64, generator=g) for h in (6, 2, 2))
    ref = QuantKVAttention("fp32", 1, 64)(0, q, k, v)
    for name in ("fp32+rot", "fp32+vrot"):
        assert (QuantKVAttention(name, 1, 64)(0, q, k, v) - ref).abs().max() < 1e-5, name


def test_vrot_keeps_keys_and_rotates_values():
    """+vrot stores K exactly as the unrotated scheme (same per-channel codes) and only V in the
    rotated frame; +rot rotates both."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(40, h, 64, generator=g) for h in (6, 2, 2))
    plain, vrot, rot = (QuantKVAttention(f"kivi_g32/int4_g64{s}", 1, 64) for s in ("", "+vrot", "+rot"))
    for c in (plain, vrot, rot):
        c(0, q, k, v)
    assert torch.equal(plain.k[0], vrot.k[0]) and not torch.equal(plain.k[0], rot.k[0])
    assert not torch.equal(plain.v[0], vrot.v[0])


def test_int4sym_error_bound_and_extremes():
    """q4_0's rule: d = m / -8 (m the signed value of largest magnitude, d in fp16), codes -8..7.
    Each value is off by at most |d| (half a step by rounding, one step where +8 clips to +7);
    the extreme value is exact up to d's fp16 rounding; zeros stay zero."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(50, 3, 64, generator=g) * torch.logspace(-2, 1, 64)
    for group in (16, 32, 64):
        y = int4sym_roundtrip(x, group)
        xg, yg = x.reshape(50, 3, -1, group), y.reshape(50, 3, -1, group)
        amax = xg.abs().amax(-1, keepdim=True)
        assert ((xg - yg).abs() <= amax / 8 * 1.002 + 1e-7).all(), group
        i = xg.abs().argmax(-1, keepdim=True)
        assert torch.allclose(xg.gather(-1, i), yg.gather(-1, i), rtol=1e-3)
    assert torch.equal(int4sym_roundtrip(torch.zeros(2, 1, 32), 32), torch.zeros(2, 1, 32))
    with pytest.raises(ValueError, match="divide"):
        int4sym_roundtrip(x, 48)


def test_kiviq_compressed_scales_cover_the_range():
    """kiviq: each channel's 16 codes still span [min, max] (zero floored to a 7-bit multiple of
    Z = max|min|/63, step ceiled to an 8-bit multiple of S = max step/255), so the error per value
    is at most half a step: <= ((max - min) + Z) / 30 + S / 2, i.e. plain KIVI's half step plus
    one zero and one scale quantum. 4 + 15/N + 32/(N*D) bits; study only."""
    from paged.quant.codec import kiviq_roundtrip
    g = torch.Generator().manual_seed(3)
    k = torch.randn(32, 3, 64, generator=g) * torch.logspace(-1, 1, 64) + 5 * torch.randn(64, generator=g)
    y = kiviq_roundtrip(k)
    lo, hi = k.amin(0), k.amax(0)
    z_q = lo.abs().amax(-1, keepdim=True) / 63
    s_q = ((hi - lo + z_q) / 15).amax(-1, keepdim=True) / 255
    bound = (hi - lo + z_q) / 30 + s_q / 2
    assert ((y - k).abs().amax(0) <= bound * 1.01 + 1e-6).all()
    s = parse_scheme("kiviq_g32/int4_g64+vrot")
    assert s.name == "kiviq_g32/int4_g64+vrot" and s.engine_kwargs is None
    assert s.k.bits(64) == 4 + 15 / 32 + 32 / (32 * 64) and s.bits_per_value(64) < 4.5
    with pytest.raises(ConfigError, match="keys per channel"):
        parse_scheme("int4/kiviq")


def test_engine_settings_for_served_and_study_only_names():
    from paged.quant.schemes import engine_settings
    assert engine_settings("kivi_g32/int4") == {"kv_cache_dtype": "int4_kivi", "block_size": 32}
    assert engine_settings("int8") == {"kv_cache_dtype": "int8"}
    assert engine_settings("auto") == {"kv_cache_dtype": "auto"}
    frac = "kivi2.5+pre+alloc+q8/cb2+rot@sink4@win32"  # a spelled split format, as an alias would be
    assert engine_settings(frac) == engine_settings("kvq2") | {"kv_cache_dtype": frac}
    for bad in ("int4+rot", "int8/int4", "kiviq_g32/int4_g64", "kivi_g64/int4_g64"):
        with pytest.raises(ConfigError, match="only in the study"):
            engine_settings(bad)
    with pytest.raises(ConfigError, match="unknown KV format"):
        engine_settings("bogus")
