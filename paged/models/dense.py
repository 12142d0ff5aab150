"""Cache-free causal attention: the reference the paged path must reproduce (perplexity, test
oracle). Every call sees all tokens of every sequence (``query_start_loc`` splits the packed axis).
"""
from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F


class DenseCausalAttention:
    """Causal self-attention over packed sequences (no cache, no padding)."""

    def __init__(self, query_start_loc: list[int]) -> None:
        self.bounds = list(query_start_loc)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rep = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)
        for s, e in zip(self.bounds[:-1], self.bounds[1:]):
            qs = q[s:e].transpose(0, 1)                         # [H, L, D]
            ks = k[s:e].repeat_interleave(rep, dim=1).transpose(0, 1)
            vs = v[s:e].repeat_interleave(rep, dim=1).transpose(0, 1)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=1.0 / math.sqrt(q.shape[-1]))
            out[s:e] = o.transpose(0, 1)
        return out


@torch.inference_mode()
def dense_logits(model: torch.nn.Module, token_ids: list[list[int]]) -> list[torch.Tensor]:
    """Float32 logits ``[len_i, vocab]`` for each sequence, computed without a cache."""
    dev = next(model.parameters()).device
    ids = torch.tensor([t for seq in token_ids for t in seq], dtype=torch.long, device=dev)
    pos = torch.tensor([p for seq in token_ids for p in range(len(seq))], dtype=torch.long, device=dev)
    qsl = [0, *itertools.accumulate(len(seq) for seq in token_ids)]
    logits = model.compute_logits(model(ids, pos, DenseCausalAttention(qsl)))
    return [logits[s:e] for s, e in zip(qsl[:-1], qsl[1:])]


@torch.inference_mode()
def mean_nll(model: torch.nn.Module, token_ids: list[int]) -> float:
    """Mean next-token negative log-likelihood (nats) of one sequence."""
    logits = dense_logits(model, [token_ids])[0][:-1]
    return float(F.cross_entropy(logits, torch.tensor(token_ids[1:], device=logits.device)))
