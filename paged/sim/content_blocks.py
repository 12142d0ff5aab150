"""Traces with block-level content: each request's prompt named as a list of content blocks.

A trace may carry, per request, ``block_hashes``: the ids of the content blocks its prompt is made
of, each ``content_block_size`` tokens (a trace-level value, ``trace.attrs["content_block_size"]``),
the last one possibly partial. This is what Mooncake's traces publish (``hash_ids``, 512-token
blocks; FAST'25, ``kvcache-ai/Mooncake``, ``FAST25-release/traces``). Invariants of a valid row:
``len(block_hashes) == ceil(prompt_tokens / content_block_size)``, every id an integer in
``[0, 2**63)``, and no ``prefix_id`` beside it (one way of naming shared content per row).

Prompt tokens are made from the ids (``block_tokens``): token ``o`` of block id ``h`` is a fixed
hash of ``(seed, h, o)``, so **equal ids mean equal tokens** and a partial block is a prefix of
the same id's full block. Two different ids are taken to differ from their first token on (the
trace cannot say more). The simulator draws these tokens from the 240 ids 17..256
(``SMALL_TOKEN_HI``): Python shares int objects up to 256, so a waiting 12k-token prompt costs 8
bytes per token instead of 36 (the full Mooncake conversation trace queues thousands of them);
two different KV blocks of ``b`` tokens then agree by chance with probability ``240**-b`` (1e-38
at ``b = 16``; a chance hit would still be verified token for token). Hence, for ``b``:

- ``b`` divides ``content_block_size``: the KV cache sees exactly the trace's reuse (a leading run
  of ``k`` shared ids is ``k * content_block_size`` shared tokens, cut to whole KV blocks only
  inside a partial last block);
- any other ``b`` (e.g. 48, or 1,024 over 512-token blocks) is accepted as a documented
  approximation: the shared tokens are the trace's, floored to whole KV blocks, which is what a
  real cache would reuse *if* differing blocks differed from their first token.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

__all__ = ["BLOCK_COLUMN", "BLOCK_SIZE_ATTR", "SMALL_TOKEN_HI", "block_tokens", "check_block_column",
           "content_block_size", "cut_blocks"]

BLOCK_COLUMN = "block_hashes"
BLOCK_SIZE_ATTR = "content_block_size"
_ID_LIMIT = 2**63
SMALL_TOKEN_HI = 257  # token ids below this are shared int objects in CPython (see the module doc)

# splitmix64 constants (Steele, Lea, Flood 2014): a bijective mix of 64-bit words
_GOLDEN, _M1, _M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_OFFSET_MUL = np.uint64(0xD6E8FEB86659FD93)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise over uint64 (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def block_tokens(ids: Sequence[int] | np.ndarray, num_tokens: int, block_size: int, *, seed: int,
                 lo: int, hi: int) -> np.ndarray:
    """The ``num_tokens`` prompt tokens (int64 in ``[lo, hi)``) of content blocks ``ids`` of
    ``block_size`` tokens: token ``o`` of block ``h`` depends on ``(seed, h, o)`` only."""
    ids = np.asarray(ids, dtype=np.int64).astype(np.uint64)
    k = -(-num_tokens // block_size)
    seed_word = np.uint64((seed * int(_GOLDEN)) % 2**64)  # Python ints: no scalar overflow warning
    key = _mix(ids[:k] * _GOLDEN + seed_word)  # one word per (seed, id)
    off = np.arange(block_size, dtype=np.uint64) * _OFFSET_MUL + _GOLDEN
    x = _mix(key[:, None] ^ off[None, :]).reshape(-1)[:num_tokens]
    return (np.uint64(lo) + x % np.uint64(hi - lo)).astype(np.int64)


def content_block_size(trace: Any) -> int:
    """The trace-level block size of ``block_hashes`` (``trace.attrs["content_block_size"]``)."""
    return int(trace.attrs[BLOCK_SIZE_ATTR])


def check_block_column(values: Sequence[Any], prompt_tokens: np.ndarray, block_size: Any,
                       prefix_id: np.ndarray, src: str, rows: Sequence[int], shown: str = BLOCK_COLUMN,
                       error: type[Exception] = ValueError) -> list[np.ndarray]:
    """Each row's block ids as an int64 array, checked (see the module invariants). ``rows``: the
    row number of each position in errors; ``shown``: the column's name in the file."""
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise error(f"{src}: a trace with {shown!r} needs trace.attrs[{BLOCK_SIZE_ATTR!r}] = the tokens per "
                    f"content block (an integer >= 1, 512 for Mooncake), got {block_size!r}")
    bs = int(block_size)
    out: list[np.ndarray] = []
    for i, v in enumerate(values):
        ids = _as_ids(v)
        if ids is None:
            raise error(f"{src}: row {rows[i]}, column {shown!r}: got {_short(v)}, need a list of integer "
                        f"block ids in [0, 2**63)")
        n = int(prompt_tokens[i])
        need = -(-n // bs)
        if len(ids) != need:
            raise error(f"{src}: row {rows[i]}, column {shown!r}: {len(ids)} block ids of {bs} tokens for a "
                        f"prompt of {n} tokens; need ceil({n} / {bs}) = {need} ids")
        if prefix_id[i] >= 0:
            raise error(f"{src}: row {rows[i]}: give either {shown!r} or prefix_id/prefix_tokens, not both")
        out.append(ids)
    return out


def _as_ids(v: Any) -> np.ndarray | None:
    """``v`` as a read-only int64 array of ids in [0, 2**63), or None if it is not one."""
    if isinstance(v, np.ndarray):
        if v.ndim != 1 or (v.size and v.dtype.kind not in "iu"):
            return None
        if v.size and v.dtype.kind == "u" and int(v.max()) >= _ID_LIMIT:
            return None
        arr = v.astype(np.int64)  # a copy: the trace's own array is never shared
    elif isinstance(v, (list, tuple)):
        if not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) and 0 <= x < _ID_LIMIT for x in v):
            return None
        arr = np.array(v, dtype=np.int64)
    else:
        return None
    if arr.size and arr.min() < 0:
        return None
    arr.flags.writeable = False
    return arr


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def cut_blocks(ids: np.ndarray, prompt_tokens: int, block_size: int) -> np.ndarray:
    """The ids of a prompt cut to its first ``prompt_tokens`` tokens."""
    return ids[: -(-prompt_tokens // block_size)]
