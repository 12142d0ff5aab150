"""The quantization lab: KV formats built from independent switches, for ablations.

A :class:`LabSpec` is a K :class:`SideSpec`, a V :class:`SideSpec` and cache-wide switches; every
switch can be turned on alone or with the others, so an ablation can measure each one:

* ``pre_rope`` (keys): quantize the key before RoPE (RoPE undone with the model's own tables on
  write and applied again on read);
* ``center``: subtract a per-channel mean calibrated on the calibration text;
* ``weight``: scale channels before quantizing (``"std"``: by ``1/sigma``; ``"fisher"``: by
  ``(w/s)^(1/4)``, the error-aware weights of :meth:`Calibration.channel_weights`), undone on read;
* ``rot``: a Hadamard rotation of head_dim (per head), undone on read;
* ``levels``: ``"int"`` uniform asymmetric (fp16 scale + zero per group, the kernels' int4 rule
  at any bit width), ``"sym"`` uniform symmetric (fp16 absmax per group), ``"lloyd"`` a Lloyd-Max
  codebook per layer and side fitted on the calibration text, ``"normal"`` the Lloyd-Max codebook
  of Gaussian vectors (no calibration);
* ``axis``: ``"token"`` (groups of ``group`` values along head_dim) or ``"channel"`` (KIVI: per
  channel over ``group`` tokens, the unfilled group kept exact);
* ``outliers``: the ``outliers`` largest values of each token-head kept exactly (dense-and-sparse);
  ``sparse`` (KIVI keys): that many per group x head, left out of the channel ranges
  (:mod:`paged.quant.lab_sparse`); ``alloc_heads``: ``alloc``'s bits pooled over a layer's heads
  by their query-weighted error (:mod:`paged.quant.lab_heads`), the layer's mean unchanged;
  ``qjl`` (KIVI keys): an m-bit sign sketch of each token-head's residual and its norm (in
  ``scale_bits``), read back as QJL's unbiased estimate (:mod:`paged.quant.lab_qjl`);
* ``sink`` / ``window`` (cache-wide): the first ``sink`` tokens, and for each query the keys and
  values of the ``window`` positions ending at it, read exactly (each query sees what a
  token-by-token decode would: a teacher-forced pass never reads unquantized states otherwise);
  ``v_window`` gives the values a window of their own (0: values read exact only in the sink);
  ``k_stage`` / ``v_stage`` store the keys' / values' window rows with a finer per-token side
  instead of fp16 (the sink stays fp16);
* ``layers``: per-layer overrides of the two sides (mixed precision by layer sensitivity).

Bits per value (:meth:`LabSpec.bits`) count everything stored per token: codes, scales, zero
points, sparse outliers (16-bit value + index), KIVI's unfilled fp16 group and the sink and
window tokens (an fp16 copy beside their codes, or a ``k_stage`` / ``v_stage`` one), amortised
over ``context`` tokens (2,048 unless told). Per-layer constants (means, weights, codebooks) are
not per token and are not counted.

Invariant: every side is a per-token map except ``axis="channel"``; the stored value of a token
does not depend on later tokens except within a KIVI group, as in the engine.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from paged.errors import ConfigError
from .lab_qjl import qjl_bits
from .lab_sparse import sparse_bits

__all__ = ["SideSpec", "LabSpec", "EXACT", "LEVELS"]

LEVELS = ("int", "sym", "lloyd", "normal")


@dataclass(frozen=True, slots=True)
class SideSpec:
    """How K or V is stored (see the module docstring). ``bits >= 16`` means exact (fp32/fp16)."""

    bits: float = 32            # a KIVI side with alloc may take a fractional mean (e.g. 2.75)
    levels: str = "int"
    axis: str = "token"
    group: int = 64
    rot: bool = False
    pre_rope: bool = False
    center: bool = False
    weight: str = "none"
    scale: str = "absmax"       # codebook scale per group: "absmax" or "rms"
    outliers: int = 0
    scale_bits: int = 16
    pca: bool = False           # static per-head KLT (eigenvectors of the calibration covariance)
    alloc: bool = False         # bits per channel (stored frame) by greedy rate allocation, mean = bits
    sparse: int = 0             # KIVI keys: outliers per group x head kept in fp16 (paged.quant.lab_sparse)
    alloc_heads: bool = False   # alloc pooled over the heads of a layer (paged.quant.lab_heads)
    qjl: int = 0                # KIVI keys: m-bit sign sketch of the residual + its norm (paged.quant.lab_qjl)

    @property
    def exact(self) -> bool:
        return self.bits >= 16

    @property
    def name(self) -> str:
        if self.exact:
            return f"fp{self.bits}"
        kind = ("kivi" + ("" if self.levels == "int" else self.levels)) if self.axis == "channel" else self.levels
        flags = ((self.pre_rope, "pre"), (self.center, "ctr"), (self.rot, "rot"), (self.scale == "rms", "rms"),
                 (self.scale_bits != 16, f"s{self.scale_bits}"), (self.weight != "none", f"w{self.weight}"),
                 (self.outliers, f"o{self.outliers}"), (self.pca, "pca"), (self.alloc, "alloc"),
                 (self.alloc_heads, "heads"), (self.sparse, f"sp{self.sparse}"), (self.qjl, f"qjl{self.qjl}"))
        return f"{kind}{self.bits}_g{self.group}" + "".join("+" + tag for flag, tag in flags if flag)

    def check(self, head_dim: int, side: str) -> None:
        """Raise ConfigError for a combination the lab does not define."""
        if self.exact:
            return
        if self.levels not in LEVELS or self.axis not in ("token", "channel") or self.weight not in (
                "none", "std", "fisher", "q") or self.scale not in ("absmax", "rms"):
            raise ConfigError(f"bad side spec {self}")
        if not 1 <= self.bits <= 8:
            raise ConfigError(f"{self.name}: bits must be 1..8 (or >= 16 for exact)")
        if self.bits != int(self.bits) and not (self.alloc and self.axis == "channel"):
            raise ConfigError(f"{self.name}: a fractional mean of bits needs per-channel keys with alloc")
        if self.axis == "token" and head_dim % self.group:
            raise ConfigError(f"{self.name}: group {self.group} must divide head_dim {head_dim}")
        if self.axis == "channel" and (side != "k" or self.levels not in ("int", "lloyd") or self.outliers):
            raise ConfigError(f"{self.name}: per-channel (KIVI) groups are for keys, int or lloyd levels, no outliers")
        if self.qjl and self.axis != "channel":
            raise ConfigError(f"{self.name}: the qjl residual is for per-channel (KIVI) keys")
        if self.sparse and self.axis != "channel":
            raise ConfigError(f"{self.name}: sparse outliers are for per-channel (KIVI) keys; use outliers")
        if self.alloc_heads and not (self.alloc and self.axis == "channel" and not (self.rot or self.pca)):
            raise ConfigError(f"{self.name}: alloc_heads pools alloc's bits over heads: per-channel keys with "
                              "alloc, without rot or pca (their channels are not the query's)")
        if self.pre_rope and side != "k":
            raise ConfigError(f"{self.name}: pre_rope is a key switch")

    def bits_per_value(self, head_dim: int) -> float:
        """Bits of codes, scales, zero points and outliers per value (staging: :meth:`LabSpec.bits`)."""
        if self.exact:
            return float(self.bits)
        b = float(self.bits)
        if self.axis == "channel":  # step + zero per channel and group (fp16, or 8 + 7-bit codes under
            side = 32.0 if self.scale_bits == 16 else 15.0 + 32.0 / head_dim  # two fp16 per-head scales)
            return (b + side / self.group + sparse_bits(self.sparse, self.group, head_dim)
                    + qjl_bits(self.qjl, self.scale_bits, head_dim))
        if self.alloc:  # one rms scale per token-head, static per-channel steps
            return b + float(self.scale_bits) / head_dim
        b += (32.0 if self.levels == "int" else float(self.scale_bits)) / self.group
        if self.outliers:
            b += self.outliers * (16 + math.ceil(math.log2(head_dim))) / head_dim
        return b


EXACT = SideSpec()


@dataclass(frozen=True, slots=True)
class LabSpec:
    """K side, V side, exact sink/window tokens, per-layer overrides ``{layer: (k, v)}``."""

    k: SideSpec = EXACT
    v: SideSpec = EXACT
    sink: int = 0
    window: int = 0
    v_window: int | None = None  # the values' own window (None: ``window``)
    k_stage: SideSpec | None = None  # how the keys' window rows are kept (None: fp16)
    v_stage: SideSpec | None = None  # how the values' window rows are kept (None: fp16)
    layers: tuple[tuple[int, SideSpec, SideSpec], ...] = ()
    label: str = ""
    block: int = 32             # cache block (tokens) for the staging count; a KIVI key group is one block

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        base = self.k.name if self.k == self.v else f"{self.k.name}/{self.v.name}"
        flags = ((self.sink, f"@sink{self.sink}"), (self.window, f"@win{self.window}"),
                 (self.v_window is not None, f"@vwin{self.v_window}"),
                 (self.k_stage, f"@kstage[{self.k_stage.name if self.k_stage else ''}]"),
                 (self.v_stage, f"@vstage[{self.v_stage.name if self.v_stage else ''}]"),
                 (self.layers, f"@{len(self.layers)}layers"))
        return base + "".join(tag for flag, tag in flags if flag)

    def sides(self, layer: int) -> tuple[SideSpec, SideSpec]:
        return next(((k, v) for i, k, v in self.layers if i == layer), (self.k, self.v))

    def bits(self, num_layers: int, head_dim: int, context: int = 2048) -> tuple[float, float, float]:
        """``(k bits, v bits, mean)`` per value averaged over layers, amortised at ``context`` tokens.

        Staging, in fp16 per sequence (``k_stage`` / ``v_stage``: at that side's bits): with a
        window, the blocks that overlap it (at most ``window + block`` tokens) for each side that
        has one; keys without a window, KIVI's one unfilled key block; the sink tokens for K and V both."""
        kb = sum(self.sides(i)[0].bits_per_value(head_dim) for i in range(num_layers)) / num_layers
        vb = sum(self.sides(i)[1].bits_per_value(head_dim) for i in range(num_layers)) / num_layers
        kivi = any(self.sides(i)[0].axis == "channel" and not self.sides(i)[0].exact for i in range(num_layers))
        if self.window:
            stage = 16.0 if self.k_stage is None else self.k_stage.bits_per_value(head_dim)
            kb += stage * (self.window + self.block) / context
        if self.values_window:
            stage = 16.0 if self.v_stage is None else self.v_stage.bits_per_value(head_dim)
            vb += stage * (self.values_window + self.block) / context
        if kivi and not self.window:
            kb += 16.0 * self.block / context
        kb, vb = kb + 16.0 * self.sink / context, vb + 16.0 * self.sink / context
        return kb, vb, (kb + vb) / 2

    def check(self, head_dim: int) -> None:
        """Raise ConfigError for a cache-wide combination the lab does not define."""
        if self.v_stage is not None:
            self.v_stage.check(head_dim, "v")
            if self.v_stage.exact or self.v_stage.axis != "token" or not self.values_window:
                raise ConfigError(f"{self.name}: v_stage is a quantized per-token side for the values' "
                                  "window; give the values a window (window or v_window > 0) and bits < 16")
        if self.k_stage is not None:
            self.k_stage.check(head_dim, "k")
            if self.k_stage.exact or self.k_stage.axis != "token" or self.window < self.block:
                raise ConfigError(f"{self.name}: k_stage is a quantized per-token side for the keys' window; "
                                  f"give a window of at least the block ({self.block}) and bits < 16")

    @property
    def values_window(self) -> int:
        return self.window if self.v_window is None else self.v_window

    def k_only(self) -> "LabSpec":
        return replace(self, v=EXACT, layers=tuple((i, k, EXACT) for i, k, _ in self.layers), label="")

    def v_only(self) -> "LabSpec":
        return replace(self, k=EXACT, layers=tuple((i, EXACT, v) for i, _, v in self.layers), label="")
