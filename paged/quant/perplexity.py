"""Perplexity through the serving engine, with llama-perplexity's chunking.

``perplexity(llm, texts, context_length=512)`` sends every chunk (see :mod:`paged.quant.text`)
as its own request with ``SamplingParams(prompt_logprobs=0, max_tokens=1)``: each chunk runs
from empty blocks of the paged cache in ``llm``'s ``kv_cache_dtype`` (quantize-on-write,
dequantize-on-read, prefill included), and the scored second half's log-probabilities come
back on ``RequestOutput.prompt_logprobs``. No cache is shared between chunks (prompt log-prob
requests bypass the prefix cache).
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np
import pandas as pd

from .text import Chunk, load_texts, make_chunks, scored_slice

__all__ = ["perplexity", "chunk_nll"]


def chunk_nll(llm, chunks: Sequence[Chunk]) -> list[np.ndarray]:
    """Per chunk, the NLL (nats) of the scored tokens ``ctx // 2 + 1 .. ctx - 1`` via the engine."""
    from paged.engine.sampling import SamplingParams
    if not chunks:
        return []
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, ignore_eos=True)
    outs = llm.generate([list(c.ids) for c in chunks], sp)
    res = []
    for c, o in zip(chunks, outs):
        sl = scored_slice(len(c.ids))
        res.append(np.array([-o.prompt_logprobs[i + 1][c.ids[i + 1]] for i in range(sl.start, sl.stop)]))
    return res


def perplexity(llm, texts: Mapping[str, str | Sequence[int]] | None = None, context_length: int = 512, *,
               max_chunks: int | None = None, bos: bool | None = None) -> pd.DataFrame:
    """PPL per source (and ``"all"``) of ``texts`` (None = the shipped ones) under ``llm``
    (a :class:`paged.LLM`; its ``kv_cache_dtype`` is the format measured). Columns: source,
    kv_cache_dtype, context_length, n_chunks, n_tokens, nll_mean, nll_se, ppl."""
    raw = load_texts() if texts is None else dict(texts)
    chunks = make_chunks(raw, llm.tokenizer, context_length, max_chunks=max_chunks,
                         max_model_len=llm.engine.max_model_len, bos=bos)
    nll = chunk_nll(llm, chunks)
    rows = []
    groups = {src: [n for c, n in zip(chunks, nll) if c.source == src]
              for src in dict.fromkeys(c.source for c in chunks)}
    groups["all"] = nll
    for src, parts in groups.items():
        x = np.concatenate(parts)
        rows.append({"source": src, "kv_cache_dtype": llm.engine.config.kv_cache_dtype,
                     "context_length": context_length, "n_chunks": len(parts), "n_tokens": len(x),
                     "nll_mean": float(x.mean()),
                     "nll_se": float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else float("nan"),
                     "ppl": math.exp(x.mean())})
    return pd.DataFrame(rows)
