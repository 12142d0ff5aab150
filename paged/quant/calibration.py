"""Calibration: K/V statistics of a model on text disjoint from every evaluation text.

:func:`collect` runs the fp32 base (an exact cache) over chunks of ``data/text/calibration.txt``
(KJV Genesis 1-11, Python ``difflib``/``calendar``, MPL-2.0 + Artistic: other books, modules and
licences than the evaluation texts; see ``data/text/README.md``) and keeps, per layer:

* a sample of keys after RoPE, the same keys before RoPE (RoPE undone with the model's own
  tables) and values, ``[N, H, D]`` float32 (``N`` tokens spread over every chunk);
* the second moment of the queries per KV head and channel (summed over the head's query group)
  and of the output projection's columns per KV head and channel: what a key or value error
  costs in each channel (:func:`channel_weights`).

Everything the study fits (codebooks, per-channel means and weights, layer bit allocation) comes
from a :class:`Calibration`, so no evaluation token is ever used to fit a format.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from paged.errors import ConfigError
from .text import text_dir

__all__ = ["Calibration", "collect", "calibration_text", "model_tag", "CALIBRATION_FILE"]

CALIBRATION_FILE = "calibration.txt"


def calibration_text() -> str:
    """The shipped calibration text (never scored)."""
    path = text_dir() / CALIBRATION_FILE
    if not path.is_file():
        raise ConfigError(f"{path} is missing; rebuild it with `python data/text/make_text.py`")
    return path.read_text()


@dataclass
class Calibration:
    """Per-layer samples and channel statistics (see the module docstring). ``source`` names the text."""

    k_post: list[torch.Tensor]   # [N, H, D] keys after RoPE
    k_pre: list[torch.Tensor]    # [N, H, D] the same keys before RoPE
    v: list[torch.Tensor]        # [N, H, D]
    q2: list[torch.Tensor]       # [H, D] mean q_c^2 summed over the KV head's query heads (after RoPE)
    wo2: list[torch.Tensor]      # [H, D] sum over the group's query heads of |W_o[:, head*D + c]|^2
    num_tokens: int
    source: str
    model_tag: str               # layers x kv heads x head_dim, to refuse another model's statistics

    @property
    def num_layers(self) -> int:
        return len(self.v)

    def mean(self, side: str, layer: int) -> torch.Tensor:
        """Per-channel mean ``[H, D]`` of ``side`` in ``("k_pre", "k_post", "v")``."""
        return getattr(self, side)[layer].mean(0)

    def channel_weights(self, side: str, layer: int, centered: bool) -> torch.Tensor:
        """Error-aware per-channel scaling ``a`` ``[H, D]`` (geometric mean 1) for ``side``.

        Quantizing ``a * x`` with error of equal size in every channel gives ``x`` an error
        ``e_c / a_c``; what it costs is ``sum_c w_c e_c^2 / a_c^2`` (``w``: query second moment
        for keys, ``W_o`` column energy for values) while the error size grows with
        ``sum_c a_c^2 s_c`` (``s``: the stored channel's second moment). Their product is least at
        ``a_c = (w_c / s_c) ** (1/4)``. Keys tie each RoPE pair (c, c + D/2) to one weight so the
        scaling commutes with RoPE (pre- and post-RoPE keys get the same weights).
        """
        x = getattr(self, side)[layer]
        s = (x - x.mean(0)).pow(2).mean(0) if centered else x.pow(2).mean(0)
        w = self.q2[layer] if side.startswith("k") else self.wo2[layer]
        if side.startswith("k"):
            half = s.shape[-1] // 2
            s = (s[..., :half] + s[..., half:]).repeat(1, 2)
            w = (w[..., :half] + w[..., half:]).repeat(1, 2)
        a = (w.clamp_min(1e-12) / s.clamp_min(1e-12)) ** 0.25
        return a / a.log().mean(-1, keepdim=True).exp()


class _Recorder:
    """Exact attention that records K (post and pre RoPE), V and query second moments."""

    def __init__(self, model, keep: torch.Tensor) -> None:
        self.model, self.keep = model, keep
        cfg = model.config
        self.rows: dict[str, list[list[torch.Tensor]]] = {n: [[] for _ in range(cfg.num_layers)]
                                                          for n in ("k_post", "k_pre", "v")}
        self.q2 = [torch.zeros(cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
        self.nq = 0

    def __call__(self, layer: int, q, k, v):
        from .attention import attend
        q, k, v = q.float(), k.float(), v.float()
        t, h = k.shape[0], k.shape[1]
        from kernels.split import unrope
        cos, sin = self.model.rope.cos[:t], self.model.rope.sin_signed[:t]
        keep = self.keep[self.keep < t]
        self.rows["k_post"][layer].append(k[keep])
        self.rows["k_pre"][layer].append(unrope(k, cos, sin)[keep])
        self.rows["v"][layer].append(v[keep])
        self.q2[layer] += q.pow(2).reshape(t, h, -1, q.shape[-1]).sum((0, 2))
        if layer == 0:
            self.nq += t
        return attend(q, k, v).to(q.dtype)


@torch.inference_mode()
def collect(lm, chunks: Sequence[Sequence[int]] | None = None, *, context_length: int = 512,
            max_chunks: int = 8, tokens_per_chunk: int | None = None, source: str = CALIBRATION_FILE) -> Calibration:
    """Run the fp32 base over calibration chunks (None = ``max_chunks`` chunks of
    ``context_length`` tokens of :func:`calibration_text`, spread evenly over the file) and keep
    every token (or ``tokens_per_chunk`` evenly spaced ones, position 0 included) of each."""
    model, cfg = lm.model, lm.config
    if chunks is None:
        ids = lm.tokenizer.encode(calibration_text(), add_special_tokens=False)
        n = len(ids) // context_length
        if n < 1:
            raise ConfigError(f"the calibration text has {len(ids)} tokens, fewer than one chunk of {context_length}")
        picks = sorted({round(i * (n - 1) / max(1, min(n, max_chunks) - 1)) for i in range(min(n, max_chunks))})
        chunks = [ids[i * context_length:(i + 1) * context_length] for i in picks]
    longest = max(len(c) for c in chunks)
    keep = torch.linspace(0, longest - 1, min(tokens_per_chunk or longest, longest)).round().long().unique()
    rec = _Recorder(model, keep)
    model.rope.ensure(torch.tensor([longest - 1]))
    for ids in chunks:
        model(torch.tensor(list(ids), dtype=torch.long), torch.arange(len(ids)), rec)
    hd, nkv = cfg.head_dim, cfg.num_kv_heads
    wo2 = []
    for layer in model.layers:
        w = layer.self_attn.o_proj.weight.detach().float()  # [hidden, heads * D]
        col = w.pow(2).sum(0).reshape(cfg.num_heads, hd)
        wo2.append(col.reshape(nkv, cfg.num_heads // nkv, hd).sum(1))
    cat = {n: [torch.cat(r) for r in rows] for n, rows in rec.rows.items()}
    return Calibration(cat["k_post"], cat["k_pre"], cat["v"], [q / rec.nq for q in rec.q2], wo2,
                       sum(len(c) for c in chunks), source, model_tag(cfg))


def model_tag(cfg) -> str:
    """``"L30xH3xD64"``: the cache geometry a calibration artefact belongs to."""
    return f"L{cfg.num_layers}xH{cfg.num_kv_heads}xD{cfg.head_dim}"
