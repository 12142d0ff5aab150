"""Our engine speaking vLLM's protocols: its prefix cache as vLLM KV events, its counters as vLLM metrics.

    llm = paged.LLM(block_size=32)
    speaker = paged.connect.publish(llm, kv_events_endpoint="tcp://*:5557", metrics_port=8001)
    speaker.publisher.seq, speaker.metrics.url

``kv_events_endpoint`` is a ZMQ endpoint string, or a dict with vLLM's ``KVEventsConfig`` keys
(``endpoint``, ``replay_endpoint``, ``topic``, ``buffer_steps``, ``hwm``). The engine knows nothing
of this: the speaker subscribes to its events from above (``paged.connect.tap``), and ``close()``
leaves the engine as it was.

What is published (the events vLLM's block pool emits, for the same situations):
- ``BlockStored`` when full blocks enter the prefix cache (our ``cache_block``): consecutive
  blocks of one request chained in one event, parent hash and token ids included;
- ``BlockRemoved`` when a cached block loses its hash to be reused (our ``evict``), not when a
  request frees it; with a host tier, a demotion is ``BlockRemoved`` (GPU) + ``BlockStored``
  (medium ``CPU``), and a host entry dropped or brought back is ``BlockRemoved`` (CPU);
- ``AllBlocksCleared`` on ``reset_prefix_cache``;
- ``BlockRemoved`` for entries that left the index without an event (a failed step's never-written
  blocks), found when the next step is planned.
One batch per engine step, sent when the scheduler has planned it (every cache change of a step
happens while planning); a reset is sent at once. Hashes go out as ints (the low 64 bits, vLLM's
default) unless ``int_hashes=False`` in the dict. With ``hash_fn=paged.connect.vllm_sha256`` the
hashes equal a vLLM server's for the same tokens (``paged.connect.vllm_hash``).
"""
from __future__ import annotations

import contextlib
import os
import time
import weakref
from typing import Any

from paged.core import events as ev

from . import tap as _tap
from .exporter import MetricsExporter
from .publisher import KVEventPublisher
from .settings import check_connect_settings, events_settings
from .wire import MEDIUM_CPU, MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, to_int_hash

class EngineSpeaker:
    """Publishes an engine's cache events and metrics (see the module docstring)."""

    def __init__(self, engine: Any, events: Any = None, metrics_port: int | None = None) -> None:
        settings = events_settings(events)
        self.engine = engine
        self.int_hashes = True
        self.publisher: KVEventPublisher | None = None
        self.metrics: MetricsExporter | None = None
        kv = engine.kv
        try:
            if settings is not None:
                self.int_hashes = bool(settings.pop("int_hashes", True))
                self.publisher = KVEventPublisher(**settings)
            if metrics_port is not None:
                cfg = getattr(engine, "config", None)
                loaded = getattr(engine, "loaded", None)
                name = (getattr(getattr(loaded, "config", None), "name", "") or
                        os.path.basename(str(getattr(loaded, "source", "model")))) or "model"
                self.metrics = MetricsExporter(name, block_size=kv.block_size, num_gpu_blocks=kv.num_blocks,
                                               cache_dtype=getattr(cfg, "kv_cache_dtype", "auto"),
                                               enable_prefix_caching=kv.enable_prefix_caching,
                                               port=metrics_port)
        except BaseException:
            self.close()
            raise
        self._pending: list[KVEvent] = []
        self._chain_rid: Any = None                      # request of the last pending BlockStored (GPU)
        self._host: dict[int, Any] = {}                  # CPU block -> hash published as CPU-stored
        self._parents: dict[Any, Any] = {}               # published hash -> its published parent (None: a root)
        self._gpu: set = set()                           # hashes published as GPU-stored (as the pool keys them)
        self._preemptions = 0
        self._rows_seen = 0
        self.num_batches = 0
        _tap.install(engine, self._on_event)
        weakref.finalize(self, _close_quietly, self.publisher, self.metrics)

    # ---- event translation (called synchronously by the tap) ---------------------------------------------
    def _h(self, h: Any) -> Any:
        return to_int_hash(h) if self.int_hashes and h is not None else h

    def _on_event(self, step: int, kind: str, rid: Any, bid: Any, value: Any) -> None:
        if kind == ev.CACHE_BLOCK and self.publisher is not None:
            self._stored(rid, bid)
        elif kind == ev.EVICT and self.publisher is not None:
            self._removed(bid)
        elif kind == ev.TIER_OUT and self.publisher is not None:
            self._tier_out(bid, value)
        elif kind in (ev.TIER_IN, ev.HOST_EVICT):
            h = self._host.pop(value, None)
            if h is not None and self.publisher is not None:
                self._pending.append(BlockRemoved((h,), MEDIUM_CPU))
        elif kind == ev.RESET:
            self._host.clear()
            self._gpu.clear()
            self._parents.clear()
            if self.publisher is not None:
                self._pending.append(AllBlocksCleared())
                self.flush()
            self.update_metrics()
        elif kind == ev.PREEMPT:
            self._preemptions += 1
        elif kind == ev.STEP:
            self._end_of_plan()

    def _parent_hash(self, rid: Any, block: Any) -> Any:
        """vLLM's parent_block_hash: the hash before ``block`` in its request's chain (None: a first block)."""
        if not block.depth:
            return None
        hashes = self.engine.kv.prefix.hashes.get(rid)
        return hashes[block.depth - 1] if hashes and len(hashes) >= block.depth else None

    def _stored(self, rid: Any, bid: int) -> None:
        block = self.engine.kv.pool.blocks[bid]
        self._gpu.add(block.block_hash)
        h, parent = self._h(block.block_hash), self._h(self._parent_hash(rid, block))
        self._parents[h] = parent  # a block leaves for the host tier without a request: its parent from here
        last = self._pending[-1] if self._pending else None
        if (isinstance(last, BlockStored) and self._chain_rid == rid and last.medium == MEDIUM_GPU
                and last.block_hashes[-1] == parent):
            self._pending[-1] = BlockStored(last.block_hashes + (h,), last.parent_block_hash,
                                            last.token_ids + tuple(block.token_ids), last.block_size, MEDIUM_GPU)
        else:
            self._pending.append(BlockStored((h,), parent, tuple(block.token_ids), len(block.token_ids), MEDIUM_GPU))
            self._chain_rid = rid

    def _removed(self, bid: int) -> None:
        block = self.engine.kv.pool.blocks[bid]
        if block.block_hash is not None:
            self._gpu.discard(block.block_hash)
            self._pending.append(BlockRemoved((self._h(block.block_hash),), MEDIUM_GPU))

    def _tier_out(self, bid: int, cpu: int) -> None:
        block = self.engine.kv.pool.blocks[bid]
        if block.block_hash is None:
            return
        self._gpu.discard(block.block_hash)
        h = self._h(block.block_hash)
        parent = self._parents.get(h)
        self._pending += [BlockRemoved((h,), MEDIUM_GPU),
                          BlockStored((h,), parent, tuple(block.token_ids), len(block.token_ids), MEDIUM_CPU)]
        self._host[cpu] = h

    def _end_of_plan(self) -> None:
        index = self.engine.kv.pool.index
        if self.publisher is not None and len(index) != len(self._gpu):
            # entries dropped without an event (a failed step's never-written blocks): removed for consumers
            gone = [h for h in self._gpu if h not in index]
            self._gpu.difference_update(gone)
            self._pending.extend(BlockRemoved((self._h(h),), MEDIUM_GPU) for h in gone)
        host = getattr(self.engine.kv, "host", None)
        if host is not None and self._host and self.publisher is not None:
            # entries the host tier dropped without an event (deduplicated against the GPU tier)
            live = {e.block_id for e in host.entries.values()}
            for cpu in [c for c in self._host if c not in live]:
                self._pending.append(BlockRemoved((self._host.pop(cpu),), MEDIUM_CPU))
        if len(self._parents) > 2 * (len(self._gpu) + len(self._host)) + 64:  # forget hashes held nowhere
            held = {self._h(x) for x in self._gpu} | set(self._host.values())
            self._parents = {h: p for h, p in self._parents.items() if h in held}
        self.flush()
        self.update_metrics()

    # ---- output ------------------------------------------------------------------------------------------
    def flush(self) -> int | None:
        """Publish what is pending as one batch (nothing when empty); returns its sequence number."""
        if self.publisher is None or not self._pending:
            return None
        events, self._pending, self._chain_rid = self._pending, [], None
        self.num_batches += 1
        return self.publisher.publish(events, ts=time.time())

    def update_metrics(self) -> None:
        """Bring the metrics up to date now (they also update after every planned step)."""
        m = self.metrics
        if m is None:
            return
        kv, sched = self.engine.kv, self.engine.scheduler
        m.update(running=len(sched.running), waiting=len(sched.waiting), usage=kv.kv_cache_usage_perc,
                 queries=kv.prefix_cache_queries, hits=kv.prefix_cache_hits, preemptions=self._preemptions)
        rows = self.engine.request_rows() if hasattr(self.engine, "request_rows") else []
        if len(rows) > self._rows_seen:
            m.finished(rows[self._rows_seen:])
            self._rows_seen = len(rows)

    def close(self) -> None:
        """Stop publishing and serving (idempotent); the engine keeps running without them."""
        _tap.remove(self.engine, self._on_event) if hasattr(self, "_pending") else None
        _close_quietly(self.publisher, self.metrics)
        self.publisher = self.metrics = None


def _close_quietly(publisher: KVEventPublisher | None, metrics: MetricsExporter | None) -> None:
    for x in (publisher, metrics):
        if x is not None:
            with contextlib.suppress(Exception):  # closing at exit must not raise
                x.close()


def publish(llm_or_engine: Any, kv_events_endpoint: Any = None,
            metrics_port: int | None = None) -> EngineSpeaker:
    """Make a running ``paged.LLM`` / ``LLMEngine`` speak vLLM's protocols: its prefix cache as KV events
    on ``kv_events_endpoint`` (a ZMQ endpoint, or a dict of vLLM's ``KVEventsConfig`` keys) and its
    counters as Prometheus metrics under vLLM's names on ``metrics_port`` (0: any free port). The
    speaker listens to the engine's events from above (``paged.connect.tap``); ``close()`` stops it and
    leaves the engine as it was. A ConfigError (nothing started) for a bad or missing setting."""
    from paged.errors import ConfigError
    check_connect_settings(kv_events_endpoint, metrics_port, ConfigError)
    if kv_events_endpoint is None and metrics_port is None:
        raise ConfigError("give kv_events_endpoint (a ZMQ endpoint such as 'tcp://*:5557') or metrics_port "
                          "(0: any free port), or both")
    return EngineSpeaker(getattr(llm_or_engine, "engine", llm_or_engine), kv_events_endpoint, metrics_port)
