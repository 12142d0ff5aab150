"""Calibration artefacts of split formats: per-layer KIVI channel widths and CB codebooks in a file.

A :class:`KVArtefact` holds entries fitted on calibration text (``paged.quant.artefact.fit``):

* ``k:<side>@bs<B>`` (a ``kivi<b>+alloc`` key side at block size ``B``): widths ``[L, H, D]`` int8;
* ``v:<side>`` (a ``cb<b>`` value side): levels ``[L, 2**b]`` float32;

and says which model they belong to: ``model_tag`` (``L<layers>xH<kv heads>xD<head_dim>``) and
``model_fingerprint`` (a hash of some of the model's weights; see ``paged.quant.artefact``). The
file is a safetensors file whose metadata holds those fields and the calibration text's name.

:meth:`KVArtefact.tables` builds a layer's :class:`~kernels.split.SplitTables`; every mismatch
(another model, a format or block size without an entry, a malformed table) is a
:class:`~kernels.errors.KVFormatError` that names the file and what to change.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import KVFormatError
from .format_table import CODE_CB, KVFormat, SideFormat

__all__ = ["KVArtefact", "k_key", "v_key"]


def k_key(side: SideFormat, block_size: int) -> str:
    return f"k:{side.name}@bs{block_size}"


def v_key(side: SideFormat) -> str:
    return f"v:{side.name}"


@dataclass
class KVArtefact:
    """Fitted per-layer tables of split formats for one model (see the module docstring)."""

    model_tag: str
    model_fingerprint: str
    source: str = ""
    num_tokens: int = 0
    entries: dict[str, torch.Tensor] = field(default_factory=dict)
    path: str = "<memory>"

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file
        meta = {"model_tag": self.model_tag, "model_fingerprint": self.model_fingerprint, "source": self.source,
                "num_tokens": str(self.num_tokens), "format": "paged-kv-artefact/1"}
        save_file({k: v.contiguous() for k, v in self.entries.items()}, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | Path) -> "KVArtefact":
        from safetensors import safe_open
        p = Path(path)
        if not p.is_file():
            raise KVFormatError(f"calibration file {p} does not exist; create it with "
                                "`python -m paged quant-calibrate --out FILE` (see docs/quant.md)")
        try:
            with safe_open(str(p), framework="pt") as f:
                meta = f.metadata() or {}
                entries = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:  # noqa: BLE001 - any unreadable file is the same user error
            raise KVFormatError(f"calibration file {p} is not a KV calibration artefact ({e}); recreate it with "
                                "`python -m paged quant-calibrate --out FILE`") from None
        if meta.get("format") != "paged-kv-artefact/1":
            raise KVFormatError(f"{p} is not a KV calibration artefact (no 'paged-kv-artefact/1' metadata); "
                                "recreate it with `python -m paged quant-calibrate --out FILE`")
        return cls(meta["model_tag"], meta["model_fingerprint"], meta.get("source", ""),
                   int(meta.get("num_tokens", 0)), entries, str(p))

    def check_model(self, model_tag: str, fingerprint: str) -> None:
        """KVFormatError unless this artefact was fitted on this model."""
        if model_tag != self.model_tag or fingerprint != self.model_fingerprint:
            raise KVFormatError(
                f"calibration file {self.path} was fitted on another model ({self.model_tag}, weights "
                f"{self.model_fingerprint[:12]}) than the one being served ({model_tag}, weights {fingerprint[:12]}); "
                "calibrate this model with `python -m paged quant-calibrate --model <model> --out FILE` and point "
                "PAGED_KV_CALIBRATION at FILE")

    def check_format(self, fmt: KVFormat, block_size: int) -> None:
        missing = [k for k, need in ((k_key(fmt.k_side, block_size), fmt.k_side.alloc),
                                     (v_key(fmt.v_side), fmt.v_side.code == CODE_CB))
                   if need and k not in self.entries]
        if missing:
            raise KVFormatError(
                f"calibration file {self.path} has no table for {missing} (kv format {fmt.name!r}, block_size "
                f"{block_size}); it holds {sorted(self.entries)}. Fit them with `python -m paged quant-calibrate --formats "
                f"'{fmt.name}' --block-size {block_size} --out {self.path} --update`, or pick a format/block size "
                "it holds")

    def tables(self, fmt: KVFormat, layer: int, num_layers: int, num_kv_heads: int, head_dim: int,
               block_size: int, device: torch.device | str = "cpu",
               rope: tuple[torch.Tensor, torch.Tensor] | None = None):
        """One layer's :class:`~kernels.split.SplitTables` for ``fmt`` (widths and codebook from
        this artefact, RoPE rows ``rope`` for ``+pre`` keys)."""
        from .cache import default_tables
        self.check_format(fmt, block_size)
        want = f"L{num_layers}xH{num_kv_heads}xD{head_dim}"
        if want != self.model_tag:
            raise KVFormatError(f"calibration file {self.path} is for a {self.model_tag} cache, not {want}; "
                                "calibrate the model being served")
        kw = lv = None
        if fmt.k_side.alloc:
            w = self.entries[k_key(fmt.k_side, block_size)]
            if tuple(w.shape) != (num_layers, num_kv_heads, head_dim):
                raise KVFormatError(f"{self.path}: widths {tuple(w.shape)} do not fit {want}; recalibrate")
            kw = w[layer].to(torch.int32)
        if fmt.v_side.code == CODE_CB:
            t = self.entries[v_key(fmt.v_side)]
            if tuple(t.shape) != (num_layers, 1 << fmt.v_side.bits):
                raise KVFormatError(f"{self.path}: codebook {tuple(t.shape)} does not fit {fmt.v_side.name} with "
                                    f"{num_layers} layers; recalibrate")
            lv = t[layer].float()
        return default_tables(fmt, num_kv_heads, head_dim, device, k_width=kw, v_levels=lv, rope=rope)

    def describe(self) -> str:
        return json.dumps({"model_tag": self.model_tag, "source": self.source, "num_tokens": self.num_tokens,
                           "entries": sorted(self.entries)})
