"""vLLM's own code reads what our engine publishes, and computes the hashes our vllm_sha256 does.

A consumer written against vLLM's documented KV-event format (``vllm.distributed.kv_events``:
``msgspec.msgpack.Decoder(KVEventBatch)``, a SUB socket on the topic, replay requests on a
DEALER socket) runs in the vLLM venv as a subprocess against our engine, unchanged; what it
reconstructs must be exactly our engine's prefix index. The vLLM venv is built by ``make vllm``
when missing (tests/vllm_env.py)."""
from __future__ import annotations

import json
import os
import select
import subprocess
import time

import pytest

import paged
import paged.connect as pc
from paged.connect.wire import to_int_hash
from paged.engine import SamplingParams

from vllm_env import run_vllm_python, vllm_python

CONSUMER = r'''
import json, os, sys, time
import msgspec, zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

endpoint, replay_endpoint, topic, stop_file = sys.argv[1:5]
decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.connect(endpoint)
sub.setsockopt_string(zmq.SUBSCRIBE, topic)
print("ready", flush=True)
live, stored, removed, cleared, seqs, types = set(), 0, 0, 0, [], set()

def apply(batch):
    global stored, removed, cleared
    for e in batch.events:
        types.add(type(e).__name__)
        if isinstance(e, BlockStored):
            assert len(e.token_ids) == e.block_size * len(e.block_hashes)
            live.update(e.block_hashes); stored += len(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            live.difference_update(e.block_hashes); removed += len(e.block_hashes)
        elif isinstance(e, AllBlocksCleared):
            live.clear(); cleared += 1

deadline, last = time.time() + 240, None
while time.time() < deadline:
    if sub.poll(100):
        t, seq_bytes, payload = sub.recv_multipart()
        seq = int.from_bytes(seq_bytes, "big")
        apply(decoder.decode(payload)); seqs.append(seq)
    if last is None and os.path.exists(stop_file):
        last = int(open(stop_file).read())
    if last is not None and seqs and seqs[-1] >= last:
        break
req = ctx.socket(zmq.DEALER)
req.connect(replay_endpoint)
req.send_multipart([b"", (0).to_bytes(8, "big")])
replayed = 0
while req.poll(10000):
    _, t, seq_bytes, payload = req.recv_multipart()
    if int.from_bytes(seq_bytes, "big", signed=True) == -1:
        break
    decoder.decode(payload); replayed += 1
print(json.dumps({"live": sorted(live), "stored": stored, "removed": removed, "cleared": cleared,
                  "seqs": seqs, "types": sorted(types), "replayed": replayed}), flush=True)
'''


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from paged.models import load_model
    from paged.models.testing import make_tiny_checkpoint
    return load_model(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama"))


def test_a_consumer_written_for_vllm_reads_our_engine_unchanged(tiny, tmp_path):
    ev, rp, stop = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/rp", tmp_path / "stop"
    llm = paged.LLM(tiny, block_size=4, num_blocks=10)
    speaker = pc.publish(llm, kv_events_endpoint={"endpoint": ev, "replay_endpoint": rp, "topic": "kv-events"})
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(VLLM_LOGGING_LEVEL="ERROR", OMP_NUM_THREADS="1")
    p = subprocess.Popen([str(vllm_python()), "-c", CONSUMER, ev, rp, "kv-events", str(stop)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        ready, _, _ = select.select([p.stdout], [], [], 240)
        assert ready and p.stdout.readline().strip() == "ready", p.stderr.read()[-3000:]
        time.sleep(0.5)  # the subscription reaches our PUB socket
        sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        prefix = list(range(10, 22))
        llm.generate([prefix + [100 + i, 101 + i] for i in range(4)], sp)
        llm.kv_manager.reset_prefix_cache()
        llm.generate([prefix + [150 + i] for i in range(3)], sp)
        for i in range(3):  # distinct prompts on a 10-block pool: cached blocks are evicted
            llm.generate([list(range(200 + 20 * i, 214 + 20 * i))], sp)
        stop.write_text(str(speaker.publisher.seq - 1))
        out, err = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err[-3000:]
    got = json.loads(out.strip().splitlines()[-1])
    kinds = [e[1] for e in llm.engine.recorder.events]
    assert set(got["live"]) == {to_int_hash(h) for h in llm.kv_manager.pool.index}
    assert got["stored"] == kinds.count("cache_block") and got["removed"] == kinds.count("evict") > 0
    assert got["cleared"] == 1 and got["types"] == ["AllBlocksCleared", "BlockRemoved", "BlockStored"]
    assert got["seqs"] == list(range(speaker.publisher.seq))
    assert got["replayed"] == speaker.publisher.seq
    speaker.close()


def test_vllm_sha256_equals_vllm_hash_block_tokens():
    from paged.connect import vllm_sha256
    from paged.core.prefix_cache import BlockHasher
    tokens = [list(range(1000, 1070)), [5] * 96, list(range(40000, 40064))]
    code = r'''
import json, sys
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils as k
k.init_none_hash(sha256)
out = []
for toks in json.loads(sys.argv[1]):
    parent, hs = None, []
    for i in range(len(toks) // 32):
        parent = k.hash_block_tokens(sha256, parent, toks[i * 32:(i + 1) * 32], None)
        hs.append(parent.hex())
    out.append(hs)
print(json.dumps(out))
'''
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    theirs = json.loads(run_vllm_python(code, json.dumps(tokens), env=env).stdout.strip().splitlines()[-1])
    hasher = BlockHasher(32, vllm_sha256)
    for toks, want in zip(tokens, theirs):
        ours: list = []
        hasher.extend(ours, toks, (), len(toks))
        assert [h.hex() for h in ours] == want


def test_vllm_sha256_cbor_equals_vllm_hash_block_tokens():
    """The canonical-CBOR mode, run in the vLLM venv (it has cbor2) beside vLLM's own function."""
    code = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core import kv_cache_utils as k
from paged.connect.vllm_hash import vllm_sha256_cbor
from paged.core.prefix_cache import BlockHasher
k.init_none_hash(sha256_cbor)
toks = list(range(500, 600))
parent, theirs = None, []
for i in range(len(toks) // 32):
    parent = k.hash_block_tokens(sha256_cbor, parent, toks[i * 32:(i + 1) * 32], None)
    theirs.append(parent.hex())
ours = []
BlockHasher(32, vllm_sha256_cbor).extend(ours, toks, (), len(toks))
print(json.dumps([theirs, [h.hex() for h in ours]]))
'''
    from pathlib import Path
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    root = str(Path(__file__).resolve().parents[1])
    theirs, ours = json.loads(run_vllm_python(code, root, env=env).stdout.strip().splitlines()[-1])
    assert len(theirs) == 3 and ours == theirs
