"""vLLM's KV-event wire format: decoded leniently, encoded exactly as vLLM 0.32 does.

A message is three ZMQ frames (``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``): the topic
(utf-8, may be empty); the sequence number, 8 bytes big-endian (from 0 per publisher start; the
replay socket ends its answer with -1, signed); a msgpack ``KVEventBatch`` ``[ts, events, rank]``.
Events are ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``: vLLM 0.32 encodes a map tagged
``{"type": ...}``, older versions an array ``[tag, block_hashes, parent_block_hash, ...]``; both are
decoded. Hashes are ints (the digest's low 64 bits, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) or
raw bytes, kept as is.

Lenient by design (vLLM marks the feature experimental and keeps adding fields): unknown event
types are counted and skipped, unknown fields ignored, an event lacking a required field counted
as malformed; only what cannot be a batch raises ``WireFormatError``. ``encode_batch`` writes what
vLLM's typed decoder (``msgspec.msgpack.Decoder(KVEventBatch)``) reads (tests/test_connect_vllm_decoder.py).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence, Union

import msgpack

from paged.errors import WireFormatError

BlockHash = Union[int, bytes]
END_SEQ = -1  # the replay socket's end marker (signed)
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"

# field order of the array encoding (older vLLM): the tag first, then these
_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks entered the prefix cache: ``block_hashes[i]`` holds
    ``token_ids[i * block_size:(i + 1) * block_size]``; its parent is ``block_hashes[i - 1]``,
    or ``parent_block_hash`` for the first (None: the first block of a prompt)."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    lora_id: int | None = None
    group_idx: int | None = None
    extra_keys: tuple | None = None

    def blocks(self) -> list[tuple[BlockHash, BlockHash | None, tuple[int, ...]]]:
        """(hash, parent hash, tokens) per block, in chain order."""
        bs, hs = self.block_size, self.block_hashes
        parents = (self.parent_block_hash, *hs[:-1])
        return [(h, p, self.token_ids[i * bs:(i + 1) * bs]) for i, (h, p) in enumerate(zip(hs, parents))]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Cached blocks were evicted (their hashes dropped) from ``medium``."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The prefix cache was reset."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(slots=True)
class Batch:
    """One decoded message: its sequence number, the publisher's time stamp, the events it
    could read, and what it skipped (``unknown``: event type -> count; ``malformed``: events
    missing a required field or of the wrong shape)."""

    seq: int
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None
    topic: str = ""
    unknown: Counter = field(default_factory=Counter)
    malformed: int = 0
    after_restart: bool = False   # the first batch after the publisher's sequence restarted


def _hash(x: Any) -> BlockHash:
    if isinstance(x, bool) or not isinstance(x, (int, bytes)):
        raise WireFormatError(f"a block hash is an int or bytes, got {type(x).__name__}")
    return x


def _as_map(e: Any) -> tuple[str | None, dict]:
    """(type tag, fields) of a map- or array-encoded event; (None, {}) when it has no tag."""
    if isinstance(e, dict):
        tag = e.get("type")
        return (tag if isinstance(tag, str) else None), e
    if isinstance(e, (list, tuple)) and e and isinstance(e[0], str):
        names = _ARRAY_FIELDS.get(e[0], ())
        return e[0], dict(zip(names, e[1:]))
    return None, {}


def decode_event(e: Any) -> KVEvent | str | None:
    """One event: a ``KVEvent``; the type name (str) of an unknown event; None if malformed."""
    tag, f = _as_map(e)
    if tag is None:
        return None
    try:
        if tag == "BlockStored":
            hashes = tuple(_hash(h) for h in f["block_hashes"])
            parent = f.get("parent_block_hash")
            tokens = tuple(int(t) for t in f["token_ids"])
            bs = int(f["block_size"])
            if bs < 1 or len(tokens) != bs * len(hashes) or not hashes:
                return None  # token count must match the blocks it claims
            extra = f.get("extra_keys")  # per block; all None (no salt, adapter, media) is kept as None
            keep = isinstance(extra, list) and any(x is not None for x in extra)
            extra = tuple(map(_freeze, extra)) if keep else None
            return BlockStored(hashes, None if parent is None else _hash(parent), tokens, bs,
                               f.get("medium", MEDIUM_GPU), f.get("lora_name"), f.get("lora_id"),
                               f.get("group_idx"), extra)
        if tag == "BlockRemoved":
            return BlockRemoved(tuple(_hash(h) for h in f["block_hashes"]), f.get("medium", MEDIUM_GPU),
                                f.get("group_idx"))
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
    except (KeyError, TypeError, ValueError, WireFormatError):
        return None
    return tag


def _freeze(x: Any) -> Any:
    return tuple(_freeze(y) for y in x) if isinstance(x, list) else x


def decode_payload(payload: bytes, seq: int = 0, topic: str = "") -> Batch:
    """A msgpack ``KVEventBatch`` -> ``Batch``; WireFormatError when it is not one."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several types (ExtraData, FormatError, ValueError, ...)
        raise WireFormatError(f"batch {seq}: not msgpack ({type(e).__name__}: {str(e)[:80]})") from None
    if isinstance(obj, dict):  # a map-encoded batch (not seen yet; accepted)
        obj = [obj.get("ts"), obj.get("events"), obj.get("data_parallel_rank")]
    if not isinstance(obj, (list, tuple)) or len(obj) < 2 or not isinstance(obj[1], (list, tuple)) \
            or isinstance(obj[0], bool) or not isinstance(obj[0], (int, float)):
        raise WireFormatError(f"batch {seq}: expected [ts, events, data_parallel_rank], got "
                              f"{type(obj).__name__} {str(obj)[:80]}")
    rank = obj[2] if len(obj) > 2 and isinstance(obj[2], int) else None
    batch = Batch(seq, float(obj[0]), [], rank, topic)
    for raw in obj[1]:
        e = decode_event(raw)
        if e is None:
            batch.malformed += 1
        elif isinstance(e, str):
            batch.unknown[e] += 1
        else:
            batch.events.append(e)
    return batch


def decode_frames(frames: Sequence[bytes]) -> Batch:
    """The three frames of a published message -> ``Batch``; WireFormatError when they are not."""
    if len(frames) != 3:
        raise WireFormatError(f"a KV-event message has 3 frames (topic, sequence, payload), got {len(frames)}")
    topic, seq_bytes, payload = frames
    if len(seq_bytes) != 8:
        raise WireFormatError(f"the sequence frame has 8 bytes (big-endian), got {len(seq_bytes)}")
    try:
        name = bytes(topic).decode("utf-8")
    except UnicodeDecodeError:
        raise WireFormatError("the topic frame is not utf-8") from None
    return decode_payload(bytes(payload), int.from_bytes(seq_bytes, "big", signed=True), name)


# ---- encoding (what our engine publishes) ---------------------------------------------------------
def event_map(e: KVEvent) -> dict:
    """An event as vLLM 0.32 encodes it: a map tagged with ``type``, required fields always
    present, optional ones only when set (msgspec's ``omit_defaults``)."""
    if isinstance(e, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    if isinstance(e, BlockStored):
        m = {"type": "BlockStored", "block_hashes": list(e.block_hashes), "parent_block_hash": e.parent_block_hash,
             "token_ids": list(e.token_ids), "block_size": e.block_size, "lora_id": e.lora_id,
             "medium": e.medium, "lora_name": e.lora_name}
        m["extra_keys"] = list(e.extra_keys) if e.extra_keys is not None else [None] * len(e.block_hashes)
    elif isinstance(e, BlockRemoved):
        m = {"type": "BlockRemoved", "block_hashes": list(e.block_hashes), "medium": e.medium}
    else:
        raise TypeError(f"not a KV event: {e!r}")
    if e.group_idx is not None:
        m["group_idx"] = e.group_idx
    return m


def encode_batch(ts: float, events: Iterable[KVEvent], data_parallel_rank: int | None = 0) -> bytes:
    """msgpack ``[ts, [event maps], data_parallel_rank]`` (vLLM's array-like ``KVEventBatch``)."""
    return msgpack.packb([float(ts), [event_map(e) for e in events], data_parallel_rank], use_bin_type=True)


def encode_frames(topic: str, seq: int, payload: bytes) -> list[bytes]:
    """The three frames of one message."""
    return [topic.encode("utf-8"), seq.to_bytes(8, "big", signed=True), payload]


def to_int_hash(h: BlockHash) -> int:
    """vLLM's int form of a block hash: the low 64 bits of the digest read big-endian."""
    return (h if isinstance(h, int) else int.from_bytes(h, "big")) & ((1 << 64) - 1)


def hash_text(h: BlockHash | None) -> str:
    """A short printable form of a hash (16 hex digits)."""
    return "-" if h is None else f"{h & ((1 << 64) - 1):016x}" if isinstance(h, int) else h.hex()[-16:]


def _map_hashes(m: dict, f) -> dict:
    """A copy of event map ``m`` with ``f`` applied to its block hashes and parent hash."""
    m = dict(m)
    if "block_hashes" in m:
        m["block_hashes"] = [f(h) for h in m["block_hashes"]]
    if m.get("parent_block_hash") is not None:
        m["parent_block_hash"] = f(m["parent_block_hash"])
    return m


def event_json(e: KVEvent) -> dict:
    """A JSON-safe map of an event (bytes hashes as ``"hex:..."``), for recordings."""
    return _map_hashes(event_map(e), lambda h: f"hex:{h.hex()}" if isinstance(h, bytes) else h)


def event_from_json(m: dict) -> KVEvent:
    """Inverse of ``event_json``."""
    e = decode_event(_map_hashes(m, lambda h: bytes.fromhex(h[4:]) if isinstance(h, str) and h.startswith("hex:")
                                 else h))
    if e is None or isinstance(e, str):
        raise WireFormatError(f"not a recorded KV event: {str(m)[:80]}")
    return e
