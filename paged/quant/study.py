"""``study()``: KV quantization error on a real model, llama-perplexity's protocol, one tidy table.

For every context length, the shipped (or given) texts are cut into chunks (see
:mod:`paged.quant.text`); per chunk the base run (fp32 weights as loaded, fp32 KV cache) and
every scheme run in this process from an empty cache that quantizes on write and attends from
what it stored (:class:`paged.quant.attention.QuantKVAttention`); the scored half's full-vocab
logits are compared token by token (no stored logits). First greedy divergence: from the
chunk's unscored first half as a prompt, the number of greedy tokens a scheme produces before
it first differs from the base run's (``divergence_tokens`` = never within the horizon).

One row per (context_length, source, format), plus ``source == "all"`` pooling every source;
``role`` is ``base`` (fp32: zero error by construction), ``noise_floor`` (fp16, bf16) or
``quantized``. fp8 ``_cal`` scales are calibrated on the *last* ``calib_tokens`` tokens of each
text, which the scored chunks reach only when a text is used to its end.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import pandas as pd
import torch

from paged.errors import ConfigError
from .attention import QuantKVAttention
from .metrics import TokenStats, divergence_columns, summarize, token_stats
from .runs import calibrate_fp8, chunk_logits, fp8_scales, greedy_many, load
from .schemes import BASE, DEFAULT_SCHEMES, NOISE_FLOOR, Scheme, parse_scheme
from .text import load_texts, make_chunks, scored_slice

__all__ = ["study", "describe_formats", "resolve_schemes"]


def resolve_schemes(formats: str | Sequence[str] | None, head_dim: int) -> list[Scheme]:
    """Parsed, checked schemes with the fp32 base first (added when missing)."""
    names = list(DEFAULT_SCHEMES) if formats is None else ([formats] if isinstance(formats, str) else list(formats))
    if not names:
        raise ConfigError("formats is empty; pass None for every format or e.g. ['int8', 'int4']")
    out: list[Scheme] = [parse_scheme(BASE)]
    for n in names:
        s = parse_scheme(n)
        s.check(head_dim)
        if s not in out:
            out.append(s)
    return out


def _engine_only(name: object) -> bool:
    """An engine KV format the study's scheme language does not spell (the front's ``kvq*``
    aliases and split formats ``K/V@sinkS@winW``)."""
    from kernels.format_table import KVFormatError, lookup

    if not isinstance(name, str):
        return False
    try:
        parse_scheme(name)
        return False
    except ConfigError:
        try:
            return lookup(name).split
        except KVFormatError:
            return False


def _served_row(name: str, cfg) -> dict:
    """``describe_formats``' row of an engine-only format: what the engine stores per token at
    the block size the front was measured at (``kernels.format_table.FRONT_BLOCK_SIZE``)."""
    from kernels.format_table import FRONT_BLOCK_SIZE, bytes_per_token, lookup

    fmt = lookup(name)
    per_layer = bytes_per_token(fmt, cfg.num_kv_heads, cfg.head_dim, block_size=FRONT_BLOCK_SIZE)
    values = 2 * cfg.num_kv_heads * cfg.head_dim
    return {"format": name, "engine_format": fmt.name, "role": "served", "engine_block_size": FRONT_BLOCK_SIZE,
            "bits_per_value": 8 * per_layer / values, "bytes_per_token": cfg.num_layers * per_layer,
            "tokens_per_gib": 2**30 // (cfg.num_layers * per_layer)}


def describe_formats(formats: str | Sequence[str] | None = None, model=None,
                     context_length: int = 2048) -> pd.DataFrame:
    """Storage of each scheme on the model: bits per value (K, V, mean), bytes per token over all
    layers (scales and zero points included), KIVI staging per sequence, tokens per GiB, and how
    the engine serves it (``engine_format`` at the default block size; ``engine_block_size``
    when a KIVI key group needs ``block_size=N``, e.g. ``kivi_g32/int4``)."""
    cfg = load(model).config if not hasattr(model, "num_layers") else model
    names = [formats] if isinstance(formats, str) else formats
    served = [n for n in (names or ()) if _engine_only(n)]  # kvq2, K/V@sinkS@winW: the engine's spellings
    rows = [_served_row(n, cfg) for n in served]
    formats = [n for n in names if n not in served] if names is not None else None
    if formats == [] and rows:
        return pd.DataFrame(rows)
    for s in resolve_schemes(formats, cfg.head_dim):
        dims = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        rows.append({"format": s.name, "k_format": s.k.name, "v_format": s.v.name, "rotate": s.rotate, "vrot": s.vrot,
                     "engine_format": s.engine_format,
                     "role": "base" if s.is_base else "noise_floor" if s.name in NOISE_FLOOR else "quantized",
                     "engine_block_size": (s.engine_kwargs or {}).get("block_size"),
                     "bits_k": s.k.bits(cfg.head_dim), "bits_v": s.v.bits(cfg.head_dim),
                     "bits_per_value": s.bits_per_value(cfg.head_dim),
                     "bytes_per_token": s.bytes_per_token(*dims), "staging_bytes_per_seq": s.staging_bytes(*dims),
                     "tokens_per_gib": s.tokens_per_gib(*dims, context_length)})
    return pd.DataFrame(rows)


def study(model=None, formats: str | Sequence[str] | None = None, texts: Mapping[str, str] | None = None,
          context_lengths: Sequence[int] = (512, 2048), *, max_chunks: int | None = 2,
          divergence_tokens: int = 32, calib_tokens: int = 512, bos: bool | None = None,
          progress: bool = True) -> pd.DataFrame:
    """Measure every scheme in ``formats`` (None = :data:`DEFAULT_SCHEMES`) against the fp32 base.

    ``model``: None (embedded SmolLM2, fp32), a name/path, or a LoadedModel/LLM. ``texts``:
    ``{label: text or token ids}``, None = the shipped sources. ``max_chunks`` caps the chunks per
    source and context length (None = all, as llama-perplexity). ``divergence_tokens=0`` skips
    the greedy-divergence runs. Returns one row per (context_length, source, format).
    """
    names = [formats] if isinstance(formats, str) else formats or ()
    if served := [n for n in names if _engine_only(n)]:
        raise ConfigError(f"{', '.join(map(repr, served))}: an engine format (a split format of the served front); "
                          "study() measures per-token schemes in its own cache. Measure a served format as the front "
                          "was (paged.quant.ablation.Evaluator with paged.quant.split_cache.Served(format, 32); "
                          "benchmarks/quant_ablation.py), and read its storage with describe_formats(), which "
                          "takes engine names")
    lm = load(model)
    m, cfg = lm.model, lm.config
    schemes = resolve_schemes(formats, cfg.head_dim)
    raw = load_texts() if texts is None else dict(texts)
    ctxs = [context_lengths] if isinstance(context_lengths, int) else list(context_lengths)
    if not ctxs:
        raise ConfigError("context_lengths is empty; pass e.g. (512, 2048)")
    plan = [(c, make_chunks(raw, lm.tokenizer, c, max_chunks=max_chunks, max_model_len=lm.max_model_len, bos=bos))
            for c in ctxs]
    amax = None
    if any(s.k.calibrated or s.v.calibrated for s in schemes):
        calib = [ids[-calib_tokens:] for ids in (lm.tokenizer.encode(t, add_special_tokens=False)
                                                 if isinstance(t, str) else list(t) for t in raw.values())]
        amax = calibrate_fp8(m, calib)
    caches = {s: QuantKVAttention(s, cfg.num_layers, cfg.head_dim,
                                  fp8_scales=fp8_scales(s, amax) if amax is not None else None) for s in schemes}
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=sum(len(ch) for _, ch in plan) * len(schemes), desc="quant study", unit="run")
    rows = []
    for ctx, chunks in plan:
        stats: dict[tuple[str, Scheme], TokenStats] = {}
        div: dict[tuple[str, Scheme], list[int]] = {}
        rows_sl = scored_slice(ctx)
        ext = slice(rows_sl.start - 1, rows_sl.stop)  # one more row: the prompt's next token
        for ch in chunks:
            targets = torch.tensor(ch.ids[rows_sl.start + 1:rows_sl.stop + 1])
            base_logits, first = None, []
            for s in schemes:
                logits = chunk_logits(m, ch.ids, caches[s], ext)
                base_logits = logits if base_logits is None else base_logits
                first.append(int(logits[0].argmax()))
                st = token_stats(base_logits[1:], logits[1:], targets)
                for key in ((ch.source, s), ("all", s)):
                    stats.setdefault(key, TokenStats()).add(st)
                caches[s].truncate(ctx // 2)
                if bar is not None:
                    bar.update(1)
            if divergence_tokens:
                gens = greedy_many(m, [caches[s] for s in schemes], first, ctx // 2, divergence_tokens)
                for s, gen in zip(schemes, gens):
                    fd = next((i for i, (a, b) in enumerate(zip(gens[0], gen)) if a != b), divergence_tokens)
                    for key in ((ch.source, s), ("all", s)):
                        div.setdefault(key, []).append(fd)
            for s in schemes:
                caches[s].reset()
        sources = list(dict.fromkeys(ch.source for ch in chunks)) + ["all"]
        info = describe_formats([s.name for s in schemes], cfg, ctx).set_index("format")
        for src in sources:
            for s in schemes:
                if (src, s) not in stats:
                    continue
                d = div.get((src, s), [])
                row = {"context_length": ctx, "source": src, "format": s.name, **info.loc[s.name].to_dict(),
                       "n_chunks": sum(1 for ch in chunks if src in ("all", ch.source)),
                       **summarize(stats[(src, s)]), **divergence_columns(d, divergence_tokens)}
                rows.append(row)
    if bar is not None:
        bar.close()
    return pd.DataFrame(rows)
