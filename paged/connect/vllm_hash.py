"""Block hashes equal to vLLM's, for the same tokens: ``LLM(hash_fn=vllm_sha256)``.

vLLM 0.32 hashes block i as ``H((hash(block i-1), tuple(token ids of block i), extra_keys))`` with
block 0's parent ``NONE_HASH = H(seed)`` (``vllm/v1/core/kv_cache_utils.py``), H its
``prefix_caching_hash_algo``: ``sha256`` (default; SHA-256 of ``pickle.dumps(obj, HIGHEST_PROTOCOL)``,
seed ``PYTHONHASHSEED`` or ``"vllm-none-hash"``; reproducible across processes with the same pickle
protocol, 5 on Python 3.8+): ``vllm_sha256``; ``sha256_cbor`` (canonical CBOR, across languages):
``vllm_sha256_cbor`` (needs ``cbor2``); ``xxhash`` / ``xxhash_cbor``: random per-process seed unless
``PYTHONHASHSEED`` is set, not reproducible by design.

Published as ints, a hash is its low 64 bits (``wire.to_int_hash``). Our engine puts extra keys
(cache salt, adapter) into block 0's seed while vLLM adds them to each block's key, so only
requests without extra keys get vLLM's hashes (others get distinct, still chained ones). Our
seed call ``hash_fn(b"", (), ("seed", *extra_keys))`` maps to ``NONE_HASH``.
"""
from __future__ import annotations

import functools
import hashlib
import os
import pickle
from typing import Any, Callable, Hashable

from paged.errors import ConfigError

DEFAULT_SEED = "vllm-none-hash"
_PICKLE_PROTOCOL = 5  # pickle.HIGHEST_PROTOCOL on every Python vLLM supports


def _sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=_PICKLE_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    try:
        import cbor2
    except ImportError:
        raise ConfigError("vllm_sha256_cbor needs the cbor2 package (pip install cbor2)") from None
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def none_hash(serialize: Callable[[Any], bytes] = _sha256_pickle) -> bytes:
    """vLLM's parent of block 0: ``H(seed)``, seed = ``PYTHONHASHSEED`` or ``"vllm-none-hash"``."""
    return serialize(os.environ.get("PYTHONHASHSEED", DEFAULT_SEED))


def _make(serialize: Callable[[Any], bytes], name: str):
    root = functools.cache(lambda: none_hash(serialize))  # NONE_HASH, computed at the first seed call

    def fn(parent: Hashable, token_ids: tuple[int, ...], extra_keys: tuple) -> bytes:
        if not token_ids and extra_keys[:1] == ("seed",):  # our BlockHasher's seed call
            if len(extra_keys) == 1:
                return root()
            return serialize(("paged-extra-keys", none_hash(serialize), tuple(extra_keys[1:])))
        return serialize((parent, tuple(token_ids), tuple(extra_keys) if extra_keys else None))
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = f"vLLM's ``{name.removeprefix('vllm_')}`` block hash (see paged.connect.vllm_hash)."
    return fn


vllm_sha256 = _make(_sha256_pickle, "vllm_sha256")
vllm_sha256_cbor = _make(_sha256_cbor, "vllm_sha256_cbor")
