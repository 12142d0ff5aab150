"""KV quantization schemes of the study: a format for K, one for V, and an optional rotation.

A scheme name is ``SIDE`` (same format for K and V) or ``K/V`` (keys and values apart), with an
optional ``+rot`` suffix (a normalised Hadamard rotation of K, Q and V along head_dim before
caching; attention scores are unchanged because ``(qH)(kH)^T = q k^T`` for orthogonal ``H``) or
``+vrot`` (V only: the cache stores ``vH`` and the attention output is rotated back by ``H^T``,
exact because the output is linear in V; keys keep their channels for per-channel scales)::

    SIDE := fp32 | fp16 | bf16                       baselines (bits 32 / 16)
          | fp8_e4m3 | fp8_e5m2 [_cal]              fp8, per-head scale 1.0, or calibrated (_cal)
          | int8                                     symmetric, fp16 scale per token-head
          | int4 [_gN]                               asymmetric, fp16 scale + zero per N values (32)
          | int4sym [_gN]                            symmetric (q4_0-like), fp16 scale per N values
                                                     (32), codes -8..7, study only (no engine format)
          | kivi [_gN]                               keys only: int4 per channel over N tokens
                                                     (16 = the engine's block), the unfilled group
                                                     kept unquantized
          | kiviq [_gN]                              kivi with compressed scales: per channel an
                                                     8-bit scale code and a 7-bit zero code under
                                                     fp16 super-scales per (group, head); study only

``int4_kivi`` is the engine's name for ``kivi/int4``. Every side maps to a format of
:mod:`kernels.formats` and is quantized with the kernels' own reference codecs, so a scheme whose
K and V share an engine format reproduces what ``paged.LLM(kv_cache_dtype=...)`` stores.

Bits per value and bytes per token are exact steady-state storage costs including scales and
zero points; ``staging_bytes`` is the one unfilled KIVI block per sequence (fp16 when served).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from paged.errors import ConfigError

__all__ = ["Side", "Scheme", "parse_scheme", "engine_settings", "DEFAULT_SCHEMES", "NOISE_FLOOR", "BASE", "KIVI_BLOCK"]

KIVI_BLOCK = 16  # the engine's default block_size: one KIVI key group
BASE = "fp32"
NOISE_FLOOR = ("fp16", "bf16")
_FP8 = {"fp8_e4m3", "fp8_e5m2"}
_SIDE = re.compile(r"^(fp32|fp16|bf16|fp8_e4m3|fp8_e5m2|int8|int4sym|int4|kiviq|kivi)(_cal)?(?:_g(\d+))?$")
_GROUPED = ("int4", "int4sym", "kivi", "kiviq")
_PER_CHANNEL = ("kivi", "kiviq")

# The study's default list (base first, then the noise floor, then by bits per value).
DEFAULT_SCHEMES = (
    "fp32", "fp16", "bf16",
    "fp8_e4m3", "fp8_e4m3_cal", "fp8_e5m2", "fp8_e5m2_cal",
    "int8", "int8+rot", "int8/fp16", "fp16/int8",
    "int8/int4", "int8/int4_g64",
    "int4_kivi", "kivi_g32/int4", "kivi_g32/int4_g64", "int4", "int4+rot", "int4_g64", "int4_g64+rot",
)


@dataclass(frozen=True, slots=True)
class Side:
    """How one of K or V is stored. ``kernel_format`` names the :mod:`kernels.formats` entry."""

    kind: str              # fp32 fp16 bf16 fp8_e4m3 fp8_e5m2 int8 int4 int4sym kivi
    group: int = 32        # int4/int4sym values per scale(/zero) group; kivi: tokens per key group
    calibrated: bool = False  # fp8: per-head scales from a calibration pass (else 1.0)

    @property
    def kernel_format(self) -> str | None:
        """The kernels' format name, None for study-only sides (int4sym, kiviq)."""
        if self.kind in ("int4sym", "kiviq"):
            return None
        return "int4_kivi" if self.kind == "kivi" else self.kind

    @property
    def per_channel(self) -> bool:
        """Keys quantized per channel over groups of tokens (KIVI)."""
        return self.kind in _PER_CHANNEL

    @property
    def name(self) -> str:
        s = self.kind + ("_cal" if self.calibrated else "")
        default = KIVI_BLOCK if self.per_channel else 32
        return s + (f"_g{self.group}" if self.kind in _GROUPED and self.group != default else "")

    def bits(self, head_dim: int) -> float:
        """Exact stored bits per value, side tensors included (per-head fp8 scales: 0 per token)."""
        if self.kind == "fp32":
            return 32.0
        if self.kind in ("fp16", "bf16"):
            return 16.0
        if self.kind in _FP8:
            return 8.0
        if self.kind == "int8":
            return 8.0 + 16.0 / head_dim
        if self.kind == "int4sym":
            return 4.0 + 16.0 / self.group  # fp16 scale, no zero point
        if self.kind == "kiviq":  # 8 + 7 bits per channel and group, two fp16 super-scales per group-head
            return 4.0 + 15.0 / self.group + 32.0 / (self.group * head_dim)
        return 4.0 + 32.0 / self.group  # int4, kivi: fp16 scale + zero per group (kivi: per channel)

    def check(self, head_dim: int) -> None:
        if self.per_channel and self.group < 2:
            raise ConfigError(f"kivi key group {self.group} must be >= 2 tokens (the engine uses its block size, 16)")
        if self.kind in ("int4", "int4sym") and (self.group < 2 or self.group % 2 or head_dim % self.group):
            raise ConfigError(f"{self.kind} group {self.group} must be even and divide head_dim {head_dim}; "
                              f"use one of {[g for g in (8, 16, 32, 64, 128) if head_dim % g == 0]}")


@dataclass(frozen=True, slots=True)
class Scheme:
    """K side, V side and rotation (``rotate``: Q, K and V; ``vrot``: V only, the output rotated
    back). ``name`` round-trips through :func:`parse_scheme`."""

    k: Side
    v: Side
    rotate: bool = False
    vrot: bool = False

    @property
    def rotate_k(self) -> bool:
        return self.rotate

    @property
    def rotate_v(self) -> bool:
        return self.rotate or self.vrot

    @property
    def name(self) -> str:
        if self.k == Side("kivi", KIVI_BLOCK) and self.v == Side("int4") and not (self.rotate or self.vrot):
            return "int4_kivi"
        body = self.k.name if self.k == self.v else f"{self.k.name}/{self.v.name}"
        return body + ("+rot" if self.rotate else "+vrot" if self.vrot else "")

    @property
    def is_base(self) -> bool:
        return self.k.kind == self.v.kind == "fp32" and not (self.rotate or self.vrot)

    @property
    def engine_format(self) -> str | None:
        """The ``kv_cache_dtype`` the engine serves this scheme with, or None if it has none."""
        if (self.rotate or self.vrot or self.k.calibrated or self.v.calibrated
                or self.k.kernel_format is None or self.v.kernel_format is None):
            return None
        if self.k == Side("kivi", KIVI_BLOCK) and self.v == Side("int4"):
            return "int4_kivi"
        if self.k == self.v and self.k.kind != "kivi" and self.k.group == 32:
            return self.k.kernel_format
        return None

    @property
    def engine_kwargs(self) -> dict | None:
        """``paged.LLM`` settings that serve exactly this scheme, or None if the engine cannot.

        KIVI keys over N tokens are the engine's ``int4_kivi`` with ``block_size=N`` (its key
        group is one block; N a power of two); other engine formats take any block size.
        """
        if self.k.per_channel:
            n = self.k.group
            if self.k.kind != "kivi" or self.v != Side("int4") or self.rotate or self.vrot or n & (n - 1):
                return None
            return {"kv_cache_dtype": "int4_kivi", "block_size": n}
        fmt = self.engine_format
        return None if fmt is None else {"kv_cache_dtype": fmt}

    def bits_per_value(self, head_dim: int) -> float:
        return (self.k.bits(head_dim) + self.v.bits(head_dim)) / 2

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> float:
        """Steady-state bytes one token holds in every layer, K and V, side tensors included."""
        return num_layers * num_kv_heads * head_dim * 2 * self.bits_per_value(head_dim) / 8

    def staging_bytes(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """Per-sequence bytes of unquantized KIVI key staging (one fp16 group), else 0."""
        return num_layers * num_kv_heads * head_dim * self.k.group * 2 if self.k.per_channel else 0

    def tokens_per_gib(self, num_layers: int, num_kv_heads: int, head_dim: int, context: int) -> float:
        """Tokens a GiB of cache holds for sequences of ``context`` tokens (staging amortised)."""
        per = self.bytes_per_token(num_layers, num_kv_heads, head_dim)
        per += self.staging_bytes(num_layers, num_kv_heads, head_dim) / max(context, 1)
        return 2 ** 30 / per

    def check(self, head_dim: int) -> None:
        self.k.check(head_dim)
        self.v.check(head_dim)


def _side(text: str, whole: str, what: str) -> Side:
    m = _SIDE.match(text)
    if not m:
        raise ConfigError(f"unknown KV format {whole!r}: {what} {text!r} is not one of fp32, fp16, bf16, "
                          "fp8_e4m3[_cal], fp8_e5m2[_cal], int8, int4[_gN], int4sym[_gN], kivi[_gN] (keys only); "
                          "e.g. 'int8', 'int8/int4', 'int4_g64+rot', 'kivi_g64/int4_g64+vrot', 'int4_kivi'")
    kind, cal, group = m.group(1), bool(m.group(2)), m.group(3)
    if cal and kind not in _FP8:
        raise ConfigError(f"{whole!r}: only fp8 formats take '_cal' (calibrated per-head scales)")
    if group is not None and kind not in _GROUPED:
        raise ConfigError(f"{whole!r}: only int4/int4sym (values per group) and kivi (tokens per key group) "
                          "take '_gN'")
    return Side(kind, int(group) if group else (KIVI_BLOCK if kind == "kivi" else 32), cal)


def parse_scheme(name: "str | Scheme") -> Scheme:
    """``"int8"``, ``"int8/int4"``, ``"int4_g64+rot"``, ``"kivi_g64/int4_g64+vrot"``, ``"int4_kivi"``,
    ``"kivi/int4"`` -> Scheme."""
    if isinstance(name, Scheme):
        return name
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"a KV format must be a non-empty string such as 'int8', got {name!r}")
    text = name.strip().lower()
    rotate, vrot = text.endswith("+rot") and not text.endswith("+vrot"), text.endswith("+vrot")
    body = text.removesuffix("+vrot") if vrot else text.removesuffix("+rot")
    if "+" in body:
        raise ConfigError(f"unknown KV format {name!r}: one suffix at most, '+rot' (Q, K, V) or '+vrot' (V only)")
    if body == "int4_kivi":
        body = "kivi/int4"
    parts = body.split("/")
    if len(parts) > 2:
        raise ConfigError(f"unknown KV format {name!r}: use 'K/V' with one '/' at most")
    k = _side(parts[0], name, "K side" if len(parts) == 2 else "format")
    v = _side(parts[-1], name, "V side") if len(parts) == 2 else k
    if v.per_channel:
        raise ConfigError(f"{name!r}: 'kivi' quantizes keys per channel; values use 'int4' (e.g. 'kivi/int4')")
    if k.per_channel and len(parts) == 1:
        k, v = k, Side("int4")
    return Scheme(k, v, rotate, vrot)


def _is_split(name: str) -> bool:
    from kernels import KVFormatError, get_format
    try:
        return get_format(name).split
    except KVFormatError:
        return False


def engine_settings(name: "str | Scheme") -> dict:
    """``paged.LLM`` keyword arguments that serve ``name``: a study scheme the engine stores exactly
    (``"kivi_g32/int4"`` -> ``kv_cache_dtype="int4_kivi", block_size=32``), or an engine format
    name the study does not spell (``"auto"``, ``"kivi"``, an alias such as ``"kvq3"`` or a spelled split
    format such as ``"kivi2.5+pre+alloc+q8/cb2+rot@sink4@win32"``) passed through as ``kv_cache_dtype``.
    A study-only scheme (rotation, K/V apart, int4sym, kiviq, int4 groups other than 32) is a
    ConfigError naming the nearest served format."""
    try:
        s = parse_scheme(name)
    except ConfigError:
        from kernels import KVFormatError, get_format
        from kernels.format_table import ALIASES, FRONT_BLOCK_SIZE  # the engine's other spellings of its formats
        if isinstance(name, str) and (name.strip().lower() == "auto" or name.strip().lower() in ALIASES
                                      or "/" in name and _is_split(name)):
            try:
                f = get_format(name)
            except KVFormatError:
                return {"kv_cache_dtype": name}
            if f.split:  # the study measured split formats at block 32; a sink or window needs prefix caching off
                kw = {"kv_cache_dtype": name, "block_size": FRONT_BLOCK_SIZE}
                return kw | ({"enable_prefix_caching": False} if f.sink or f.window else {})
            return {"kv_cache_dtype": name}
        raise
    kw = s.engine_kwargs
    if kw is None:
        raise ConfigError(f"{s.name!r} exists only in the study's cache (rotations, separate K/V formats, "
                          "int4sym, kiviq and int4 groups other than 32 are not engine formats); serve e.g. "
                          "'int8', 'int4', 'int4_kivi' or 'kivi_g32/int4' (int4_kivi with block_size=32)")
    return dict(kw)
