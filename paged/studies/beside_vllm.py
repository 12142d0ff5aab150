"""The same scheduler questions through a vLLM server and our engine, measured the same way.

    prompts = tenant_prompts(tokenizer, 32, systems=8)         # token ids: both see the same prompts
    df = scheduler_questions(llm, speaker, ours_src, client, server_src, prompts, max_tokens=32)

``llm`` is our engine speaking vLLM's protocols through ``speaker`` (``paged.connect.speak``, best with
``hash_fn=paged.connect.vllm_sha256`` so equal blocks have equal hashes), ``ours_src`` the
``paged.connect`` source on it; ``client`` a ``paged.connect.Client`` (or ``VLLMServer``) and
``server_src`` the source on that server. Each mode resets both prefix caches, then runs the
prompts one at a time (``sequential``) or all at once (our ``generate`` with every prompt queued;
concurrent HTTP requests to the server), and reads both sides through their sources: prefix-cache
queries and hits (tokens, from the metrics), blocks stored and evicted and the distinct hashes
stored (from the KV events), preemptions (metrics). One row per (mode, engine).

Chat prompts: request i = system prompt ``i % systems`` + its own question; system prompt k is a
rule-set line and two of ``prefix_caching.SYSTEM_PROMPTS`` (~95 tokens with SmolLM2's tokenizer:
two full blocks of 32 shared by every request of that system prompt).
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import pandas as pd

from paged.engine import SamplingParams
from paged.runs import TOPICS

from .prefix_caching import SYSTEM_PROMPTS

MODES = ("sequential", "all at once")


def system_prompt(k: int) -> str:
    """System prompt ``k`` (distinct for every k)."""
    return f"Rule set {k}. {SYSTEM_PROMPTS[k % len(SYSTEM_PROMPTS)]} {SYSTEM_PROMPTS[(k + 1) % len(SYSTEM_PROMPTS)]}"


def tenant_prompts(tokenizer: Any, n: int, systems: int = 4) -> list[list[int]]:
    """``n`` prompts as token ids over ``systems`` system prompts (tenants; plain text, no chat
    template: ``paged.studies.demo.chat_prompts`` is the one-system chat-template variant)."""
    return [tokenizer.encode(f"{system_prompt(i % systems)}\nUser: Explain {TOPICS[i % len(TOPICS)]} "
                             f"to student {i}.\nAssistant:") for i in range(n)]


def settle(source: Any, quiet: float = 0.5, timeout: float = 20.0) -> None:
    """Wait until no KV-event batch arrived at ``source`` for ``quiet`` seconds (at most ``timeout``)."""
    deadline, last, since = time.monotonic() + timeout, source.status.get("batches"), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        n = source.status.get("batches")
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return


def measure(source: Any, run: Any) -> dict:
    """What ``source`` saw while ``run()`` ran: queries, hits, stored, evicted, preemptions, and the
    set of hashes stored (``hashes``)."""
    settle(source)
    source.scrape_now()
    r0, f0, t0 = dict(source.rows[-1]), source.forest.counts(), source.now
    pre0 = source.server_rows[-1]["num_preemptions"]
    run()
    settle(source)
    source.scrape_now()
    r1, f1 = source.rows[-1], source.forest.counts()
    hashes = {h for h, n in source.forest.nodes.items() if any(t >= t0 and w == "stored" for t, w in n.history)}
    return {"queries": r1["prefix_cache_queries"] - r0["prefix_cache_queries"],
            "hits": r1["prefix_cache_hits"] - r0["prefix_cache_hits"],
            "stored": f1["stored"] - f0["stored"], "evicted": f1["removed"] - f0["removed"],
            "preemptions": int(source.server_rows[-1]["num_preemptions"] - pre0), "hashes": hashes}


def scheduler_questions(llm: Any, speaker: Any, ours_source: Any, client: Any, server_source: Any,
                        prompts: Sequence[Sequence[int]],
                        max_tokens: int = 32, modes: Sequence[str] = MODES) -> pd.DataFrame:
    """One row per (mode, engine): queries, hits, stored, distinct, evicted, preemptions, and the
    distinct hashes both engines stored (``shared``); see the module docstring."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    for mode in modes:
        client.reset_prefix_cache()
        llm.kv_manager.reset_prefix_cache()
        sequential = mode == "sequential"

        def ours() -> None:
            for batch in ([[p] for p in prompts] if sequential else [list(prompts)]):
                llm.generate(batch, sp)
            speaker.update_metrics()

        def theirs() -> None:
            if sequential:
                for p in prompts:
                    client.complete(p, max_tokens=max_tokens)
                return
            with ThreadPoolExecutor(len(prompts)) as ex:
                list(ex.map(lambda p: client.complete(p, max_tokens=max_tokens, timeout=600), prompts))
        o, v = measure(ours_source, ours), measure(server_source, theirs)
        shared = len(o["hashes"] & v["hashes"])
        for engine, m in (("ours", o), ("vllm", v)):
            hashes = m.pop("hashes")
            rows.append({"mode": mode, "engine": engine, **m, "distinct": len(hashes), "shared": shared})
    return pd.DataFrame(rows, columns=["mode", "engine", "queries", "hits", "stored", "distinct", "evicted",
                                       "preemptions", "shared"])
