"""Cross-layer KV sharing on a pretrained model: memory saved, quality lost, and whether the
similarity of two layers' attention maps predicts the loss.

``EngineConfig.kv_share_with = {i: j}`` (:mod:`paged.engine.kv_sharing`): layer ``i`` attends with
its own queries over layer ``j``'s cached K/V and stores none. This is Cross-Layer Attention
(Brandon et al. 2024), there trained into the model; SmolLM2 was trained without it, so sharing
changes what the model computes and the study measures by how much.

:func:`sharing_study` follows the quantization study's protocol (:mod:`paged.quant.study`): every
config scores the same chunks from an empty fp32 cache (:class:`SharedKVAttention`) against the
unshared base over the full vocabulary (ΔNLL, KLD, same top-1; :mod:`paged.quant.metrics`), plus
the first greedy divergence. Configs: each adjacent pair ``{i + 1: i}`` alone, then ``k`` disjoint
pairs per ``k`` in ``ks``, ranked by one-pair cost (``order="cost"``, an oracle) or by attention-map
distance (``order="similarity"``, a predictor needing no quality run).

Predictors from the base run: ``js_head``, the Jensen–Shannon distance (base 2, in [0, 1], a metric)
between the attention of query head ``h`` in layers ``i`` and ``i + 1`` (under sharing they read the
same KV head), averaged over rows then heads; ``js_headavg`` on head-averaged maps; ``js_shared``,
layer ``i + 1``'s own attention vs the one it gets under sharing; ``k_rel_err``/``v_rel_err``,
``||K_i - K_{i+1}|| / ||K_{i+1}||`` (and V): what sharing substitutes for layer ``i + 1``'s K/V.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np
import pandas as pd
import torch

from paged.errors import ConfigError
from paged.memory import memory_facts
from paged.quant.attention import attend
from paged.quant.metrics import TokenStats, divergence_columns, summarize, token_stats
from paged.quant.runs import greedy_many, load
from paged.quant.text import load_texts, make_chunks, scored_slice

__all__ = ["SharedKVAttention", "js_distance", "disjoint_pairs", "sharing_memory", "sharing_study",
           "similarity_rank_correlation", "sharing_claim", "sharing_verdict"]


class SharedKVAttention:
    """One-sequence fp32 cache with cross-layer sharing (``share = {layer: owner}``, checked by
    :func:`paged.engine.kv_sharing.check_share_map`): owners store their K/V, a shared layer stores nothing
    and attends over its owner's; calls append. With ``map_rows`` a prefill from empty also keeps those
    query rows' attention probabilities (``maps[layer]``, ``[Hq, rows, T]`` float32), the same rows over the
    previous layer's keys (``prev_maps``) and the previous layer's relative K and V error (``kv_err``)."""

    def __init__(self, num_layers: int, share: Mapping[int, int] | None = None, *,
                 map_rows: slice | None = None) -> None:
        from paged.engine.kv_sharing import check_share_map
        self.num_layers = num_layers
        self.share = check_share_map(share, num_layers) or {}
        self.map_rows = map_rows
        self.reset()

    def reset(self) -> None:
        self.k: list[torch.Tensor | None] = [None] * self.num_layers
        self.v: list[torch.Tensor | None] = [None] * self.num_layers
        self.maps: dict[int, torch.Tensor] = {}
        self.prev_maps: dict[int, torch.Tensor] = {}
        self.kv_err: dict[int, tuple[float, float]] = {}

    def truncate(self, n: int) -> None:
        """Forget every token from position ``n`` on."""
        self.k = [None if k is None else k[:n] for k in self.k]
        self.v = [None if v is None else v[:n] for v in self.v]

    @property
    def num_tokens(self) -> int:
        return 0 if self.v[0] is None else self.v[0].shape[0]

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dtype, q = q.dtype, q.float()
        owner = self.share.get(layer_idx)
        if owner is None:
            k, v = k.float(), v.float()
            old_k, old_v = self.k[layer_idx], self.v[layer_idx]
            self.k[layer_idx] = k if old_k is None else torch.cat([old_k, k])
            self.v[layer_idx] = v if old_v is None else torch.cat([old_v, v])
            owner = layer_idx
        kk, vv = self.k[owner], self.v[owner]
        if self.map_rows is not None and q.shape[0] == kk.shape[0]:
            rows, start = q[self.map_rows], self.map_rows.start
            self.maps[layer_idx] = attention_probs(rows, kk, start)
            pk, pv = (self.k[layer_idx - 1], self.v[layer_idx - 1]) if layer_idx else (None, None)
            if owner == layer_idx and pk is not None and pk.shape == kk.shape:
                self.prev_maps[layer_idx] = attention_probs(rows, pk, start)
                self.kv_err[layer_idx] = (float((pk - kk).norm() / kk.norm()), float((pv - vv).norm() / vv.norm()))
        return attend(q, kk, vv).to(dtype)


def attention_probs(q: torch.Tensor, k: torch.Tensor, first_pos: int) -> torch.Tensor:
    """Causal softmax attention weights ``[Hq, n, T]`` of query rows ``q`` ``[n, Hq, D]`` (at
    positions ``first_pos ..``) over keys ``k`` ``[T, H, D]`` (GQA: query head h reads KV head h // G)."""
    g = q.shape[1] // k.shape[1]
    s = torch.einsum("nhd,thd->hnt", q, k.repeat_interleave(g, dim=1)) / math.sqrt(q.shape[-1])
    pos = torch.arange(first_pos, first_pos + q.shape[0])
    s = s.masked_fill(torch.arange(k.shape[0])[None, None, :] > pos[None, :, None], float("-inf"))
    return torch.softmax(s, -1)


def js_distance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Jensen–Shannon distance (base 2, in [0, 1]; symmetric, 0 iff p == q) between the
    distributions along the last axis of ``p`` and ``q``; one value per leading index."""
    p, q = p.double(), q.double()
    m = 0.5 * (p + q)
    kl = lambda a: torch.xlogy(a, a).sum(-1) - torch.xlogy(a, m).sum(-1)  # noqa: E731  (0 log 0 = 0)
    return (0.5 * (kl(p) + kl(q)) / math.log(2)).clamp(0.0, 1.0).sqrt()


def _pair_similarity(base: SharedKVAttention, i: int) -> dict[str, float]:
    a, b = base.maps[i], base.maps[i + 1]
    per_head = js_distance(a, b).mean(-1)  # rows, then heads
    k_err, v_err = base.kv_err[i + 1]
    return {"js_head": float(per_head.mean()), "js_headavg": float(js_distance(a.mean(0), b.mean(0)).mean()),
            "js_shared": float(js_distance(b, base.prev_maps[i + 1]).mean()), "k_rel_err": k_err, "v_rel_err": v_err}


def disjoint_pairs(ranked: Sequence[int], k: int) -> dict[int, int]:
    """``{i + 1: i}`` for the first ``k`` adjacent pairs ``(i, i + 1)`` in ``ranked`` order
    that touch no layer of an earlier chosen pair (a valid share map: no chains)."""
    used: set[int] = set()
    out: dict[int, int] = {}
    for i in ranked:
        if len(out) == k:
            break
        if i in used or i + 1 in used:
            continue
        used.update((i, i + 1))
        out[i + 1] = i
    if len(out) < k:
        raise ConfigError(f"only {len(out)} disjoint adjacent pairs exist in {list(ranked)}; lower k to <= {len(out)}")
    return dict(sorted(out.items()))


def sharing_memory(cfg, share: Mapping[int, int] | None, kv_cache_dtype: str = "fp16") -> dict[str, float]:
    """Cache bytes per token with ``share`` (owner layers only) and the saving against none."""
    from paged._kernels import kernels
    per_layer = kernels.bytes_per_token(kv_cache_dtype, cfg.num_kv_heads, cfg.head_dim)
    owners = cfg.num_layers - len(share or {})
    return {"num_cache_layers": owners, "kv_bytes_per_token": owners * per_layer,
            "memory_saved_pct": 100.0 * (cfg.num_layers - owners) / cfg.num_layers}


@torch.inference_mode()
def _prefill(model, ids: torch.Tensor, cache: SharedKVAttention, start: int = 0, base=None) -> torch.Tensor:
    """Hidden states of a prefill from an empty ``cache``. With ``base`` (the base run's cache and
    per-layer inputs) layers below ``start`` are taken from it: they compute the same as the base."""
    cache.reset()
    pos = torch.arange(len(ids), device=ids.device)
    model.rope.ensure(pos)
    if base is None or start == 0:
        return model(ids, pos, cache)
    base_cache, inputs = base
    for layer in range(start):
        cache.k[layer], cache.v[layer] = base_cache.k[layer], base_cache.v[layer]
    x = inputs[start]
    for layer in model.layers[start:]:
        x = layer(x, pos, model.rope, cache)
    return model.norm(x)


@torch.inference_mode()
def _base_run(model, ids: torch.Tensor, cache: SharedKVAttention) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The unshared prefill, keeping every layer's input (for :func:`_prefill`'s shortcut)."""
    cache.reset()
    pos = torch.arange(len(ids), device=ids.device)
    model.rope.ensure(pos)
    x, inputs = model.embed_tokens(ids), []
    for layer in model.layers:
        inputs.append(x)
        x = layer(x, pos, model.rope, cache)
    return model.norm(x), inputs


def _engine_blocks(lm, share, budget: int) -> tuple[int, int]:
    from paged.engine.llm_engine import EngineConfig, LLMEngine
    eng = LLMEngine(lm, EngineConfig(kv_cache_memory_bytes=budget, kv_share_with=share, record_events=False))
    facts = memory_facts(eng)
    return facts.num_blocks, facts.cache_bytes


def sharing_study(model=None, texts: Mapping[str, str] | None = None, context_length: int = 256, *,
                  max_chunks: int | None = 1, pairs: Sequence[int] | None = None,
                  ks: Sequence[int] = (3, 6, 9, 12), orders: Sequence[str] = ("cost", "similarity"),
                  divergence_tokens: int = 16, engine_budget: int | None = 64 << 20, bos: bool | None = None,
                  progress: bool = False) -> pd.DataFrame:
    """Measure cross-layer sharing configs against the unshared base (see the module docstring). ``model``: None
    (embedded SmolLM2, fp32), a name/path, or a LoadedModel/LLM. ``pairs``: the ``i`` of the adjacent pairs
    ``{i + 1: i}`` measured alone (None = all); the k-pair configs rank only these (a ``k`` with fewer disjoint
    pairs in that order is left out: 15 pairs of 30 layers need a perfect tiling). ``engine_budget``: bytes
    given to a real engine per config to report the blocks it fits (None skips it). One row per config, texts
    pooled; columns ``kind`` (base, pair, k_pairs), ``order``, ``k`` (shared layers), ``share_with``, memory
    (fp16 cache bytes per token, % saved), the predictors ``js_head``, ``js_headavg``, ``js_shared``,
    ``k_rel_err``, ``v_rel_err`` (pairs), :func:`paged.quant.metrics.summarize`'s columns and
    ``first_div_*``."""
    lm = load(model)
    m, cfg = lm.model, lm.config
    L = cfg.num_layers
    pairs = list(range(L - 1)) if pairs is None else [int(i) for i in pairs]
    if not pairs or min(pairs) < 0 or max(pairs) > L - 2:
        raise ConfigError(f"pairs must name layers i in 0..{L - 2} (pair {{i + 1: i}}), got {pairs}")
    bad = [o for o in orders if o not in ("cost", "similarity")]
    if bad:
        raise ConfigError(f"orders must be drawn from ('cost', 'similarity'), got {bad}")
    if any(not 1 <= k <= len(pairs) for k in ks):
        raise ConfigError(f"every k in ks must lie in 1..{len(pairs)} (the pairs measured), got {list(ks)}")
    chunks = make_chunks(load_texts() if texts is None else dict(texts), lm.tokenizer, context_length,
                         max_chunks=max_chunks, max_model_len=lm.max_model_len, bos=bos)
    rows_sl = scored_slice(context_length)
    dev = next(m.parameters()).device
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(chunks) * (2 if ks and orders else 1), desc="sharing study", unit="chunk")

    def run(configs: list[dict]) -> list[dict]:
        """Score ``configs`` (each with ``share_with``) on every chunk; returns their metrics."""
        stats = [TokenStats() for _ in configs]
        div: list[list[int]] = [[] for _ in configs]
        js: dict[int, list[dict[str, float]]] = {}
        for ch in chunks:
            ids = torch.tensor(ch.ids, dtype=torch.long, device=dev)
            targets = torch.tensor(ch.ids[rows_sl.start + 1:rows_sl.stop + 1])
            base = SharedKVAttention(L, map_rows=rows_sl)
            hidden, inputs = _base_run(m, ids, base)
            for i in pairs:
                js.setdefault(i, []).append(_pair_similarity(base, i))
            base.maps, base.prev_maps = {}, {}
            base_logits = m.compute_logits(hidden[rows_sl.start - 1:rows_sl.stop])
            caches, first = [], []
            for c in configs:
                share = c["share_with"]
                if not share:
                    logits, cache = base_logits, base
                else:
                    cache = SharedKVAttention(L, share)
                    h = _prefill(m, ids, cache, min(share), (base, inputs))
                    logits = m.compute_logits(h[rows_sl.start - 1:rows_sl.stop])
                first.append(int(logits[0].argmax()))
                stats[len(caches)].add(token_stats(base_logits[1:], logits[1:], targets))
                caches.append(cache)
            if bar is not None:
                bar.update(1)
            if divergence_tokens:
                for cache in {id(c): c for c in [base, *caches]}.values():
                    cache.truncate(context_length // 2)
                if all(c["share_with"] for c in configs):  # the base continues too, as the reference
                    caches, first = [base, *caches], [int(base_logits[0].argmax()), *first]
                gens = greedy_many(m, caches, first, context_length // 2, divergence_tokens)
                ref = gens[0]
                gens = gens[len(gens) - len(configs):]
                for d, gen in zip(div, gens):
                    d.append(next((t for t, (a, b) in enumerate(zip(ref, gen)) if a != b), divergence_tokens))
        out = []
        for c, s, d in zip(configs, stats, div):
            row = {**c, **summarize(s), **divergence_columns(d, divergence_tokens)}
            if c["kind"] == "pair":
                vals = js[c["pair"]]
                row.update({name: float(np.mean([v[name] for v in vals])) for name in vals[0]})
            out.append(row)
        return out

    def config(kind: str, share: dict[int, int], **extra) -> dict:
        return {"kind": kind, "order": extra.pop("order", None), "pair": extra.pop("pair", None),
                "k": len(share), "share_with": share, "shared_layers": sorted(share), **sharing_memory(cfg, share)}

    first = run([config("base", {})] + [config("pair", {i + 1: i}, pair=i) for i in pairs])
    pair_rows = [r for r in first if r["kind"] == "pair"]
    rank = {"cost": [r["pair"] for r in sorted(pair_rows, key=lambda r: r["kld_mean"])],
            "similarity": [r["pair"] for r in sorted(pair_rows, key=lambda r: r["js_head"])]}
    cfgs = []
    for o in orders:
        for k in ks:
            try:
                cfgs.append(config("k_pairs", disjoint_pairs(rank[o], k), order=o))
            except ConfigError:
                continue  # fewer disjoint pairs than k among the measured ones
    second = run(cfgs) if cfgs else []
    if bar is not None:
        bar.close()
    df = pd.DataFrame(first + second)
    df["context_length"], df["n_chunks"] = context_length, len(chunks)
    if engine_budget is not None:
        blocks = [_engine_blocks(lm, s or None, engine_budget) for s in df["share_with"]]
        df["engine_budget"] = engine_budget
        df["engine_num_blocks"], df["engine_cache_bytes"] = zip(*blocks)
    df["share_with"] = df["share_with"].map(lambda s: str(dict(s)) if s else "{}")
    return df


def similarity_rank_correlation(df: pd.DataFrame, cost: str = "kld_mean", similarity: str = "js_head") -> float:
    """Spearman rank correlation between a similarity column and a cost column over the
    one-pair rows of :func:`sharing_study` (positive: more distant maps cost more)."""
    p = df[df["kind"] == "pair"]
    return float(p[similarity].rank().corr(p[cost].rank())) if len(p) >= 3 else float("nan")


_CLAIM_COLUMNS = ["order", "k", "share_with", "memory_saved_pct", "kv_bytes_per_token", "delta_nll", "kld_mean",
                  "same_top1_pct", "first_div_median", "ppl_q", "ppl_base"]


def sharing_claim(df: pd.DataFrame, target_pct: float = 30.0) -> pd.DataFrame:
    """The seed's claim ("up to 30% less memory if attention patterns are similar") against the
    table: per order, the k-pair config saving the least memory that is >= ``target_pct``, and
    the cheapest single pair (by KLD) for scale."""
    k = df[(df["kind"] == "k_pairs") & (df["memory_saved_pct"] >= target_pct - 1e-9)]
    rows = [g.sort_values("memory_saved_pct").iloc[:1] for _, g in k.groupby("order")]
    pairs = df[df["kind"] == "pair"]
    if len(pairs):
        rows.append(pairs.sort_values("kld_mean").iloc[:1].assign(order="best single pair"))
    return pd.concat(rows, ignore_index=True)[_CLAIM_COLUMNS] if rows else pd.DataFrame(columns=_CLAIM_COLUMNS)


def sharing_verdict(df: pd.DataFrame, target_pct: float = 30.0) -> str:
    """One line: the quality at the claimed saving and whether similarity predicts the cost."""
    claim = sharing_claim(df, target_pct)
    at = claim[claim["order"] != "best single pair"]
    rho = similarity_rank_correlation(df)
    if not len(at):
        return f"no measured config saves {target_pct:.0f}% (add larger ks)"
    r = at.sort_values("kld_mean").iloc[0]
    return (f"{r['memory_saved_pct']:.0f}% less KV memory ({r['k']} shared layers, picked by {r['order']}) costs "
            f"ΔNLL {r['delta_nll']:+.2f} nats (PPL {r['ppl_base']:.1f} -> {r['ppl_q']:.1f}), KLD {r['kld_mean']:.2f}, "
            f"same top-1 {r['same_top1_pct']:.0f}%; attention-map JS distance vs one-pair KLD: Spearman {rho:+.2f}")
