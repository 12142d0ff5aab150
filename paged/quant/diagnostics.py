"""Per-layer diagnostics: where a scheme's error comes from, layer by layer.

* :func:`layer_errors` — on the base run's own K/V (the forward continues unquantized, so each
  layer sees exact inputs): relative error ``|x̂ - x| / |x|`` and cosine of K and V, and the
  relative error of the attention output with K only, V only and both quantized.
* :func:`layer_sensitivity` — quantize one layer at a time (the others fp32) through the whole
  model: KLD of the scored tokens against the base.
* :func:`key_outliers` — per-channel key absmax per layer and KV head, excess kurtosis of each
  layer's keys, and the attention mass the queries put on the first token (the "sink").
"""
from __future__ import annotations

from typing import Mapping, Sequence

import pandas as pd
import torch

from .attention import QuantKVAttention, attend
from .codec import KiviKeyStore, hadamard, roundtrip
from .metrics import summarize, token_stats
from .runs import chunk_logits, load
from .schemes import Scheme
from .study import resolve_schemes
from .text import load_texts, make_chunks, scored_slice

__all__ = ["layer_errors", "layer_sensitivity", "key_outliers"]


def _stored(x: torch.Tensor, side, rot: torch.Tensor | None) -> torch.Tensor:
    """What the cache returns for ``x`` [T, H, D], in the unrotated frame."""
    y = x @ rot if rot is not None else x
    y = KiviKeyStore(side.group, compact=side.kind == "kiviq").append(y) if side.per_channel else roundtrip(y, side)
    return y @ rot.T if rot is not None else y


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


class _Probe:
    def __init__(self, schemes: Sequence[Scheme], head_dim: int) -> None:
        self.schemes = schemes
        self.rot = hadamard(head_dim)
        self.rows: list[dict] = []
        self.k: dict[int, torch.Tensor] = {}
        self.sink: dict[int, float] = {}

    def __call__(self, layer: int, q, k, v):
        q, k, v = q.float(), k.float(), v.float()
        out = attend(q, k, v)
        self.k[layer] = k
        rep = q.shape[1] // k.shape[1]
        scores = torch.einsum("thd,shd->hts", q, k.repeat_interleave(rep, 1)) / q.shape[-1] ** 0.5
        t = q.shape[0]
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        self.sink[layer] = float(torch.softmax(scores, -1)[:, 1:, 0].mean())
        for s in self.schemes:
            kq = _stored(k, s.k, self.rot if s.rotate_k else None)
            vq = _stored(v, s.v, self.rot if s.rotate_v else None)
            self.rows.append({
                "format": s.name, "layer": layer,
                "k_rel_err": _rel(kq, k), "v_rel_err": _rel(vq, v),
                "k_cos": float(torch.nn.functional.cosine_similarity(kq.flatten(), k.flatten(), 0)),
                "v_cos": float(torch.nn.functional.cosine_similarity(vq.flatten(), v.flatten(), 0)),
                "out_rel_err_k": _rel(attend(q, kq, v), out), "out_rel_err_v": _rel(attend(q, k, vq), out),
                "out_rel_err_kv": _rel(attend(q, kq, vq), out)})
        return out.to(q.dtype)


def _first_chunk(lm, texts, context_length: int):
    raw = load_texts(["kjv"]) if texts is None else dict(texts)
    return make_chunks(raw, lm.tokenizer, context_length, max_chunks=1, max_model_len=lm.max_model_len)


def _probe(model, formats, texts, context_length) -> _Probe:
    lm = load(model)  # outside inference mode: packing the weights reads their version counters
    schemes = [s for s in resolve_schemes(formats, lm.config.head_dim) if not s.is_base]
    probe = _Probe(schemes, lm.config.head_dim)
    ids = torch.tensor(_first_chunk(lm, texts, context_length)[0].ids)
    with torch.inference_mode():
        lm.model(ids, torch.arange(len(ids)), probe)
    return probe


def layer_errors(model=None, formats: str | Sequence[str] | None = None,
                 texts: Mapping[str, str] | None = None, context_length: int = 512) -> pd.DataFrame:
    """One row per (format, layer) on the first chunk of ``texts`` (None = the KJV prose)."""
    df = pd.DataFrame(_probe(model, formats, texts, context_length).rows)
    df.insert(0, "context_length", context_length)
    return df


def key_outliers(model=None, texts: Mapping[str, str] | None = None, context_length: int = 512
                 ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(channels, layers)``: per (layer, kv_head, channel) key absmax; per layer the excess
    kurtosis of its keys, the largest channel absmax over the median one, and the mean
    attention probability on the first token (queries at positions >= 1)."""
    probe = _probe(model, ["fp16"], texts, context_length)
    ch, lay = [], []
    for layer, k in sorted(probe.k.items()):
        amax = k.abs().amax(0)  # [H, D]
        for h in range(amax.shape[0]):
            ch += [{"layer": layer, "kv_head": h, "channel": c, "absmax": float(amax[h, c])}
                   for c in range(amax.shape[1])]
        x = k.flatten()
        z = (x - x.mean()) / x.std()
        lay.append({"layer": layer, "kurtosis": float((z ** 4).mean() - 3),
                    "channel_absmax_ratio": float(amax.max() / amax.median()),
                    "first_token_attention": probe.sink[layer]})
    return pd.DataFrame(ch), pd.DataFrame(lay)


def layer_sensitivity(model=None, formats: str | Sequence[str] | None = ("int4",),
                      texts: Mapping[str, str] | None = None, context_length: int = 512,
                      layers: Sequence[int] | None = None) -> pd.DataFrame:
    """KLD (and ΔNLL) when only one layer is quantized, per (format, layer), first chunk of ``texts``.
    Costs one forward per format and layer (``chunk_logits`` runs in inference mode)."""
    lm = load(model)
    cfg = lm.config
    chunk = _first_chunk(lm, texts, context_length)[0]
    rows_sl = scored_slice(context_length)
    targets = torch.tensor(chunk.ids[rows_sl.start + 1:rows_sl.stop + 1])
    base = chunk_logits(lm.model, chunk.ids, QuantKVAttention("fp32", cfg.num_layers, cfg.head_dim), rows_sl)
    out = []
    for s in [s for s in resolve_schemes(formats, cfg.head_dim) if not s.is_base]:
        for layer in (range(cfg.num_layers) if layers is None else layers):
            cache = QuantKVAttention(s, cfg.num_layers, cfg.head_dim, layers=[layer])
            st = summarize(token_stats(base, chunk_logits(lm.model, chunk.ids, cache, rows_sl), targets))
            out.append({"format": s.name, "layer": layer, "kld_mean": st["kld_mean"],
                        "delta_nll": st["delta_nll"], "same_top1_pct": st["same_top1_pct"]})
    return pd.DataFrame(out)
