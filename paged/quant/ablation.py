"""Ablations of lab formats (:mod:`paged.quant.lab`) with llama-perplexity's KL protocol.

:class:`Evaluator` holds the evaluation chunks and their base logits (fp32 weights, exact fp32
cache; computed once and kept on disk under ``cache_dir`` keyed by the chunk's tokens), and
scores any number of :class:`~paged.quant.lab.LabSpec` against them: KLD mean with two standard
errors (per token, as llama.cpp prints it, and per chunk: the spread of chunk means, which also
covers text-to-text variation), ΔNLL and same-top-1, per source and pooled (``"all"``), plus the
spec's bits per value amortised at 2,048 tokens.

Chunks follow :func:`paged.quant.text.make_chunks`; the fitted parts of a spec come from a
:class:`~paged.quant.calibration.Calibration` of the calibration text, never from these chunks.
"""
from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np
import pandas as pd
import torch

from .attention import QuantKVAttention
from .calibration import Calibration
from .lab import LabCache, LabSpec
from .metrics import TokenStats, summarize, token_stats
from .schemes import Scheme
from .runs import chunk_logits
from .text import Chunk, load_texts, make_chunks, scored_slice

__all__ = ["Evaluator", "eval_chunks", "PROTOCOLS"]

# name -> {source: (context_length, number of chunks)}; "lic19" is the llama.cpp comparison
PROTOCOLS: dict[str, dict[str, tuple[int, int]]] = {
    "screen": {"licenses": (512, 4), "kjv": (512, 2), "python": (512, 2)},
    "lic19": {"licenses": (512, 19)},
    "x512": {"kjv": (512, 8), "python": (512, 8)},
    "x2048": {"kjv": (2048, 2), "python": (2048, 2)},
}


def eval_chunks(lm, protocol: str | Mapping[str, tuple[int, int]]) -> list[Chunk]:
    """The chunks of a protocol (a :data:`PROTOCOLS` name or ``{source: (ctx, n_chunks)}``)."""
    spec = PROTOCOLS[protocol] if isinstance(protocol, str) else dict(protocol)
    texts = load_texts(list(spec))
    out: list[Chunk] = []
    for src, (ctx, n) in spec.items():
        out += make_chunks({src: texts[src]}, lm.tokenizer, ctx, max_chunks=n, max_model_len=lm.max_model_len)
    return out


class Evaluator:
    """Scores lab specs on fixed chunks against cached base logits (see the module docstring)."""

    def __init__(self, lm, chunks: Sequence[Chunk], calib: Calibration | None = None,
                 cache_dir: str | os.PathLike | None = None) -> None:
        self.lm, self.chunks, self.calib = lm, list(chunks), calib
        self.cache_dir = Path(cache_dir or os.environ.get("PAGED_QUANT_CACHE", "/tmp/paged-quant-base"))
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self._artefacts: dict = {}

    def _base(self, ch: Chunk) -> torch.Tensor:
        key = hashlib.sha1(np.asarray(ch.ids, dtype=np.int64).tobytes()).hexdigest()[:20]
        path = self.cache_dir / f"base-{len(ch.ids)}-{key}.pt"
        if path.is_file():
            return torch.load(path)
        cfg = self.lm.config
        logits = chunk_logits(self.lm.model, ch.ids, QuantKVAttention("fp32", cfg.num_layers, cfg.head_dim),
                              scored_slice(len(ch.ids)))
        torch.save(logits, path)
        return logits

    def cache(self, spec):
        """The one-sequence cache of a :class:`LabSpec` or a :class:`~paged.quant.split_cache.Served`
        split format (tables fitted on this evaluator's calibration)."""
        from .split_cache import Served, SplitCache, tables_for
        if isinstance(spec, Scheme):  # the study's earlier formats (paged.quant.schemes)
            cfg = self.lm.config
            return QuantKVAttention(spec, cfg.num_layers, cfg.head_dim)
        if not isinstance(spec, Served):
            return LabCache(spec, self.lm.model, self.calib)
        from paged.errors import ConfigError
        from .artefact import fit, for_model
        key = (spec.fmt.name, spec.block_size)
        if spec.fmt.calibrated and key not in self._artefacts:
            try:  # the artefact the engine serves with (fitted on the same calibration text)
                self._artefacts[key] = for_model(self.lm.model, spec.fmt, spec.block_size)
            except ConfigError:
                self._artefacts[key] = fit(self.calib, [spec.fmt.name], [spec.block_size], self.lm.model)
        art = self._artefacts.get(key)
        return SplitCache(spec.fmt, self.lm.model, tables_for(spec.fmt, self.lm.model, art, spec.block_size),
                          spec.block_size)

    def stats(self, spec) -> dict[str, list[TokenStats]]:
        """Per source, one TokenStats per chunk."""
        cache = self.cache(spec)
        out: dict[str, list[TokenStats]] = {}
        for ch in self.chunks:
            rows = scored_slice(len(ch.ids))
            targets = torch.tensor(ch.ids[rows.start + 1:rows.stop + 1])
            q = chunk_logits(self.lm.model, ch.ids, cache, rows)
            out.setdefault(ch.source, []).append(token_stats(self._base(ch), q, targets))
        return out

    def run(self, spec: LabSpec, **extra) -> list[dict]:
        """One row per source and ``"all"`` for ``spec`` (``extra`` columns added to each)."""
        cfg = self.lm.config
        from .split_cache import Served
        if isinstance(spec, Scheme):
            kb, vb = spec.k.bits(cfg.head_dim), spec.v.bits(cfg.head_dim)
            kb += 16.0 * spec.k.group / 2048 if spec.k.per_channel else 0.0  # KIVI's unfilled fp16 group
            bits = (kb + vb) / 2
        else:
            kb, vb, bits = (spec.bits(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) if isinstance(spec, Served)
                            else spec.bits(cfg.num_layers, cfg.head_dim, 2048))
        per = self.stats(spec)
        per["all"] = [s for parts in list(per.values()) for s in parts]
        rows = []
        for src, parts in per.items():
            pooled = TokenStats()
            for p in parts:
                pooled.add(p)
            s = summarize(pooled)
            means = np.array([p.cat("kld").mean() for p in parts])
            rows.append({"format": spec.name, **extra, "source": src, "bits_k": kb, "bits_v": vb, "bits": bits,
                         "n_chunks": len(parts), "n_tokens": s["n_tokens"], "kld_mean": s["kld_mean"],
                         "kld_se": s["kld_se"],
                         "kld_se_chunks": float(means.std(ddof=1) / math.sqrt(len(means))) if len(means) > 1
                         else float("nan"),
                         "kld_p99": s["kld_p99"], "delta_nll": s["delta_nll"], "same_top1_pct": s["same_top1_pct"],
                         "ctx": len(self.chunks[0].ids)})
        return rows

    def table(self, specs: Iterable[LabSpec], csv: str | os.PathLike | None = None, *, decompose: bool = False,
              progress: bool = True, **extra) -> pd.DataFrame:
        """Rows of every spec (and with ``decompose`` its K-only and V-only variants), appended to
        ``csv`` as each spec finishes (so a long run keeps what it measured)."""
        rows: list[dict] = []
        for spec in specs:
            todo = [("both", spec)] + ([("k_only", spec.k_only()), ("v_only", spec.v_only())]
                                       if decompose and hasattr(spec, "k_only") else [])
            for part, s in todo:
                got = self.run(s, part=part, of=spec.name, **extra)
                rows += got
                if csv:
                    pd.DataFrame(got).to_csv(csv, mode="a", header=not Path(csv).is_file(), index=False)
                if progress:
                    a = got[-1]
                    print(f"{a['format']:<60} {part:<6} bits {a['bits']:.3f} (K {a['bits_k']:.2f} V {a['bits_v']:.2f}) "
                          f"KLD {a['kld_mean']:.5f} ± {a['kld_se']:.5f} (chunks ± {a['kld_se_chunks']:.5f})",
                          flush=True)
        return pd.DataFrame(rows)
