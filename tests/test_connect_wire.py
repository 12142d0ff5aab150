"""vLLM's KV-event wire format (paged.connect.wire), the prefix forest and the metrics parser,
without sockets or models."""
from __future__ import annotations

import math

import msgpack
import pytest

from paged.connect import wire
from paged.connect.forest import PrefixForest
from paged.connect.metrics import parse_metrics
from paged.errors import WireFormatError

STORED_MAP = {"type": "BlockStored", "block_hashes": [11, 22], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
              "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None, None],
              "group_idx": 0, "kv_cache_spec_kind": "full_attention"}


def payload(events, ts=1.5, rank=0):
    return msgpack.packb([ts, events, rank], use_bin_type=True)


def test_map_and_array_encodings_decode_to_the_same_events():
    as_array = ["BlockStored", [11, 22], None, [1, 2, 3, 4], 2, None, "GPU", None, [None, None], 0]
    a = wire.decode_payload(payload([STORED_MAP]), seq=3)
    b = wire.decode_payload(payload([as_array]), seq=3)
    assert a.events == b.events and a.seq == 3 and a.ts == 1.5
    (e,) = a.events
    assert e.blocks() == [(11, None, (1, 2)), (22, 11, (3, 4))]
    removed = wire.decode_payload(payload([["BlockRemoved", [22], "GPU"], {"type": "BlockRemoved",
                                                                           "block_hashes": [b"x" * 32]}]))
    assert [r.block_hashes for r in removed.events] == [(22,), (b"x" * 32,)]
    assert wire.decode_payload(payload([{"type": "AllBlocksCleared"}, ["AllBlocksCleared"]])).events == \
        [wire.AllBlocksCleared(), wire.AllBlocksCleared()]


def test_unknown_types_and_fields_are_counted_or_ignored_and_malformed_events_skipped():
    newer = dict(STORED_MAP, session_id="s1", locality="LOCAL", some_future_field=[1, 2])
    b = wire.decode_payload(payload([newer, {"type": "BlockInactive", "block_hashes": [1]},
                                     {"type": "BlockStored", "block_hashes": [1]},          # no tokens
                                     dict(STORED_MAP, token_ids=[1, 2, 3]),                  # 3 tokens for 2 blocks
                                     {"no": "tag"}, 42, ["BlockInactive", 1]]))
    assert len(b.events) == 1 and b.events[0].block_hashes == (11, 22)
    assert b.unknown == {"BlockInactive": 2}
    assert b.malformed == 4


@pytest.mark.parametrize("frames,match", [
    ([b"t", b"\x00" * 8], "3 frames"),
    ([b"t", b"\x00" * 4, payload([])], "8 bytes"),
    ([b"\xff\xfe", b"\x00" * 8, payload([])], "utf-8"),
    ([b"t", b"\x00" * 8, b"\xc1"], "not msgpack"),
    ([b"t", b"\x00" * 8, msgpack.packb({"x": 1})], "expected"),
    ([b"t", b"\x00" * 8, msgpack.packb(["now", []])], "expected"),
])
def test_malformed_messages_raise_wire_format_error(frames, match):
    with pytest.raises(WireFormatError, match=match):
        wire.decode_frames(frames)


def test_encode_round_trips_and_int_hash_is_the_low_64_bits():
    events = [wire.BlockStored((b"\x01" * 32,), None, (5, 6), 2), wire.BlockRemoved((7,)), wire.AllBlocksCleared()]
    frames = wire.encode_frames("kv", 9, wire.encode_batch(2.0, events))
    b = wire.decode_frames(frames)
    assert (b.topic, b.seq, b.events) == ("kv", 9, events)
    assert wire.to_int_hash(bytes(24) + (5).to_bytes(8, "big")) == 5
    assert wire.to_int_hash(-1) == 2 ** 64 - 1
    for e in events:
        assert wire.event_from_json(wire.event_json(e)) == e


def test_forest_tracks_live_blocks_restores_and_evictions():
    f = PrefixForest()
    f.apply(wire.BlockStored((1, 2), None, (10, 11, 12, 13), 2), 0.0)
    f.apply(wire.BlockStored((3,), 1, (20, 21), 2), 1.0)           # a sibling of 2 under 1
    assert f.live == {1, 2, 3} and f.nodes[3].depth == 1 and f.nodes[2].parent == 1
    f.apply(wire.BlockRemoved((2,)), 2.0)
    f.apply(wire.BlockRemoved((99,)), 2.0)                         # never stored: counted
    f.apply(wire.BlockRemoved((5,), medium="CPU"), 2.0)            # another medium: counted
    assert f.live == {1, 3} and f.unknown_removed == 1 and f.other_media == 1
    f.apply(wire.BlockStored((2,), 1, (12, 13), 2), 3.0)           # stored again
    assert f.nodes[2].times_stored == 2 and f.nodes[2].live and not f.nodes[2].live_at(2.5)
    assert [n.block_hash for n in f.match([10, 11, 12, 13, 99])] == [1, 2]
    assert [n.block_hash for n in f.match([10, 11, 20, 21])] == [1, 3]
    assert f.match([10, 11, 7, 7, 12, 13]) == [f.nodes[1], None, None]
    f.apply(wire.AllBlocksCleared(), 4.0)
    assert not f.live and f.nodes[1].how_removed == "cleared" and f.num_cleared == 1
    df = f.frame(now=5.0)
    assert list(df["state"]) == ["cleared"] * 3 and list(df["times_stored"]) == [1, 2, 1]
    assert df.loc[df["node_id"] == 2, "parent_id"].item() == 0


def test_one_block_removed_with_several_hashes_removes_every_one_of_them():
    """vLLM batches evictions: one BlockRemoved may carry many hashes (decoded from the wire, too)."""
    f = PrefixForest()
    f.apply(wire.BlockStored((1, 2, 3, 4), None, tuple(range(8)), 2), 0.0)
    (removed,) = wire.decode_payload(payload([["BlockRemoved", [4, 2, 3], "GPU"]])).events
    changed = f.apply(removed, 1.0)
    assert [n.block_hash for n in changed] == [4, 2, 3]
    assert f.live == {1} and f.num_removed == 3 and f.unknown_removed == 0
    assert [f.nodes[h].how_removed for h in (1, 2, 3, 4)] == [None, "removed", "removed", "removed"]
    assert [f.nodes[h].removed_s for h in (2, 3, 4)] == [1.0, 1.0, 1.0]
    assert list(f.frame(now=2.0)["state"]) == ["live", "evicted", "evicted", "evicted"]
    assert [n.block_hash if n.live else None for n in f.match(list(range(8)))] == [1, None, None, None]


def test_metrics_parsed_with_prometheus_client():
    text = """# HELP vllm:kv_cache_usage_perc KV-cache usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 373.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 160.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="True",engine="0",\
num_gpu_blocks="20"} 1.0
"""
    s = parse_metrics(text)
    assert s.values["kv_cache_usage_perc"] == 0.25 and s.values["prefix_cache_hits"] == 160.0
    assert s.values["num_running"] == 3.0  # summed over engines
    assert math.isnan(s.values["num_preemptions"])  # not exported: NaN, not 0
    assert (s.block_size, s.num_gpu_blocks) == (32, 20)
    with pytest.raises(WireFormatError):
        parse_metrics("vllm:x{engine=0 1\n")
