"""Prefix caching: shared system prompts, what hits save, LRU eviction under pressure, verified hits
(records here; figures in ``paged.viz.prefix``).

Invariants: ``compare_caching`` runs the same prompts and sampling with caching on and off on one
loaded model (``outputs_identical`` compares every token); hit rate = ``prefix_cache_hits /
prefix_cache_queries`` (cumulative tokens, as vLLM counts); ``collision_demo``'s *constant* hash
makes every lookup find some block, so only token (and parent) verification decides a hit.
"""

from __future__ import annotations

from typing import Callable, Sequence

import pandas as pd

from paged.runs import TOPICS
from paged.studies.engine_setup import generate_greedy

SYSTEM_PROMPTS = (
    "You are a patient tutor for a university class on operating systems. Answer every question in one short "
    "paragraph, in plain words, with one concrete example from a real system. Say clearly when you are unsure, "
    "and never invent citations or numbers.",
    "You are a terse code reviewer for a team that writes Python services. Point out the single most important "
    "bug first, then suggest a fix in one line of code. Ignore style unless it hides a bug, and be polite.",
    "You are a travel agent who only sells train journeys in Europe. Recommend one route with its duration, "
    "the number of changes and one thing worth seeing on the way. Prefer night trains when they exist.",
    "You are a chemistry lab assistant for first-year students. Always give the safety rule first, then the "
    "answer in two sentences, then the name of the instrument they will need on the bench.",
)


def constant_hash(parent, token_ids, extra_keys) -> int:
    """The worst hash function: every block collides with every other (for demonstrations)."""
    return 0


def shared_prompt_requests(tokenizer, num_requests: int = 8, num_system_prompts: int = 1) -> list[list[int]]:
    """Token-id prompts: request i = system prompt ``i % num_system_prompts`` + its own question."""
    k = max(1, min(num_system_prompts, len(SYSTEM_PROMPTS)))
    return [tokenizer.encode(f"{SYSTEM_PROMPTS[i % k]}\nUser: Explain {TOPICS[i % len(TOPICS)]}.\nAssistant:")
            for i in range(num_requests)]


def compare_caching(loaded_model, prompts, max_tokens: int = 8, settings: Sequence[tuple[str, dict]] | None = None,
                    **engine) -> tuple[pd.DataFrame, dict[str, pd.DataFrame]]:
    """Generate ``prompts`` once per setting (default: caching off, on) on one loaded model. Returns a table
    (prefill tokens computed, hit tokens and rate, peak blocks, wall seconds, outputs identical to the first
    setting) and the step frames by label. Requests are added together; the first request of each system prompt
    computes it and the others hit it when they are scheduled later."""
    import paged

    settings = settings or (("caching off", {"enable_prefix_caching": False}),
                            ("caching on", {"enable_prefix_caching": True}))
    rows, frames, ref = [], {}, None
    for label, kw in settings:
        toks, st, wall = generate_greedy(paged.LLM(loaded_model, **{**engine, **kw}), prompts, max_tokens)
        ref = toks if ref is None else ref
        q, h = int(st["prefix_cache_queries"].iloc[-1]), int(st["prefix_cache_hits"].iloc[-1])
        rows.append({"setting": label, "prefill_tokens_computed": int(st["num_prefill_tokens"].sum()),
                     "prompt_tokens": int(sum(len(p) for p in prompts)), "hit_tokens": h,
                     "hit_rate": h / q if q else 0.0, "peak_blocks": int(st["num_used_blocks"].max()),
                     "steps": len(st), "wall_s": wall, "outputs_identical": toks == ref})
        frames[label] = st
    return pd.DataFrame(rows), frames


def eviction_sweep(pool_blocks: Sequence[int] = (160, 256, 512, 1024, 2048), *, num_prefixes: int = 8,
                   prefix_tokens: int = 512, num_requests: int = 400, rate: float = 20.0, max_model_len: int = 2048,
                   model: str = "llama-2-7b", gpu: str = "a100-80gb", seed: int = 0) -> pd.DataFrame:
    """Simulated hit rate vs pool size with ``num_prefixes`` system prompts of ``prefix_tokens`` (LRU). A small
    pool must evict cached-free prefix blocks (least recently used first) to admit new requests, so a prefix
    that comes back later has to be computed again."""
    from paged.sim.simulator import SimConfig, Simulator
    from paged.sim.workload import synthetic_trace

    trace = synthetic_trace("sharegpt", num_requests, rate=rate, trace_seed=seed, max_model_len=max_model_len,
                            num_prefixes=num_prefixes, prefix_tokens=prefix_tokens)
    rows = []
    for n in pool_blocks:
        s = Simulator(SimConfig(model=model, gpu=gpu, num_blocks=int(n), enable_prefix_caching=True,
                                max_model_len=max_model_len, prompt_seed=seed)).run(trace).summary
        rows.append({"pool_blocks": int(n), "pool_tokens": int(n) * s["block_size"],
                     "prefix_tokens_total": num_prefixes * prefix_tokens, "hit_rate": s["prefix_cache_hit_rate"],
                     "throughput_req_s": s["throughput_req_s"], "ttft_p50_s": s["ttft_p50_s"],
                     "preemptions": s["num_preemptions"], "finished": s["requests_finished"]})
    return pd.DataFrame(rows)


def collision_demo(block_size: int = 4, hash_fn: Callable = constant_hash) -> pd.DataFrame:
    """Three requests on a KVCacheManager whose hash makes every block collide. A holds blocks [1..4][5..8]
    (then finishes: its blocks stay cached-free); B has other tokens; C repeats A's first block. Rows: what the
    hash index returned for each request's first block, what a cache that trusts the hash alone would reuse, and
    what the verified lookup reuses."""
    from paged.core import KVCacheManager, Request

    kv = KVCacheManager(16, block_size, enable_prefix_caching=True, hash_fn=hash_fn)
    a = Request("A", list(range(1, 2 * block_size + 1)), 1)
    kv.allocate_slots(a, a.num_tokens)
    kv.free("A")
    rows = []
    for rid, toks in (("B", list(range(101, 101 + 2 * block_size + 1))),
                      ("C", list(range(1, block_size + 1)) + list(range(201, 201 + block_size + 1)))):
        r = Request(rid, toks, 1)
        indexed = kv.pool.lookup(hash_fn(kv.hasher.seed(r.extra_keys), tuple(toks[:block_size]), ()))
        verified = kv.find_cached_prefix(r)
        rows.append({"request": rid, "first block tokens": tuple(toks[:block_size]),
                     "hash index returns block": indexed.block_id if indexed is not None else None,
                     "that block holds": indexed.token_ids if indexed is not None else None,
                     "hash-only cache would reuse": "yes (wrong KV)" if indexed is not None
                     and indexed.token_ids != tuple(toks[:block_size]) else ("yes" if indexed is not None else "no"),
                     "verified lookup reuses": f"{len(verified)} block(s)"})
    return pd.DataFrame(rows)


__all__ = ["SYSTEM_PROMPTS", "collision_demo", "compare_caching", "constant_hash", "eviction_sweep",
           "shared_prompt_requests"]
