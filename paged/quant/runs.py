"""Forward passes of one sequence through a :class:`QuantKVAttention` cache: scored logits,
greedy continuations, and the fp8 calibration pass. Model weights are whatever was loaded
(the study loads fp32); the cache is reset before every sequence.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .attention import MultiCache, QuantKVAttention, attend
from .codec import hadamard

__all__ = ["load", "chunk_logits", "greedy", "greedy_many", "greedy_prompts", "calibrate_fp8", "fp8_scales"]


def load(model=None):
    """A :class:`paged.models.LoadedModel`: None/"smollm2" = the embedded SmolLM2 in fp32,
    a name or path = :func:`paged.models.load_model` in fp32, a LoadedModel or LLM as it is."""
    from paged.models import LoadedModel, load_model
    if isinstance(model, LoadedModel):
        return model
    if hasattr(model, "loaded") and isinstance(model.loaded, LoadedModel):
        return model.loaded
    return load_model("smollm2" if model is None else model, dtype=torch.float32, device="cpu")


@torch.inference_mode()
def chunk_logits(model, ids: Sequence[int], cache: QuantKVAttention, rows: slice) -> torch.Tensor:
    """One prefill of ``ids`` from an empty cache; float32 logits of ``rows`` only."""
    cache.reset()
    dev = next(model.parameters()).device
    x = torch.tensor(list(ids), dtype=torch.long, device=dev)
    hidden = model(x, torch.arange(len(ids), device=dev), cache)
    return model.compute_logits(hidden[rows])


@torch.inference_mode()
def greedy(model, prompt: Sequence[int], cache: QuantKVAttention, n: int) -> list[int]:
    """``n`` greedy tokens after ``prompt``: a prefill, then one decode step per token."""
    first = int(chunk_logits(model, prompt, cache, slice(-1, None)).argmax(-1))
    return greedy_many(model, [cache], [first], len(prompt), n)[0]


@torch.inference_mode()
def greedy_many(model, caches: Sequence[QuantKVAttention], first: Sequence[int], pos: int, n: int
                ) -> list[list[int]]:
    """Continue every cache (each holding the same ``pos``-token prompt) greedily for ``n``
    tokens in one batched decode per step; ``first[i]`` is cache i's first greedy token."""
    dev = next(model.parameters()).device
    outs = [[int(t)] for t in first]
    multi = MultiCache(list(caches))
    while len(outs[0]) < n:
        ids = torch.tensor([o[-1] for o in outs], device=dev)
        h = model(ids, torch.full((len(outs),), pos, device=dev), multi)
        for o, t in zip(outs, model.compute_logits(h).argmax(-1).tolist()):
            o.append(int(t))
        pos += 1
    return outs


class _AbsMax:
    """Exact attention that records per-head absmax of K and V (plain and Hadamard-rotated)."""

    def __init__(self, head_dim: int) -> None:
        self.rot = hadamard(head_dim)
        self.amax: dict[tuple[int, bool], list[torch.Tensor]] = {}

    def __call__(self, layer: int, q, k, v):
        k, v = k.float(), v.float()
        for rotated in (False, True):
            kk, vv = (k @ self.rot, v @ self.rot) if rotated else (k, v)
            cur = [kk.abs().amax(dim=(0, 2)), vv.abs().amax(dim=(0, 2))]
            old = self.amax.get((layer, rotated))
            self.amax[(layer, rotated)] = cur if old is None else [torch.maximum(a, b) for a, b in zip(old, cur)]
        return attend(q.float(), k, v).to(q.dtype)


@torch.inference_mode()
def greedy_prompts(tokenizer, per_text: int = 4, length: int = 128) -> list[list[int]]:
    """``per_text`` windows of ``length`` tokens from each evaluation text, evenly spaced (the
    prompts of ``benchmarks/quant_greedy.py`` and ``quant_ablation.py --greedy``)."""
    from . import load_texts
    out = []
    for text in load_texts().values():
        ids = tokenizer.encode(text, add_special_tokens=False)
        step = len(ids) // (per_text + 1)
        out += [ids[i * step:i * step + length] for i in range(per_text)]
    return out


def calibrate_fp8(model, seqs: Sequence[Sequence[int]]) -> dict[tuple[int, bool], list[torch.Tensor]]:
    """Per-layer, per-KV-head absmax of K and V over ``seqs``: ``{(layer, rotated): [k_amax [H],
    v_amax [H]]}``; :func:`fp8_scales` turns it into a scheme's scales."""
    rec = _AbsMax(model.config.head_dim)
    dev = next(model.parameters()).device
    for ids in seqs:
        model(torch.tensor(list(ids), dtype=torch.long, device=dev), torch.arange(len(ids), device=dev), rec)
    return rec.amax


def fp8_scales(scheme, amax: dict[tuple[int, bool], list[torch.Tensor]]
               ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Calibrated scales ``absmax / fp8_max`` (vLLM's rule) per layer and KV head for the fp8
    sides of ``scheme``: ``{layer: (k_scale [H], v_scale [H])}`` for :class:`QuantKVAttention`."""
    fmax = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
    out = {}
    for layer in sorted({layer for layer, _ in amax}):
        ka, va = amax[(layer, scheme.rotate_k)][0], amax[(layer, scheme.rotate_v)][1]
        out[layer] = tuple(torch.where(a > 0, a / fmax.get(side.kind, 1.0), torch.ones_like(a))
                           for side, a in ((scheme.k, ka), (scheme.v, va)))
    return out
