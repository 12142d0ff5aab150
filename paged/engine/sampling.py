"""Sampling parameters and the sampler (greedy, temperature, top-k, top-p, seeds).

Invariants: ``temperature == 0`` is greedy (argmax, ties to the lowest id); a request with a
``seed`` draws from its own ``torch.Generator`` row by row, so its tokens do not depend on
what else is in the batch; sample ``k`` of an ``n > 1`` request uses seed ``(seed, k)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from paged.checks import is_int, need_flag, need_int, need_real
from paged.errors import InvalidRequestError


@dataclass
class SamplingParams:
    """Per-request generation settings (names follow vLLM).

    ``n`` samples share the prompt's blocks (fork); ``use_beam_search`` keeps ``n`` beams
    (``beam_width`` = n) scored by summed log-probabilities, with copy-on-write of shared
    blocks. ``stop_token_ids`` end a sequence (EOS too unless ``ignore_eos``); the stop
    token is kept in ``token_ids``. ``logprobs``/``prompt_logprobs`` follow vLLM: a
    ``{token_id: logprob}`` per position holding the chosen (or prompt) token plus the top-k,
    from the raw model distribution; ``prompt_logprobs[0]`` is None (the first token has no
    context). Prompt log-probs bypass the prefix cache (each such request gets its own salt).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0              # 0 or -1: disabled
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: Sequence[int] = field(default_factory=tuple)
    ignore_eos: bool = False
    use_beam_search: bool = False
    length_penalty: float = 1.0
    skip_special_tokens: bool = True
    logprobs: int | None = None         # top log-probs per generated token (+ the sampled one)
    prompt_logprobs: int | None = None  # per prompt token; 0 = only the prompt token's own

    def validate(self) -> None:
        """Raise InvalidRequestError naming the bad field and its valid range; integer fields
        given as numpy integers become ints (one rule: ``paged.checks``)."""
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"SamplingParams: {msg}")
        self.n = need_int("n", self.n, bad, minimum=1)
        self.max_tokens = need_int("max_tokens", self.max_tokens, bad, minimum=1)
        self.temperature = need_real("temperature", self.temperature, bad, minimum=0.0, hint="0 = greedy")
        self.top_p = need_real("top_p", self.top_p, bad, minimum=0.0, maximum=1.0, open_min=True)
        self.top_k = need_int("top_k", self.top_k, bad, minimum=-1, hint="-1 or 0 disable it")
        self.seed = need_int("seed", self.seed, bad, optional=True)
        for name in ("ignore_eos", "use_beam_search", "skip_special_tokens"):
            need_flag(name, getattr(self, name), bad)
        self.length_penalty = need_real("length_penalty", self.length_penalty, bad)
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, Iterable) \
                or any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad(f"stop_token_ids must be a sequence of non-negative integers, got {self.stop_token_ids!r}")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        for name in ("logprobs", "prompt_logprobs"):
            setattr(self, name, need_int(name, getattr(self, name), bad, minimum=0, optional=True,
                                         hint="0 = only the chosen token's"))
        if self.logprobs is not None and (self.n > 1 or self.use_beam_search):
            raise bad("logprobs is supported for n=1 without beam search; drop logprobs or set n=1")
        if self.use_beam_search and self.temperature != 0.0 and self.temperature != 1.0:
            raise bad("beam search is deterministic; leave temperature at its default")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.use_beam_search


def make_generator(seed: int | None, index: int) -> torch.Generator | None:
    """A CPU generator for sample ``index`` of a seeded request (None when unseeded);
    ``sample_row`` draws on the host, so the stream is the same on every device."""
    if seed is None:
        return None
    return torch.Generator(device="cpu").manual_seed((int(seed) * 1_000_003 + index) & 0xFFFF_FFFF_FFFF)


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Scaled float32 logits with entries outside top-k / nucleus top-p set to -inf (1-D)."""
    x = logits.float() / max(temperature, 1e-6)
    if top_k and top_k > 0 and top_k < x.shape[-1]:
        x = x.masked_fill(x < torch.topk(x, top_k).values[-1], float("-inf"))  # below the k-th largest
    if top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, -1)
        drop = probs.cumsum(-1) - probs >= top_p  # keep the smallest prefix whose mass reaches top_p
        drop[0] = False
        x = x.scatter(0, idx, sorted_x.masked_fill(drop, float("-inf")))
    return x


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
               fallback: torch.Generator) -> int:
    """One token from a 1-D logits row."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(filter_logits(logits, params.temperature, params.top_k, params.top_p), -1).cpu()
    return int(torch.multinomial(probs, 1, generator=generator or fallback))


def logprob_dicts(logits: torch.Tensor, tokens: Sequence[int], k: int) -> list[dict[int, float]]:
    """vLLM's logprobs: per row, ``{token: logprob}`` of the chosen ``tokens[i]`` plus the row's
    top-``k`` (so up to k + 1 entries), from the raw model distribution (log-softmax, float32)."""
    lp = torch.log_softmax(logits.float(), -1)
    own = lp.gather(1, torch.as_tensor(list(tokens), device=lp.device).long()[:, None])[:, 0].tolist()
    out = [{int(t): float(v)} for t, v in zip(tokens, own)]
    if k > 0:
        top = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
        for d, vals, ids in zip(out, top.values.tolist(), top.indices.tolist()):
            for t, v in zip(ids, vals):
                d.setdefault(int(t), float(v))
    return out


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Argmax of each row (one device->host copy for the whole batch)."""
    return torch.argmax(logits, dim=-1).tolist()
