"""The shipped held-out texts and llama-perplexity's chunking.

Sources (``data/text/``, provenance and licences in its README): ``kjv`` public-domain prose,
``python`` Python standard-library source (PSF licence), ``licenses`` GPL-3 + Apache-2.0 from
``/usr/share/common-licenses`` (the text of the llama.cpp run quoted in issue 10; a *memorised*
control: licence texts are all over training data, so they deflate perplexity and KL).

Chunking (llama.cpp ``perplexity.cpp``): the token stream is cut into ``n = len // ctx``
non-overlapping chunks of ``ctx`` tokens; the cache is cleared per chunk; the first token of a
chunk becomes BOS only when the tokenizer adds BOS (SmolLM2's GGUF says ``add_bos_token =
False``, so llama.cpp adds none); positions ``ctx // 2 .. ctx - 2`` are scored, each
predicting the next token: ``ctx - 1 - ctx // 2`` tokens per chunk (255 at 512).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from paged.errors import ConfigError

__all__ = ["SOURCES", "text_dir", "load_texts", "Chunk", "make_chunks", "scored_slice"]

SOURCES = {"kjv": "kjv_prose.txt", "python": "python_stdlib.txt", "licenses": "licenses.txt"}


def text_dir() -> Path:
    """``data/text`` of this checkout (the package is used from the repository)."""
    return Path(__file__).resolve().parents[2] / "data" / "text"


def load_texts(sources: Sequence[str] | None = None) -> dict[str, str]:
    """``{source: text}`` for the named shipped sources (None = all three)."""
    out = {}
    for name in SOURCES if sources is None else sources:
        if name not in SOURCES:
            raise ConfigError(f"unknown text source {name!r}; use one of {list(SOURCES)} or pass texts={{label: text}}")
        path = text_dir() / SOURCES[name]
        if not path.is_file():
            raise ConfigError(f"{path} is missing; rebuild it with `python data/text/make_text.py`")
        out[name] = path.read_text()
    return out


@dataclass(frozen=True, slots=True)
class Chunk:
    """One chunk of ``ctx`` token ids from ``source`` (``index``-th of that source)."""

    source: str
    index: int
    ids: tuple[int, ...]


def scored_slice(ctx: int) -> slice:
    """Rows of a chunk's logits that llama-perplexity scores (each predicts the next token)."""
    return slice(ctx // 2, ctx - 1)


def make_chunks(texts: Mapping[str, str | Sequence[int]], tokenizer, ctx: int, *,
                max_chunks: int | None = None, max_model_len: int | None = None,
                bos: bool | None = None) -> list[Chunk]:
    """Tokenize ``texts`` (strings, or token-id lists used as they are) and cut chunks of ``ctx``.

    ``bos=None`` follows the tokenizer (llama.cpp's rule); ``max_chunks`` caps chunks per source.
    """
    if not isinstance(ctx, int) or ctx < 4:
        raise ConfigError(f"context_length must be an integer >= 4, got {ctx!r}")
    if max_model_len is not None and ctx > max_model_len:
        raise ConfigError(f"context_length {ctx} is longer than the model's {max_model_len} positions; "
                          f"use context_length <= {max_model_len}")
    if not texts:
        raise ConfigError("no texts given; pass texts=None for the shipped ones or {label: text}")
    add_bos = (tokenizer is not None and getattr(tokenizer, "add_bos", False)) if bos is None else bos
    out: list[Chunk] = []
    for name, text in texts.items():
        if isinstance(text, str):
            if not text.strip():
                raise ConfigError(f"text {name!r} is empty; give it at least {ctx} tokens")
            if tokenizer is None:
                raise ConfigError("this model has no tokenizer; pass texts as token-id lists")
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = [int(t) for t in text]
        n = len(ids) // ctx
        if n == 0:
            raise ConfigError(f"text {name!r} has {len(ids)} tokens, fewer than one chunk of {ctx}; "
                              "give more text or a shorter context_length")
        if max_chunks is not None:
            n = min(n, max_chunks)
        for i in range(n):
            chunk = ids[i * ctx:(i + 1) * ctx]
            if add_bos and tokenizer.bos_token_id is not None:
                chunk = [tokenizer.bos_token_id, *chunk[1:]]
            out.append(Chunk(name, i, tuple(chunk)))
    return out
