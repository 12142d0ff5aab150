"""Greedy text under each KV format on the real engine, side by side: ``side_by_side`` steps one
engine per format in lockstep on one prompt (live view: ``paged.viz.quant.live_side_by_side``; the
demo's ``kv_format_comparison`` measures the same agreement over several prompts, with capacity).
"""
from __future__ import annotations

import time
from typing import Sequence

import pandas as pd

__all__ = ["side_by_side"]


def side_by_side(prompt: str, formats: Sequence[str] = ("fp32", "int4"), max_tokens: int = 40, *,
                 model=None, on_token=None) -> pd.DataFrame:
    """Generate ``prompt`` greedily with the real engine under each engine format
    (``paged.LLM(kv_cache_dtype=...)``, or a served study name such as ``"kivi_g32/int4"``: see
    :func:`paged.quant.schemes.engine_settings`), stepping the engines in lockstep; ``on_token(texts)``
    is called after every step with the texts so far (a live view: ``paged.viz.quant.live_side_by_side``).
    ``decode_tokens_per_s``: tokens after the first over the wall time of the steps that made them
    (the engines take turns, so a busy neighbour slows both alike)."""
    from paged.engine.llm import LLM
    from paged.engine.sampling import SamplingParams
    from paged.quant.runs import load
    from paged.quant.schemes import engine_settings

    lm = load(model)
    settings = [{"block_size": 16, **engine_settings(f)} for f in formats]  # study-only names fail here
    engines = [LLM(lm, num_blocks=64, **kw).engine for kw in settings]
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for e in engines:
        e.add_request("same-prompt", prompt, sp)
    toks: list[list[int]] = [[] for _ in engines]
    busy = [0.0 for _ in engines]  # seconds of decode steps (after the prefill step)
    while any(e.has_unfinished_requests() for e in engines):
        for i, e in enumerate(engines):
            if e.has_unfinished_requests():
                t0 = time.perf_counter()
                out = e.step()
                if toks[i]:
                    busy[i] += time.perf_counter() - t0
                toks[i] += [t for sid, t in out.new_tokens.items() if sid == "same-prompt"]
        if on_token is not None:
            on_token(formats, [lm.tokenizer.decode(t) for t in toks], toks)
    first = next((j for j, ab in enumerate(zip(*toks)) if len(set(ab)) > 1), min(map(len, toks)))
    return pd.DataFrame({"format": list(formats), "text": [lm.tokenizer.decode(t) for t in toks],
                         "num_tokens": [len(t) for t in toks], "first_divergence": first,
                         "decode_tokens_per_s": [(len(t) - 1) / b if b > 0 else float("nan") for t, b in zip(toks, busy)]})
