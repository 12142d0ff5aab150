"""Our engine speaking vLLM's protocols (paged.connect.speak: kv_events_endpoint, metrics_port) and explaining its
misses (MissLedger), on a tiny random llama: what a subscriber sees is exactly the engine's
prefix index; metrics carry vLLM's names and our counters; every miss has its reason."""
from __future__ import annotations

import pytest

import paged
import paged.connect as pc
from paged.connect import misses as M
from paged.connect.wire import MEDIUM_CPU, to_int_hash
from paged.engine import SamplingParams
from paged.errors import ConfigError

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from paged.models import load_model
    from paged.models.testing import make_tiny_checkpoint
    return load_model(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama"))


def prompts_with_prefix(n, prefix_len=12, tail=3, base=10):
    prefix = list(range(base, base + prefix_len))
    return [prefix + [100 + 7 * i + j for j in range(tail)] for i in range(n)]


def live_hashes(llm):
    return {to_int_hash(h) for h in llm.kv_manager.pool.index}


def test_subscriber_sees_exactly_the_engine_prefix_index_with_evictions_and_reset(tiny, tmp_path):
    ev, rp = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/rp"
    llm = paged.LLM(tiny, block_size=4, num_blocks=10)
    sp = pc.publish(llm, metrics_port=0, kv_events_endpoint={"endpoint": ev, "replay_endpoint": rp, "topic": "kv"})
    with pc.connect(events=ev, replay=rp, topic="kv", metrics=sp.metrics.url, background=False) as src:
        llm.generate(prompts_with_prefix(4) + [list(range(200, 216))], GREEDY)
        kinds = [e[1] for e in llm.engine.recorder.events]
        assert kinds.count("evict") > 0  # the pool is small enough to evict
        assert src.wait_until(lambda s: s.status["last_seq"] == sp.publisher.seq - 1, 5)
        assert src.forest.live == live_hashes(llm)
        assert src.forest.num_stored == kinds.count("cache_block")
        assert src.forest.num_removed == kinds.count("evict")
        src.scrape_now()
        row = src.rows[-1]
        kv = llm.kv_manager
        assert (row["prefix_cache_queries"], row["prefix_cache_hits"]) == (kv.prefix_cache_queries,
                                                                          kv.prefix_cache_hits)
        assert src.cache_config["num_gpu_blocks"] == "10" and src.cache_config["block_size"] == "4"
        text = sp.metrics.text()
        for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                     "vllm:num_preemptions_total", "vllm:time_to_first_token_seconds_bucket",
                     "vllm:request_success_total"):
            assert name in text
        assert 'model_name="' in text and 'engine="0"' in text
        kv.reset_prefix_cache()
        assert src.wait_until(lambda s: not s.forest.live, 5)
        assert src.forest.num_cleared == 1 and not live_hashes(llm)
    sp.close()


def test_published_blocks_chain_to_their_parents_as_the_engine_hashes_them(tiny, tmp_path):
    """Every BlockStored names the right parent_block_hash: the forest built from the events holds, for
    each sequence, the engine's own hash chain (BlockHasher over its tokens), root first, each block under
    the one before it -- not only the same live set."""
    from paged.core.prefix_cache import BlockHasher
    ev = f"ipc://{tmp_path}/ev"
    llm = paged.LLM(tiny, block_size=4, num_blocks=64)
    speaker = pc.publish(llm, kv_events_endpoint=ev)
    hasher = BlockHasher(4, llm.engine.config.cache.hash_fn)
    prompts = prompts_with_prefix(3) + [list(range(200, 217))]
    with pc.connect(events=ev, background=False) as src:
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        assert src.wait_until(lambda s: s.status["last_seq"] == speaker.publisher.seq - 1, 5)
        f = src.forest
        assert f.live == live_hashes(llm) and f.unknown_removed == 0
        chains = []
        for o in outs:
            seq = o.prompt_token_ids + o.outputs[0].token_ids[:-1]  # the last token's KV is never written
            chain: list = []
            hasher.extend(chain, seq, (), len(seq))
            chain = [to_int_hash(h) for h in chain]
            assert len(chain) == len(seq) // 4 >= 4
            assert [f.nodes[h].parent for h in chain] == [None] + chain[:-1]
            assert [f.nodes[h].depth for h in chain] == list(range(len(chain)))
            assert [n.block_hash for n in f.match(seq)] == chain
            chains.append(chain)
        # the shared 12-token prefix is one path of three nodes, the three tails below it; two roots in all
        assert chains[0][:3] == chains[1][:3] == chains[2][:3] != chains[3][:3]
        assert len(f.children[chains[0][2]]) == 3 and len(f.children[None]) == 2
    speaker.close()


def test_host_tier_blocks_are_published_as_cpu_medium(tiny, tmp_path):
    """The CPU tier's forest holds exactly the host entries, each block under the parent it had on the GPU
    (vLLM's offloading events carry their own parent): not every demoted block a root."""
    from paged.core.prefix_cache import BlockHasher
    ev = f"ipc://{tmp_path}/ev"
    llm = paged.LLM(tiny, block_size=4, num_blocks=10, num_cpu_blocks=6, enable_host_tier=True)
    speaker = pc.publish(llm, kv_events_endpoint=ev)
    hasher = BlockHasher(4, llm.engine.config.cache.hash_fn)
    with pc.connect(events=ev, background=False, medium=MEDIUM_CPU) as cpu:
        outs = llm.generate(prompts_with_prefix(3, base=20) + prompts_with_prefix(3, base=60), GREEDY)
        assert llm.kv_manager.host.num_tier_out_blocks > 0
        assert cpu.wait_until(lambda s: s.status["last_seq"] == speaker.publisher.seq - 1, 5)
        assert cpu.forest.live == {to_int_hash(h) for h in llm.kv_manager.host.entries}
        parent_of = {}
        for o in outs:
            seq = o.prompt_token_ids + o.outputs[0].token_ids[:-1]
            chain: list = []
            hasher.extend(chain, seq, (), len(seq))
            chain = [to_int_hash(h) for h in chain]
            parent_of.update(zip(chain, [None] + chain[:-1]))
        nodes = cpu.forest.nodes
        assert {h: n.parent for h, n in nodes.items()} == {h: parent_of[h] for h in nodes}
        assert any(n.parent is not None for n in nodes.values())  # deeper blocks were demoted too
    speaker.close()


def test_bad_settings_are_config_errors(tiny, tmp_path):
    llm = paged.LLM(tiny, block_size=4, num_blocks=8)
    recorder = llm.engine.recorder
    with pytest.raises(ConfigError, match="kv_events_endpoint"):
        pc.publish(llm, kv_events_endpoint=5557)
    with pytest.raises(ConfigError, match="unknown: nope"):
        pc.publish(llm, kv_events_endpoint={"endpoint": "ipc://x", "nope": 1})
    with pytest.raises(ConfigError, match="metrics_port"):
        pc.publish(llm, metrics_port=-1)
    with pytest.raises(ConfigError, match="replay endpoint"):
        pc.publish(llm, kv_events_endpoint={"endpoint": f"ipc://{tmp_path}/e", "replay_endpoint": "tcp://127.0.0.1:1"})
    with pytest.raises(ConfigError, match="kv_events_endpoint .* or metrics_port"):
        pc.publish(llm)
    assert llm.engine.recorder is recorder  # every refusal left the engine untouched (no tap installed)
    with pytest.raises(ConfigError, match="kv_events_endpoint"):  # not an engine setting any more
        paged.LLM(tiny, block_size=4, num_blocks=8, kv_events_endpoint="ipc://x")


def test_vllm_sha256_reproduces_the_known_server_hashes():
    """Hashes a vLLM 0.32 CPU server published for tokens 1000..1063 (block size 32, default
    sha256, no PYTHONHASHSEED), recorded from its KV events."""
    from paged.core.prefix_cache import BlockHasher
    h = BlockHasher(32, pc.vllm_sha256)
    out: list = []
    h.extend(out, list(range(1000, 1075)), (), 75)
    assert [to_int_hash(x) for x in out] == [15055828968291616402, 5204843658281419474]
    salted: list = []
    h.extend(salted, list(range(1000, 1075)), ("salt",), 75)
    assert salted[0] != out[0]  # extra keys still separate requests (not vLLM's hash then)


# ---- why a request missed ------------------------------------------------------------------------
def statuses(df, rid, admission=1):
    d = df[(df["request_id"] == rid) & (df["admission"] == admission)]
    return list(d["status"])


def test_misses_shared_prefix_partial_last_block_and_never_seen(tiny):
    llm = paged.LLM(tiny, block_size=4, num_blocks=64)
    ledger = pc.MissLedger(llm)
    a = list(range(10, 23))              # 13 tokens: 3 full blocks + 1 partial
    b = a[:12] + [99]                    # same 3 full blocks, another partial one
    c = a[:12]                           # exactly the 3 blocks: the last is recomputed
    outs = [llm.generate([p], GREEDY)[0] for p in (a, b, c)]
    df = ledger.frame()
    rids = [o.request_id for o in outs]
    assert statuses(df, rids[0]) == [M.NEVER_SEEN, M.AFTER_MISS, M.AFTER_MISS, M.PARTIAL]
    assert statuses(df, rids[1]) == [M.HIT, M.HIT, M.HIT, M.PARTIAL]
    assert statuses(df, rids[2]) == [M.HIT, M.HIT, M.LAST_BLOCK]
    for o in outs:  # hit rows add up to what the engine counted as cached
        hits = df[(df["request_id"] == o.request_id) & df["status"].isin([M.HIT, M.HIT_HOST])]
        assert hits["num_tokens"].sum() == o.num_cached_tokens
    s = ledger.summary()
    assert s.loc[M.HIT, "tokens"] == sum(o.num_cached_tokens for o in outs)


def test_misses_evicted_says_when_by_which_policy_for_whom(tiny):
    llm = paged.LLM(tiny, block_size=4, num_blocks=8, eviction="lru")
    ledger = pc.MissLedger(llm)
    a = list(range(10, 22)) + [1]
    llm.generate([a], GREEDY)
    others = [list(range(40 + 20 * i, 52 + 20 * i)) + [1] for i in range(3)]
    for p in others:
        llm.generate([p], GREEDY)
    again = llm.generate([a], GREEDY)[0]
    df = ledger.frame()
    row = df[(df["request_id"] == again.request_id) & (df["block"] == 0)].iloc[0]
    assert row["status"] == M.EVICTED and "lru" in row["detail"] and "step" in row["detail"]
    assert row["by_request"] is not None and row["by_request"] != again.request_id
    evicts = [e for e in llm.engine.recorder.events if e[1] == "evict"]
    assert row["event_step"] in {e[0] for e in evicts}


def test_misses_salted_and_refused_by_verification(tiny):
    from paged.studies.prefix_caching import constant_hash
    llm = paged.LLM(tiny, block_size=4, num_blocks=64)
    ledger = pc.MissLedger(llm)
    p = list(range(10, 23))
    llm.generate([p], GREEDY)
    salted = llm.generate([p], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1))[0]
    assert statuses(ledger.frame(), salted.request_id)[0] == M.SALTED
    llm2 = paged.LLM(tiny, block_size=4, num_blocks=64, hash_fn=constant_hash)
    ledger2 = pc.MissLedger(llm2)
    llm2.generate([p], GREEDY)
    other = llm2.generate([list(range(30, 43))], GREEDY)[0]
    row = ledger2.frame().query("request_id == @other.request_id and block == 0").iloc[0]
    assert row["status"] == M.REFUSED and "other tokens" in row["detail"]


def test_misses_host_tier_hits_and_server_side_explanations(tiny):
    llm = paged.LLM(tiny, block_size=4, num_blocks=8, num_cpu_blocks=16, enable_host_tier=True)
    ledger = pc.MissLedger(llm)
    a = list(range(10, 22)) + [1]
    llm.generate([a], GREEDY)
    for i in range(3):
        llm.generate([list(range(40 + 20 * i, 52 + 20 * i)) + [1]], GREEDY)
    again = llm.generate([a], GREEDY)[0]
    st = statuses(ledger.frame(), again.request_id)
    assert M.HIT_HOST in st and again.num_cached_tokens > 0
    # the server side: a forest built from events, matched by tokens
    from paged.connect.forest import PrefixForest
    from paged.connect.wire import BlockRemoved, BlockStored
    f = PrefixForest()
    f.apply(BlockStored((1, 2), None, (1, 2, 3, 4), 2), 0.0)
    f.apply(BlockRemoved((2,)), 5.0)
    df = pc.explain_server_prompt(f, [1, 2, 3, 4, 5, 6, 7], sent_s=1.0, cached_tokens=4)
    assert list(df["status"]) == [M.CACHED, M.CACHED, M.NEVER_SEEN, M.PARTIAL]
    df = pc.explain_server_prompt(f, [1, 2, 3, 4, 5, 6], sent_s=6.0)
    assert list(df["status"]) == [M.CACHED, M.EVICTED, M.AFTER_MISS] and "5.000" in df["detail"][1]


def test_entries_dropped_without_an_event_are_published_as_removed(tiny, tmp_path):
    """A failed step's never-written blocks leave the index silently (``BlockPool.uncache``); the
    next plan publishes them as removed, so consumers do not keep blocks the engine no longer has."""
    ev = f"ipc://{tmp_path}/ev"
    llm = paged.LLM(tiny, block_size=4, num_blocks=32)
    speaker = pc.publish(llm, kv_events_endpoint=ev)
    with pc.connect(events=ev, background=False) as src:
        llm.generate([list(range(10, 27))], GREEDY)
        pool = llm.kv_manager.pool
        victim = next(iter(pool.index.values()))
        assert pool.uncache(victim.block_id)
        llm.generate([[5, 6, 7]], GREEDY)  # any planned step reconciles
        assert src.wait_until(lambda s: s.status["last_seq"] == speaker.publisher.seq - 1, 5)
        assert src.forest.live == live_hashes(llm) and src.forest.num_removed == 1
    speaker.close()
