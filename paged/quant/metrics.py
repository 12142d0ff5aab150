"""llama-perplexity's KL-divergence statistics, from full logits of a base and a quantized run.

Per scored token: ``nll`` of the next token under each run, ``kld = sum p_base (ln p_base -
ln p_q)`` over the whole vocabulary, whether the top-1 tokens agree, and ``dp = p_q(target) -
p_base(target)``. :func:`summarize` turns pooled per-token values into the columns llama.cpp
prints: PPL(Q), PPL(base), mean ln(PPL_Q/PPL_base) (= mean NLL difference, ``delta_nll``), KLD
mean ± SE (std / sqrt(n)), its 99.9/99/95/90/50 percentiles and max, same-top-1 %, and Δp mean
and RMS (in percent, as llama.cpp prints them).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

__all__ = ["TokenStats", "token_stats", "summarize", "divergence_columns", "survival"]


@dataclass
class TokenStats:
    """Pooled per-token arrays (numpy float64, one entry per scored token)."""

    nll_base: list[np.ndarray] = field(default_factory=list)
    nll_q: list[np.ndarray] = field(default_factory=list)
    kld: list[np.ndarray] = field(default_factory=list)
    same_top1: list[np.ndarray] = field(default_factory=list)
    dp: list[np.ndarray] = field(default_factory=list)

    def add(self, other: "TokenStats") -> None:
        for name in ("nll_base", "nll_q", "kld", "same_top1", "dp"):
            getattr(self, name).extend(getattr(other, name))

    def cat(self, name: str) -> np.ndarray:
        parts = getattr(self, name)
        return np.concatenate(parts) if parts else np.zeros(0)


@torch.inference_mode()
def token_stats(base_logits: torch.Tensor, q_logits: torch.Tensor, targets: torch.Tensor) -> TokenStats:
    """Per-token statistics of rows ``[n, vocab]`` (float32 logits) predicting ``targets [n]``."""
    lb = torch.log_softmax(base_logits.double(), -1)
    lq = torch.log_softmax(q_logits.double(), -1)
    t = targets.long()[:, None]
    nb, nq = -lb.gather(1, t)[:, 0], -lq.gather(1, t)[:, 0]
    kld = (lb.exp() * (lb - lq)).sum(-1).clamp_min(0.0)
    same = (lb.argmax(-1) == lq.argmax(-1)).double()
    dp = torch.exp(-nq) - torch.exp(-nb)
    return TokenStats(*([x.cpu().numpy()] for x in (nb, nq, kld, same, dp)))


def summarize(s: TokenStats) -> dict[str, float]:
    """llama-perplexity's columns from pooled per-token statistics (see the module docstring)."""
    nb, nq, kld, same, dp = (s.cat(n) for n in ("nll_base", "nll_q", "kld", "same_top1", "dp"))
    n = len(kld)
    if n == 0:
        return {"n_tokens": 0}
    pct = np.percentile(kld, [99.9, 99, 95, 90, 50])
    return {
        "n_tokens": n,
        "ppl_q": math.exp(nq.mean()), "ppl_base": math.exp(nb.mean()),
        "delta_nll": float((nq - nb).mean()),
        "delta_nll_se": float((nq - nb).std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan"),
        "kld_mean": float(kld.mean()),
        "kld_se": float(kld.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan"),
        "kld_max": float(kld.max()),
        "kld_p999": float(pct[0]), "kld_p99": float(pct[1]), "kld_p95": float(pct[2]),
        "kld_p90": float(pct[3]), "kld_median": float(pct[4]),
        "same_top1_pct": float(100 * same.mean()),
        "dp_mean_pct": float(100 * dp.mean()), "dp_rms_pct": float(100 * math.sqrt((dp ** 2).mean())),
    }


def divergence_columns(first: Sequence[int], horizon: int) -> dict:
    """A study row's greedy-divergence columns: the horizon, then the median and mean (NaN without
    runs) and the list of the first divergences ``first`` (``horizon``: none within it)."""
    d = np.asarray(first, dtype=float)
    return {"divergence_tokens": horizon, "first_div_median": float(np.median(d)) if len(d) else float("nan"),
            "first_div_mean": float(d.mean()) if len(d) else float("nan"), "first_div": d.astype(int).tolist()}


def survival(first_divergence: np.ndarray, horizon: int) -> tuple[np.ndarray, np.ndarray]:
    """Kaplan-Meier-style curve without censoring before ``horizon``: ``(t, fraction of prompts
    whose greedy continuations are still identical after t tokens)`` for t = 0..horizon.
    A value of ``horizon`` means no divergence within the horizon."""
    t = np.arange(horizon + 1)
    d = np.asarray(first_divergence)
    alive = (d[None, :] >= t[:, None]).mean(axis=1) if len(d) else np.ones_like(t, dtype=float)
    return t, alive
