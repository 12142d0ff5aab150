"""A router in front of live engines that publish vLLM's KV events.

    a = EngineReplica(paged.LLM(model, block_size=32, hash_fn=paged.connect.vllm_sha256),
                      {"endpoint": "ipc:///tmp/a", "replay_endpoint": "ipc:///tmp/ar"})   # publishes its KV events
    b = ServerReplica.of(vllm_server)                  # a paged.connect.VLLMServer
    fleet = LiveFleet([a, b], "kv_aware")             # one SUB socket per replica -> its PreciseCache
    fleet.run(prompts, max_tokens=4)                  # route, send, wait, read back cached tokens
    fleet.hit_rate(), fleet.frame(), fleet.dispatcher.frame()
    fleet.close()

Each replica's precise view is a ``PrefixForest`` fed by a ``paged.connect`` subscriber on that
replica's own stream, so it equals what ``paged.connect.connect`` rebuilds from the same stream.
Requests go one at a time, and the fleet waits for the streams to go quiet before each decision
(the view then reflects every earlier request). The hit rate is the replicas' own count:
``cached_tokens`` of each answer (vLLM's ``usage.prompt_tokens_details``, our
``RequestOutput.num_cached_tokens``) over prompt tokens.

A replica that fails to answer (``ConnectError``/``OSError``) or whose stream disconnects is marked
down with a ``ReplicaDownWarning``; the request is sent to another replica, so nothing is lost;
only when none is left does ``send`` raise ``NoReplicaError``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

from paged.connect.subscriber import KVEventSubscriber
from paged.errors import ConfigError, ConnectError, NoReplicaError

from .caches import PreciseCache
from .dispatch import Dispatcher, ReplicaState
from .routers import make_router

RESULT_COLUMNS = ("request_id", "replica", "replica_name", "prompt_tokens", "cached_tokens", "tries", "latency_s")


@dataclass(frozen=True, slots=True)
class Arrival:
    """A request as a router sees it."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int = 16
    session_id: str | None = None


class EngineReplica:
    """Our engine (a ``paged.LLM``) as a live replica, publishing its KV events on ``kv_events_endpoint``
    (``paged.connect.publish``; a ZMQ endpoint or a dict of vLLM's ``KVEventsConfig`` keys)."""

    def __init__(self, llm: Any, kv_events_endpoint: Any, name: str | None = None) -> None:
        from paged.connect.speak import publish
        if kv_events_endpoint is None:
            raise ConfigError("an EngineReplica publishes KV events: give kv_events_endpoint, e.g. "
                              "{'endpoint': 'ipc://...', 'replay_endpoint': 'ipc://...'}")
        self.speaker = speaker = publish(llm, kv_events_endpoint=kv_events_endpoint)
        pub = speaker.publisher
        self.llm, self.name = llm, name or f"paged@{pub.endpoint}"
        self.events_endpoint, self.replay_endpoint, self.topic = pub.endpoint, pub.replay_endpoint, pub.topic
        self.block_size, self.num_blocks = llm.kv_manager.block_size, llm.kv_manager.num_blocks
        self.closed = False

    def submit(self, prompt: Sequence[int], max_tokens: int) -> int:
        """Run one request to completion; its cached (prefix-hit) prompt tokens."""
        from paged.engine import SamplingParams
        if self.closed:
            raise ConnectError(f"replica {self.name!r} is closed")
        out = self.llm.generate([list(prompt)], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                               ignore_eos=True))[0]
        return int(out.num_cached_tokens)

    def close(self) -> None:
        """Stop publishing (the replica goes away); later submits raise ConnectError."""
        self.closed = True
        self.speaker.close()


class ServerReplica:
    """A vLLM OpenAI-compatible server (``paged.connect.Client`` or ``VLLMServer``) with its KV events."""

    def __init__(self, client: Any, events_endpoint: str, block_size: int, num_blocks: int, *,
                 replay_endpoint: str | None = None, topic: str = "", name: str | None = None,
                 timeout: float = 120.0) -> None:
        self.client, self.name = client, name or f"vllm@{client.base_url}"
        self.events_endpoint, self.replay_endpoint, self.topic = events_endpoint, replay_endpoint, topic
        self.block_size, self.num_blocks, self.timeout = block_size, num_blocks, timeout

    @classmethod
    def of(cls, server: Any, name: str | None = None) -> "ServerReplica":
        """From a ``paged.connect.VLLMServer`` (its endpoints, block size and forced pool)."""
        if server.num_gpu_blocks is None:
            raise ConfigError("give the VLLMServer num_gpu_blocks so the router knows its pool size")
        return cls(server, server.events_endpoint, server.block_size, server.num_gpu_blocks,
                   replay_endpoint=server.replay_endpoint, topic=server.topic, name=name)

    def submit(self, prompt: Sequence[int], max_tokens: int) -> int:
        from paged.connect.server import cached_tokens
        answer = self.client.complete(list(prompt), max_tokens=max_tokens, timeout=self.timeout)
        return cached_tokens(answer) or 0


class LiveFleet:
    """See the module docstring. ``router``: a name of ``paged.fleet.ROUTERS`` (with ``options``) or a Router."""

    def __init__(self, replicas: Sequence[Any], router: Any = "kv_aware", *, quiet_s: float = 0.3,
                 settle_timeout_s: float = 10.0, connect_timeout_s: float = 10.0, **options: Any) -> None:
        if not replicas:
            raise ConfigError("a live fleet needs at least one replica")
        self.handles = list(replicas)
        self.quiet_s, self.settle_timeout_s = quiet_s, settle_timeout_s
        states = [ReplicaState(i, h.name, h.block_size, h.num_blocks, PreciseCache(h.block_size))
                  for i, h in enumerate(self.handles)]
        self.dispatcher = Dispatcher(make_router(router, **options), states)
        self.subscribers: list[KVEventSubscriber] = []
        try:
            for h in self.handles:
                self.subscribers.append(KVEventSubscriber(h.events_endpoint, replay_endpoint=h.replay_endpoint,
                                                          topic=h.topic, connect_timeout=connect_timeout_s,
                                                          warn=False).connect())
        except BaseException:
            self.close()
            raise
        self.results: list[tuple] = []
        self.t0 = time.monotonic()
        self.counter = 0

    @property
    def now(self) -> float:
        return time.monotonic() - self.t0

    def poll(self, timeout: float = 0.0) -> int:
        """Apply what every up replica's stream delivered; returns the batches applied. A stream
        that disconnected marks its replica down."""
        n = 0
        for i, sub in enumerate(self.subscribers):
            state = self.dispatcher.replicas[i]
            if not state.up:
                continue
            for b in sub.poll(timeout):
                state.precise.apply_batch(b, self.now)
                n += 1
            if sub.status.disconnects:
                self.dispatcher.mark_down(i, "its KV-event stream disconnected")
        return n

    def settle(self) -> None:
        """Poll until no stream delivered anything for ``quiet_s`` (at most ``settle_timeout_s``)."""
        deadline = time.monotonic() + self.settle_timeout_s
        quiet_since = time.monotonic()
        while time.monotonic() < deadline:
            if self.poll(0.05):
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= self.quiet_s:
                return

    def send(self, prompt: Sequence[int], max_tokens: int = 4, *, request_id: str | None = None,
             session_id: str | None = None) -> tuple:
        """Route one request, run it, record the result (``RESULT_COLUMNS``); re-routes while
        replicas fail, NoReplicaError when none is left."""
        self.counter += 1
        req = Arrival(request_id or f"req-{self.counter}", tuple(prompt), max_tokens, session_id)
        tries = 0
        while True:
            self.settle()
            i = self.dispatcher.route(req, self.now)   # NoReplicaError when all are down
            tries += 1
            t = time.monotonic()
            try:
                cached = self.handles[i].submit(req.prompt_token_ids, max_tokens)
            except (ConnectError, OSError) as e:
                self.dispatcher.mark_down(i, f"{type(e).__name__}: {str(e)[:120]}")
                continue
            self.dispatcher.finished(i, req.request_id)
            row = (req.request_id, i, self.handles[i].name, len(prompt), cached, tries, time.monotonic() - t)
            self.results.append(row)
            return row

    def run(self, prompts: Sequence[Sequence[int]], max_tokens: int = 4) -> list[tuple]:
        """``send`` each prompt in order; then settle (the views hold everything)."""
        out = [self.send(p, max_tokens) for p in prompts]
        self.settle()
        return out

    def hit_rate(self) -> float:
        """Cached prompt tokens over prompt tokens, as the replicas reported them."""
        prompt = sum(r[3] for r in self.results)
        return sum(r[4] for r in self.results) / prompt if prompt else float("nan")

    def frame(self):
        import pandas as pd
        return pd.DataFrame(self.results, columns=list(RESULT_COLUMNS))

    def close(self) -> None:
        """Close the subscribers (the replicas keep running: stop them yourself)."""
        for s in self.subscribers:
            s.close()
        self.subscribers = []


__all__ = ["Arrival", "EngineReplica", "ServerReplica", "LiveFleet", "NoReplicaError"]
