"""Block hashes: xxh3-128 is the default, sha256 stays selectable with unchanged digests, and a
hash that collides everywhere costs hits but never returns another prefix's blocks."""
import hashlib
from array import array

import pytest

from paged import KVCacheManager, Request
from paged.core import prefix_cache as pc
from paged.errors import ConfigError


def test_default_is_xxh3_and_engine_agrees():
    from paged.engine.llm_engine import EngineConfig
    assert pc.DEFAULT_HASH_FN == "xxh3_128" and EngineConfig().hash_fn == "xxh3_128"
    assert KVCacheManager(4, 2).hasher.hash_fn is pc.xxh3_128_hash


def test_sha256_digest_unchanged_by_the_faster_packing():
    toks = (1, 2, 70000, 2**40)
    old = hashlib.sha256(b"p")
    old.update(array("q", toks).tobytes())
    assert pc.sha256_hash(b"p", toks, ()) == old.digest()


def test_xxh3_chains_parent_and_extra_keys():
    h = pc.xxh3_128_hash
    assert len(h(b"", (1, 2), ())) == 16
    assert h(b"a", (1, 2), ()) != h(b"b", (1, 2), ()) != h(b"b", (1, 2), ("salt",))


@pytest.mark.parametrize("bs", [1, 3, 16])
def test_xxh3_bulk_chain_equals_one_call_per_block(bs):
    """BlockHasher.extend packs all new blocks at once for xxh3: the same digests as chaining
    xxh3_128_hash block by block, also when it resumes after earlier hashes."""
    import random
    rng = random.Random(bs)
    toks = [rng.randrange(0, 2**40) for _ in range(7 * bs + bs // 2)]  # 7 full blocks and a partial one
    hasher = pc.BlockHasher(bs, "xxh3_128")
    want, parent = [], hasher.seed(("salt",))
    for i in range(7):
        parent = pc.xxh3_128_hash(parent, tuple(toks[i * bs:(i + 1) * bs]), ())
        want.append(parent)
    got: list = []
    hasher.extend(got, toks, ("salt",), 3 * bs + bs // 2)  # 3 blocks, then resume to 7
    hasher.extend(got, toks, ("salt",), len(toks))
    assert got == want


def test_unknown_hash_is_a_config_error():
    with pytest.raises(ConfigError, match="xxh3_128"):
        KVCacheManager(4, 2, hash_fn="md5")


@pytest.mark.parametrize("hash_fn", ["xxh3_128", "sha256", lambda parent, tokens, extra: b"same"])
def test_hits_need_equal_tokens(hash_fn):
    kv = KVCacheManager(16, 2, enable_prefix_caching=True, hash_fn=hash_fn)
    a = Request("a", [1, 2, 3, 4, 5], max_tokens=1)
    kv.allocate_slots(a, a.num_tokens)
    kv.free("a")
    same, other = Request("s", [1, 2, 3, 4, 9], max_tokens=1), Request("o", [7, 8, 3, 4, 5], max_tokens=1)
    found = kv.find_cached_prefix(same)
    assert [b.token_ids for b in found] == [(1, 2), (3, 4)][:len(found)]
    assert len(found) == (1 if callable(hash_fn) else 2)  # a collision costs the second hit
    assert kv.find_cached_prefix(other) == []


def test_engine_default_follows_the_fallback_without_xxhash():
    # without the xxhash package the core falls back to sha256; the engine's default must follow
    # (a hard-coded "xxh3_128" made every default LLM() fail with a ConfigError there)
    import subprocess
    import sys
    code = ("import sys; sys.modules['xxhash'] = None\n"
            "from paged.core import prefix_cache as pc\n"
            "from paged.engine.llm_engine import EngineConfig\n"
            "assert pc.DEFAULT_HASH_FN == 'sha256', pc.DEFAULT_HASH_FN\n"
            "assert EngineConfig().hash_fn == 'sha256', EngineConfig().hash_fn\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
