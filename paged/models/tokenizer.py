"""Tokenizers built from a GGUF file's metadata or a HF directory's ``tokenizer.json``.

GGUF ``tokenizer.ggml.model == "gpt2"``: a byte-level BPE (``tokenizers``) from the file's vocabulary
and merges, pre-tokenized per ``tokenizer.ggml.pre``: ``smollm`` splits every digit, then the GPT-2
regex *without* a prefix space (``add_prefix_space=True`` would silently change ids). Control tokens
(type 3) are special tokens, so ``<|im_start|>`` stays one token; user-defined ones (type 4) too, but
decode as text.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

from paged.errors import ModelLoadError

# llama.cpp token types
_CONTROL = 3
_USER_DEFINED = 4

_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class Tokenizer:
    """Thin wrapper: ``encode(text) -> ids``, ``decode(ids) -> text`` plus special ids."""

    def __init__(self, tok: Any, bos_token_id: int | None, eos_token_id: int | None,
                 add_bos: bool = False, chat_template: str | None = None) -> None:
        self._tok = tok
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos = add_bos
        self.chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def save(self, path: str) -> None:
        """Write the tokenizer as ``tokenizer.json`` (the ``tokenizers`` library's format; an HF export)."""
        self._tok.save(path)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` with the checkpoint's Jinja chat template (needs jinja2)."""
        if not self.chat_template:
            raise ModelLoadError("this tokenizer has no chat template")
        import jinja2
        template = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt)


def tokenizer_from_gguf(reader: Any) -> Tokenizer:
    """Build the tokenizer stored in a GGUF file (byte-level BPE, ``gpt2`` model)."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    from .gguf_loader import gguf_field

    kind = gguf_field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2'); "
                             "pass prompts as token-id lists")
    pre = gguf_field(reader, "tokenizer.ggml.pre", "default")
    tokens: list[str] = list(gguf_field(reader, "tokenizer.ggml.tokens"))
    types = gguf_field(reader, "tokenizer.ggml.token_type")
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in gguf_field(reader, "tokenizer.ggml.merges")]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("llama-bpe", "llama3"):
        from tokenizers import Regex
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre in ("default", "gpt2", "gpt-2"):
        tok.pre_tokenizer = byte_level
    else:
        raise ModelLoadError(f"GGUF pre-tokenizer {pre!r} is not supported (smollm, llama-bpe, gpt2); "
                             "pass prompts as token-id lists")
    tok.decoder = decoders.ByteLevel()
    if types is not None:
        # both stay one token in text; only control tokens are skipped by skip_special_tokens
        # (llama.cpp prints user-defined tokens as text, control tokens only on request)
        kinds = [int(t) for t in types]
        tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, k in enumerate(kinds) if k == _CONTROL])
        tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                        for i, k in enumerate(kinds) if k == _USER_DEFINED])
    bos = gguf_field(reader, "tokenizer.ggml.bos_token_id")
    eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
    return Tokenizer(tok, None if bos is None else int(bos), None if eos is None else int(eos),
                     add_bos=bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", False)),
                     chat_template=gguf_field(reader, "tokenizer.chat_template"))


def tokenizer_from_hf_dir(path: str) -> Tokenizer | None:
    """``tokenizer.json`` of a HF directory, or None when the directory has none."""
    import json

    from tokenizers import Tokenizer as HFTokenizer
    tj = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tj):
        return None
    tok = HFTokenizer.from_file(tj)
    cfg: dict[str, Any] = {}
    tc = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(tc):
        with open(tc) as f:
            cfg = json.load(f)

    def tid(key: str) -> int | None:
        v = cfg.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        return tok.token_to_id(v) if isinstance(v, str) else None

    # tokenizer.json post-processors may add BOS themselves; we add none ourselves.
    wrapper = Tokenizer(tok, tid("bos_token"), tid("eos_token"), chat_template=cfg.get("chat_template"))

    def encode(text: str, add_special_tokens: bool = True) -> list[int]:
        return tok.encode(text, add_special_tokens=add_special_tokens).ids
    wrapper.encode = encode  # type: ignore[method-assign]
    return wrapper
