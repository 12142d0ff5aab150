"""Subscribe to a publisher of vLLM KV events (ZMQ SUB), with gap detection and replay catch-up.

    sub = KVEventSubscriber("tcp://127.0.0.1:5557", replay_endpoint="tcp://127.0.0.1:5558").connect()
    batches = sub.poll(0.2)        # decoded batches in sequence order (replayed ones included)

Sequence rules (vLLM numbers its batches 0, 1, 2, ... per publisher start): a jump ahead is a gap,
caught up from the replay socket (ROUTER: we send ``[b"", start (8-byte big-endian)]``, it answers
``[b"", topic, seq, payload]`` per buffered batch, then ``[b"", b"", -1, b""]``) or counted lost
with a warning; the same sequence and time stamp again is a duplicate (skipped); going back
otherwise is a publisher restart (its cache starts empty: ``after_restart``). With a replay
endpoint ``connect()`` first catches up on what the publisher still buffers (joining late).
Malformed messages are counted with a warning and skipped. Every socket operation has a timeout.

Connection state comes from a ZMQ monitor socket: ``connect()`` waits for a ZMTP handshake, so a
wrong port (nothing listening, or not ZMQ) is a clear error rather than a silent wait; a
disconnect is a warning, and ZMQ reconnects by itself.
"""
from __future__ import annotations

import contextlib
import time
import warnings
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import recv_monitor_message

from paged.errors import ConfigError, ConnectError, WireFormatError

from .wire import END_SEQ, Batch, decode_frames


class ConnectWarning(UserWarning):
    """Something went wrong with a live source that it survived (gap, malformed message, disconnect)."""


def normalize_endpoint(endpoint: str) -> str:
    """A connectable ZMQ endpoint: ``tcp://*:P`` (a server's bind address) -> ``tcp://127.0.0.1:P``;
    ConfigError for anything that is not tcp://host:port, ipc:// or inproc://."""
    if not isinstance(endpoint, str):
        raise ConfigError(f"an events endpoint is a string like 'tcp://127.0.0.1:5557', got {endpoint!r}")
    if endpoint.startswith(("ipc://", "inproc://")):
        return endpoint
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint[6:].rpartition(":")
        if sep and host and port.isdigit() and 0 < int(port) < 65536:
            return f"tcp://127.0.0.1:{port}" if host in ("*", "0.0.0.0") else endpoint
    raise ConfigError(f"events endpoint {endpoint!r} is not tcp://HOST:PORT, ipc://PATH or inproc://NAME "
                      "(vLLM's --kv-events-config endpoint 'tcp://*:5557' is reached as 'tcp://127.0.0.1:5557')")


@dataclass
class SubscriberStatus:
    """What the subscriber has seen (all counters cumulative)."""

    connected: bool = False
    messages: int = 0            # messages received on the SUB socket
    batches: int = 0             # batches handed out (replayed ones included)
    events: int = 0
    gaps: int = 0                # jumps in the sequence
    lost: int = 0                # batches missed and not recovered
    replayed: int = 0            # batches recovered through the replay socket
    duplicates: int = 0
    restarts: int = 0            # the publisher's sequence went back (it restarted)
    disconnects: int = 0
    malformed_messages: int = 0
    malformed_events: int = 0
    unknown_events: Counter = field(default_factory=Counter)
    last_seq: int | None = None
    last_message_s: float | None = None
    warnings: list[tuple[float, str]] = field(default_factory=list)


class KVEventSubscriber:
    """A SUB socket on one publisher (see the module docstring). Not thread-safe: one thread polls."""

    SUBSCRIBE_DELAY = 0.1  # seconds connect() waits after the handshake for the subscription to arrive

    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "",
                 timeout: float = 5.0, connect_timeout: float = 10.0, warn: bool = True) -> None:
        self.endpoint = normalize_endpoint(endpoint)
        self.replay_endpoint = normalize_endpoint(replay_endpoint) if replay_endpoint else None
        self.topic = topic
        self.timeout, self.connect_timeout = float(timeout), float(connect_timeout)
        self._ctx = zmq.Context.instance()
        self._sub: zmq.Socket | None = None
        self._mon: zmq.Socket | None = None
        self._warn = warn
        self.status = SubscriberStatus()
        self._seen: OrderedDict[int, float] = OrderedDict()  # seq -> ts of recent batches (duplicates vs restarts)
        self._pending: list[Batch] = []                      # caught up at connect, handed out by the next poll

    # ---- life cycle ---------------------------------------------------------------------------------
    def connect(self) -> "KVEventSubscriber":
        """Open the SUB socket and block until a ZMTP handshake with the publisher
        (ConnectError after ``connect_timeout`` seconds, the socket closed again)."""
        if self._sub is not None:
            return self
        sub = self._ctx.socket(zmq.SUB)
        for opt, value in ((zmq.LINGER, 0), (zmq.RCVHWM, 100_000), (zmq.RECONNECT_IVL, 200),
                           (zmq.RECONNECT_IVL_MAX, 2000)):
            sub.setsockopt(opt, value)
        sub.setsockopt_string(zmq.SUBSCRIBE, self.topic)
        self._mon = sub.get_monitor_socket()
        self._sub = sub
        sub.connect(self.endpoint)
        deadline = time.monotonic() + self.connect_timeout
        refused = handshake_failed = 0
        while not self.status.connected:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                if handshake_failed:
                    raise ConnectError(f"something answers at {self.endpoint} but does not speak ZMQ (an "
                                       "HTTP port?); give the port of vLLM's --kv-events-config endpoint")
                raise ConnectError(
                    f"no KV-event publisher at {self.endpoint} (connection {'refused' if refused else 'not made'} "
                    f"for {self.connect_timeout:g} s); start vLLM with --kv-events-config "
                    "'{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:PORT\"}' "
                    "and connect to tcp://HOST:PORT")
            if self._mon.poll(int(min(left, 0.2) * 1000)):
                kind = self._monitor_once()
                refused += kind == zmq.EVENT_CONNECT_RETRIED
                handshake_failed += kind in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                                             zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        time.sleep(self.SUBSCRIBE_DELAY)  # ZMQ's slow joiner: the subscription reaches the PUB just after
        if self.replay_endpoint is not None:  # join: what the publisher still buffers, before live messages
            try:
                history = self._replayed(self.replay(0))
            except ConnectError as e:
                history = []
                self._note(f"could not catch up at connect: {e}")
            for b in history:
                self._pending.extend(self._sequence(b, replaying=True))
            if history and history[0].seq > 0:
                self.status.lost += history[0].seq
                self._note(f"joined at sequence {history[0].seq}: {history[0].seq} earlier batch(es) were no longer "
                           "buffered; blocks they stored are unknown to the view")
        return self

    def close(self) -> None:
        """Close the sockets (idempotent)."""
        if self._sub is not None and self._mon is not None:
            # stopping a monitor sends it one last event: drain and stop it while its reader is open
            # (a PAIR socket without a peer would block that send, and close() with it)
            while self._mon.poll(0):
                self._mon.recv_multipart()
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disable_monitor()
        for s in (self._mon, self._sub):
            if s is not None:
                s.close(linger=0)
        self._sub = self._mon = None
        self.status.connected = False

    def __enter__(self) -> "KVEventSubscriber":
        return self.connect()

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- receiving ----------------------------------------------------------------------------------
    def poll(self, timeout: float = 0.1, max_messages: int = 10_000) -> list[Batch]:
        """Batches received within ``timeout`` seconds (waits only for the first; then takes
        what is queued), in sequence order, gaps caught up where the replay socket can."""
        if self._sub is None:
            raise ConnectError("the subscriber is closed; call connect() first")
        out, self._pending = self._pending, []
        self._drain_monitor()
        if not self._sub.poll(0 if out else int(max(timeout, 0.0) * 1000)):
            self._drain_monitor()
            return out
        for _ in range(max_messages):
            try:
                frames = self._sub.recv_multipart(flags=zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            self.status.messages += 1
            self.status.last_message_s = time.time()
            try:
                batch = decode_frames(frames)
            except WireFormatError as e:
                self.status.malformed_messages += 1
                self._note(f"malformed message skipped: {e}")
                continue
            out.extend(self._sequence(batch))
        self._drain_monitor()
        return out

    def _sequence(self, batch: Batch, replaying: bool = False) -> list[Batch]:
        st, last = self.status, self.status.last_seq
        if batch.seq < 0:
            st.malformed_messages += 1
            self._note(f"message with negative sequence {batch.seq} skipped")
            return []
        out: list[Batch] = []
        if replaying:
            pass  # the connect-time history: in order, counted by connect()
        elif last is None:
            if batch.seq > 0:
                out.extend(self._catch_up(0, batch.seq, joined=True))
        elif batch.seq <= last and self._seen.get(batch.seq) == batch.ts:
            st.duplicates += 1  # seen already (e.g. in the history caught up at connect)
            return []
        elif batch.seq <= last:
            st.restarts += 1
            batch.after_restart = True
            self._note(f"sequence went back from {last} to {batch.seq}: the publisher restarted (its cache is "
                       "empty now; the view marks every block cleared)")
            if batch.seq > 0:
                out.extend(self._catch_up(0, batch.seq, joined=True))
                if out:
                    out[0].after_restart, batch.after_restart = True, False
        elif batch.seq > last + 1:
            st.gaps += 1
            out.extend(self._catch_up(last + 1, batch.seq, joined=False))
        out.append(batch)
        st.last_seq = batch.seq
        for b in out:
            self._count(b)
            self._seen[b.seq] = b.ts
        while len(self._seen) > 20_000:
            self._seen.popitem(last=False)
        return out

    def _count(self, b: Batch) -> None:
        st = self.status
        st.batches += 1
        st.events += len(b.events)
        if b.malformed:
            st.malformed_events += b.malformed
            self._note(f"batch {b.seq}: {b.malformed} malformed event(s) skipped")
        if b.unknown:
            new = [k for k in b.unknown if k not in st.unknown_events]
            st.unknown_events.update(b.unknown)
            if new:
                self._note(f"unknown event type(s) {new} counted and ignored (a newer vLLM?)")

    def _catch_up(self, start: int, stop: int, joined: bool) -> list[Batch]:
        """Batches ``start .. stop - 1`` from the replay socket; what it cannot give is counted lost."""
        got: list[Batch] = []
        if self.replay_endpoint is not None:
            try:
                got = [b for b in self.replay(start) if start <= b.seq < stop]
            except ConnectError as e:
                self._note(str(e))
        got = self._replayed(got)
        lost = stop - start - len(got)
        if lost:
            self.status.lost += lost
            what = f"joined at sequence {stop}" if joined else f"sequence gap {start}..{stop - 1}"
            how = "no replay endpoint" if self.replay_endpoint is None else "the replay buffer did not have them"
            self._note(f"{what}: {lost} batch(es) lost ({how}); blocks they stored are unknown to the view")
        return got

    def _replayed(self, batches: list[Batch]) -> list[Batch]:
        """``batches`` from the replay socket, one per sequence number in order, counted replayed."""
        got = sorted({b.seq: b for b in batches}.values(), key=lambda b: b.seq)
        self.status.replayed += len(got)
        return got

    def replay(self, start: int) -> list[Batch]:
        """Ask the replay socket for every buffered batch from ``start`` on (DEALER; ConnectError
        when it does not finish answering within ``timeout``)."""
        if self.replay_endpoint is None:
            raise ConnectError("no replay endpoint given (vLLM's --kv-events-config replay_endpoint)")
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        out: list[Batch] = []
        try:
            s.connect(self.replay_endpoint)
            s.send_multipart([b"", int(start).to_bytes(8, "big")], flags=zmq.NOBLOCK)
            deadline = time.monotonic() + self.timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not s.poll(int(left * 1000)):
                    raise ConnectError(f"the replay socket {self.replay_endpoint} did not finish answering "
                                       f"within {self.timeout:g} s ({len(out)} batch(es) received)")
                frames = s.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                seq = frames[1] if len(frames) >= 2 else b""
                if len(seq) == 8 and int.from_bytes(seq, "big", signed=True) == END_SEQ:
                    return out
                try:
                    out.append(decode_frames(frames))
                except WireFormatError as e:
                    self.status.malformed_messages += 1
                    self._note(f"malformed replayed message skipped: {e}")
        except zmq.ZMQError as e:
            raise ConnectError(f"replay from {self.replay_endpoint} failed: {e}") from None
        finally:
            s.close(linger=0)

    # ---- connection state ---------------------------------------------------------------------------
    def _monitor_once(self) -> int | None:
        try:
            msg = recv_monitor_message(self._mon, flags=zmq.NOBLOCK)
        except zmq.Again:
            return None
        kind = msg["event"]
        st = self.status
        if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            if not st.connected and st.disconnects:
                self._note(f"reconnected to {self.endpoint}")
            st.connected = True
        elif kind == zmq.EVENT_DISCONNECTED and st.connected:
            st.connected = False
            st.disconnects += 1
            self._note(f"the publisher at {self.endpoint} disconnected (server stopped?); the view keeps what "
                       "it has and ZMQ reconnects when it returns")
        return kind

    def _drain_monitor(self) -> None:
        while self._mon is not None and self._mon.poll(0):
            if self._monitor_once() is None:
                break

    def _note(self, msg: str) -> None:
        self.status.warnings.append((time.time(), msg))
        if self._warn:
            warnings.warn(msg, ConnectWarning, stacklevel=3)
