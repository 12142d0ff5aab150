"""The live source (paged.connect.connect) against our own publisher and metrics exporter:
records, the forest, gaps with and without replay, malformed and unknown messages, a publisher
restart, wrong endpoints and a server dying mid-stream (warnings, nothing hangs), save/load."""
from __future__ import annotations

import json
import time

import msgpack
import pytest
import zmq

import paged.connect as pc
from paged.connect.exporter import MetricsExporter
from paged.connect.publisher import KVEventPublisher
from paged.connect.subscriber import ConnectWarning
from paged.connect.wire import AllBlocksCleared, BlockRemoved, BlockStored, encode_frames
from paged.errors import ConfigError, ConnectError


def stored(h, parent, tokens=(1, 2)):
    return BlockStored((h,), parent, tuple(tokens), len(tokens))


@pytest.fixture
def ends(tmp_path):
    return f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/rp"


def publish_hidden(pub, events):
    """Publish into the replay buffer only (the message is lost on the PUB socket)."""
    sock, pub._pub = pub._pub, None
    try:
        return pub.publish(events)
    finally:
        pub._pub = sock


def test_stream_to_forest_records_save_load_and_trace(ends, tmp_path):
    ev, rp = ends
    m = MetricsExporter("tiny", block_size=2, num_gpu_blocks=8, port=0)
    with KVEventPublisher(ev, replay_endpoint=rp, topic="kv") as pub, \
            pc.connect(events=ev.replace("*", "127.0.0.1"), metrics=m.url, replay=rp, topic="kv",
                       poll_interval=0.05, background=False) as src:
        pub.publish([stored(1, None), stored(2, 1, (3, 4))])
        m.update(running=1, waiting=2, usage=0.25, queries=10, hits=4, preemptions=1)
        pub.publish([BlockRemoved((2,)), stored(3, 1, (5, 6))])
        assert src.wait_until(lambda s: s.status["last_seq"] == 1, 5)
        src.scrape_now()
        assert src.forest.live == {1, 3} and src.forest.nodes[2].times_removed == 1
        st = src.status
        assert (st["gaps"], st["lost"], st["malformed_messages"], st["forest_stored"]) == (0, 0, 0, 3)
        kinds = [e[1] for e in src.events]
        assert kinds == ["cache_block", "cache_block", "evict", "cache_block"]
        row = src.rows[-1]
        assert (row["num_running"], row["num_waiting"], row["kv_cache_usage_perc"]) == (1, 2, 0.25)
        assert (row["prefix_cache_queries"], row["prefix_cache_hits"], row["num_used_blocks"]) == (10, 4, 2)
        assert src.steps_frame().shape[1] == 28 and src.server_frame()["live_blocks"].iloc[-1] == 2
        path = pc.save(src, tmp_path / "server.npz")
    m.close()
    rec = pc.load(path)
    assert rec.forest.live == {1, 3} and len(rec.rows) == len(src.rows) and rec.events == src.events
    assert rec.forest_at(rec.wire[0]["t"]).live == {1, 2}
    from paged import replay
    assert replay.load(path).steps_frame().equals(rec.steps_frame())  # a plain paged.replay file too
    trace = pc.chrome_trace(rec, tmp_path / "t.json")
    names = {e["name"] for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"]}
    assert {"kv cache", "requests", "store", "evict"} <= names and trace["otherData"]["backend"] == "vllm"


def test_gap_is_caught_up_through_the_replay_socket(ends):
    ev, rp = ends
    with KVEventPublisher(ev, replay_endpoint=rp) as pub, \
            pc.connect(events=ev, replay=rp, background=False, warn=False) as src:
        pub.publish([stored(1, None)])
        assert src.wait_until(lambda s: s.status["last_seq"] == 0, 5)
        publish_hidden(pub, [stored(2, 1)])
        publish_hidden(pub, [BlockRemoved((1,))])
        pub.publish([stored(3, 2)])
        assert src.wait_until(lambda s: s.status["last_seq"] == 3, 5)
        st = src.status
        assert (st["gaps"], st["replayed"], st["lost"]) == (1, 2, 0)
        assert src.forest.live == {2, 3} and [b["seq"] for b in src.wire] == [0, 1, 2, 3]


def test_gap_without_replay_is_a_counted_visible_warning(ends):
    ev, _ = ends
    with KVEventPublisher(ev) as pub, pc.connect(events=ev, background=False) as src:
        pub.publish([stored(1, None)])
        assert src.wait_until(lambda s: s.status["last_seq"] == 0, 5)
        publish_hidden(pub, [stored(2, 1)])
        pub.publish([stored(3, 2)])
        with pytest.warns(ConnectWarning, match="1 batch.*lost"):
            assert src.wait_until(lambda s: s.status["last_seq"] == 2, 5)
        assert src.status["lost"] == 1 and src.forest.live == {1, 3}
        assert src.forest.nodes[3].depth == 1  # its parent was never seen
        assert any("lost" in w for _, w in src.warnings)


def test_malformed_and_unknown_messages_are_counted_and_the_view_keeps_what_it_had(ends):
    ev, _ = ends
    with KVEventPublisher(ev) as pub, pc.connect(events=ev, background=False, warn=False) as src:
        pub.publish([stored(1, None)])
        assert src.wait_until(lambda s: s.status["last_seq"] == 0, 5)
        raw = pub._pub
        raw.send_multipart([b"", b"\x00" * 8])                          # two frames
        raw.send_multipart([b"", (1).to_bytes(8, "big"), b"\xc1\xc1"])   # not msgpack
        pub.seq = 2
        newer = [{"type": "BlockInactive", "block_hashes": [1]}, {"type": "BlockStored", "block_hashes": [9]},
                 {"type": "BlockStored", "block_hashes": [4], "parent_block_hash": 1, "token_ids": [7, 8],
                  "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None, "session_id": "s"}]
        raw.send_multipart(encode_frames("", 2, msgpack.packb([time.time(), newer, 0])))
        pub.seq = 3
        pub.publish([stored(5, 4)])
        assert src.wait_until(lambda s: s.status["last_seq"] == 3, 5)
        st = src.status
        assert st["malformed_messages"] == 2 and st["malformed_events"] == 1
        assert st["unknown_events"] == {"BlockInactive": 1}
        assert src.forest.live == {1, 4, 5}
        assert sum("malformed" in w for _, w in src.warnings) >= 3 and any("unknown" in w for _, w in src.warnings)


def test_publisher_restart_clears_the_view_and_joining_late_catches_up(ends):
    ev, rp = ends
    pub = KVEventPublisher(ev, replay_endpoint=rp)
    pub.publish([stored(1, None)])
    pub.publish([stored(2, 1)])            # before anyone listens: only the replay buffer has them
    src = pc.connect(events=ev, replay=rp, background=False, warn=False)
    try:
        pub.publish([stored(3, 2)])
        assert src.wait_until(lambda s: s.status["last_seq"] == 2, 5)
        assert src.forest.live == {1, 2, 3} and src.status["replayed"] == 2 and src.status["lost"] == 0
        pub.close()
        pub = KVEventPublisher(ev, replay_endpoint=rp)   # the server restarted: sequence from 0, cache empty
        assert src.wait_until(lambda s: s.status["connected"], 10)
        deadline = time.monotonic() + 5
        while src.status["restarts"] == 0 and time.monotonic() < deadline:  # re-send until the SUB is back
            pub.seq = 0
            pub.publish([stored(7, None, (9, 9))])
            src.poll(0.2)
        assert src.status["restarts"] == 1
        assert src.forest.live == {7} and src.forest.nodes[1].how_removed == "cleared"
        assert any(e[1] == "reset" for e in src.events)
    finally:
        src.close()
        pub.close()


def test_wrong_endpoints_are_clear_errors_and_quick(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(ConnectError, match="no KV-event publisher"):
        pc.connect(events=f"ipc://{tmp_path}/nobody", connect_timeout=1.0)
    with pytest.raises(ConnectError, match="cannot reach"):
        pc.connect(metrics="http://127.0.0.1:9/metrics", timeout=1.0)
    m = MetricsExporter("tiny", block_size=2, num_gpu_blocks=8, port=0)
    try:  # an HTTP port given as the events endpoint
        with pytest.raises(ConnectError, match="does not speak ZMQ|no KV-event publisher"):
            pc.connect(events=f"tcp://127.0.0.1:{m.port}", connect_timeout=1.5)
    finally:
        m.close()
    assert time.monotonic() - t0 < 15
    for bad in ("127.0.0.1:5557", "tcp://host", "tcp://h:99999", 5557):
        with pytest.raises(ConfigError, match="endpoint"):
            pc.connect(events=bad)
    with pytest.raises(ConfigError, match="http"):
        pc.connect(metrics="127.0.0.1:8000/metrics")
    with pytest.raises(ConfigError):
        pc.connect()


def test_server_dying_mid_stream_is_a_warning_and_nothing_hangs(ends):
    ev, _ = ends
    pub = KVEventPublisher(ev)
    m = MetricsExporter("tiny", block_size=2, num_gpu_blocks=8, port=0)
    src = pc.connect(events=ev, metrics=m.url, poll_interval=0.05, timeout=1.0, warn=False)  # background thread
    try:
        pub.publish([stored(1, None)])
        assert src.wait_until(lambda s: s.status["last_seq"] == 0 and s.rows, 5)
        pub.close()
        m.close()
        assert src.wait_until(lambda s: s.status["disconnects"] == 1 and s.metrics_failures >= 1, 10)
        assert src.forest.live == {1} and src.rows  # the view keeps what it had
        text = " ".join(w for _, w in src.warnings)
        assert "disconnected" in text and "cannot reach" in text
    finally:
        t0 = time.monotonic()
        src.close()
        assert time.monotonic() - t0 < 5


def test_vllm_server_events_drive_the_view_unchanged_by_encoding(ends):
    """An AllBlocksCleared mid-stream marks every live node cleared; later stores revive them."""
    ev, rp = ends
    with KVEventPublisher(ev, replay_endpoint=rp) as pub, pc.connect(events=ev, replay=rp, background=False) as src:
        pub.publish([stored(1, None), stored(2, 1)])
        pub.publish([AllBlocksCleared()])
        pub.publish([stored(1, None)])
        assert src.wait_until(lambda s: s.status["last_seq"] == 2, 5)
        assert src.forest.live == {1} and src.forest.nodes[1].times_stored == 2
        assert src.forest.nodes[2].how_removed == "cleared"
        assert [e[1] for e in src.events].count("reset") == 1
