"""Publish KV-event batches in vLLM's wire format: a ZMQ PUB socket plus a replay ROUTER socket.

    pub = KVEventPublisher("tcp://*:5557", replay_endpoint="tcp://*:5558", topic="kv-events")
    pub.publish([BlockStored(...), BlockRemoved(...)])   # one batch, the next sequence number

As vLLM's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``): an endpoint with ``*`` or ``::``
(or ipc/inproc) is bound, others connected; messages ``[topic, seq (8-byte big-endian), msgpack
batch]``, seq 0, 1, 2, ...; the last ``buffer_steps`` batches stay in memory, and a replay request
``[b"", start]`` gets each with seq >= start, then ``[b"", b"", -1, b""]``. ``publish`` never blocks
(PUB drops at its high-water mark); one daemon thread serves replay requests, polling with a timeout.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from typing import Iterable

import zmq

from paged.errors import ConfigError

from .settings import is_bind as _is_bind
from .wire import END_SEQ, KVEvent, encode_batch, encode_frames


class KVEventPublisher:
    """See the module docstring. ``seq``: the number the next batch gets."""

    def __init__(self, endpoint: str = "tcp://*:5557", *, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = 100_000) -> None:
        if not isinstance(endpoint, str) or not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(f"kv events endpoint {endpoint!r} must be tcp://HOST:PORT (tcp://*:PORT binds), "
                              "ipc://PATH or inproc://NAME")
        if replay_endpoint is not None and not _is_bind(replay_endpoint):
            raise ConfigError(f"replay endpoint {replay_endpoint!r} is bound, so it needs '*' (tcp://*:PORT) "
                              "or ipc://")
        if not isinstance(buffer_steps, int) or buffer_steps < 1:
            raise ConfigError(f"buffer_steps must be a positive integer, got {buffer_steps!r}")
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic
        self._ctx = zmq.Context.instance()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self.seq = 0
        self.num_events = 0
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, hwm)
        try:
            if _is_bind(endpoint):
                pub.bind(endpoint)
            else:
                pub.connect(endpoint)
        except zmq.ZMQError as e:
            pub.close(linger=0)
            raise ConfigError(f"cannot open the KV-event endpoint {endpoint!r}: {e} (port in use?)") from None
        self._pub = pub
        self._running = True
        self._thread: threading.Thread | None = None
        if replay_endpoint is not None:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            try:
                router.bind(replay_endpoint)
            except zmq.ZMQError as e:
                router.close(linger=0)
                pub.close(linger=0)
                raise ConfigError(f"cannot bind the replay endpoint {replay_endpoint!r}: {e} (port in use?)") from None
            self._thread = threading.Thread(target=self._serve_replay, args=(router,), daemon=True,
                                            name="paged-kv-replay")
            self._thread.start()

    def publish(self, events: Iterable[KVEvent], ts: float | None = None) -> int:
        """Send one batch; returns its sequence number."""
        events = list(events)
        payload = encode_batch(time.time() if ts is None else ts, events)
        with self._lock:
            seq = self.seq
            self.seq += 1
            self._buffer.append((seq, payload))
        if self._pub is not None:
            with contextlib.suppress(zmq.Again):  # PUB drops at the high-water mark; the replay buffer has it
                self._pub.send_multipart(encode_frames(self.topic, seq, payload), flags=zmq.NOBLOCK)
        self.num_events += len(events)
        return seq

    def _serve_replay(self, router: zmq.Socket) -> None:
        try:
            while self._running:
                if not router.poll(100):
                    continue
                frames = router.recv_multipart()
                if len(frames) != 3 or len(frames[2]) != 8:
                    continue  # not a replay request: ignored, as vLLM does
                client, _, start = frames
                first = int.from_bytes(start, "big")
                with self._lock:
                    items = [(s, p) for s, p in self._buffer if s >= first]
                topic = self.topic.encode("utf-8")
                for s, p in items:
                    router.send_multipart([client, b"", topic, s.to_bytes(8, "big"), p])
                router.send_multipart([client, b"", b"", END_SEQ.to_bytes(8, "big", signed=True), b""])
        finally:
            router.close(linger=0)

    def close(self) -> None:
        """Stop the replay thread and close the sockets (idempotent)."""
        self._running = False
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            self._thread = None
        if self._pub is not None:
            self._pub.close(linger=0)
            self._pub = None

    def __enter__(self) -> "KVEventPublisher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
