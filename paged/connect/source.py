"""A live source for a real vLLM server: its KV events (ZMQ) and its metrics (Prometheus), as records.

    src = paged.connect.connect(events="tcp://127.0.0.1:5557", metrics="http://127.0.0.1:8000/metrics")
    src.wait_until(lambda s: s.forest.live, timeout=30)
    src.forest, src.steps_frame(), src.events_frame(), src.server_frame(), src.status, src.warnings

Records follow ``paged.telemetry`` where the server reports the data: a row per scrape (``time_s``
since the source started, ``step_time_s`` since the previous scrape; ``num_preempted``,
``num_prefill_tokens``/``num_decode_tokens`` (prompt/generation tokens) and ``num_finished`` counted
since it; cumulative ``prefix_cache_queries``/``hits`` in tokens; ``num_used_blocks``/
``num_free_blocks`` from the usage and ``vllm:cache_config_info``'s pool size). What vLLM does not
report (copies, swaps, host tier) is 0, ``token_usage`` NaN. Events: ``cache_block`` (value:
tokens) per stored block, ``evict`` per removed one, ``reset`` (value: blocks cleared) per
``AllBlocksCleared`` or publisher restart; ``step`` is the index of the next row.

Threading: with ``background=True`` a daemon thread polls; read under ``src.lock`` (the ``*_frame``
methods do). Nothing blocks longer than ``timeout``; errors after start-up are warnings and the
records keep what they had.
"""
from __future__ import annotations

import math
import threading
import time
import warnings
from typing import Any, Callable

from paged.core import events as ev
from paged.errors import ConfigError, ConnectError, PagedError
from paged.runs import RecordFrames
from paged.telemetry import STEP_COLUMNS

from .forest import PrefixForest
from .metrics import MetricsSample, fetch_metrics
from .subscriber import ConnectWarning, KVEventSubscriber
from .wire import AllBlocksCleared, Batch, BlockRemoved, BlockStored, MEDIUM_GPU, event_json

SERVER_COLUMNS = ("time_s", "kv_cache_usage_perc", "prefix_cache_queries", "prefix_cache_hits", "hit_rate",
                  "interval_hit_rate", "num_running", "num_waiting", "num_preemptions", "live_blocks",
                  "stored_blocks", "removed_blocks", "ttft_mean_s")


class ServerSource(RecordFrames):
    """See the module docstring."""

    backend = "vllm"

    def __init__(self, events: str | None = None, metrics: str | None = None, *, replay: str | None = None,
                 topic: str = "", poll_interval: float = 0.5, timeout: float = 5.0, connect_timeout: float = 10.0,
                 tokenizer: Any = None, label: str = "vllm", medium: str = MEDIUM_GPU, background: bool = True,
                 warn: bool = True) -> None:
        if events is None and metrics is None:
            raise ConfigError("connect() needs events='tcp://HOST:PORT' (vLLM's KV events) and/or "
                              "metrics='http://HOST:PORT/metrics'")
        if not (isinstance(poll_interval, (int, float)) and poll_interval > 0):
            raise ConfigError(f"poll_interval must be a positive number of seconds, got {poll_interval!r}")
        self.label, self.tokenizer, self.medium = label, tokenizer, medium
        self.events_endpoint, self.metrics_url = events, metrics
        self.poll_interval, self.timeout = float(poll_interval), float(timeout)
        self.lock = threading.RLock()
        self.rows: list[dict] = []
        self.events: list[ev.Event] = []
        self.server_rows: list[dict] = []
        self.wire: list[dict] = []            # every applied batch: arrival time, seq, ts, events (JSON)
        self.forest = PrefixForest(medium)
        self.snapshots: dict = {}
        self.done = False
        self.cache_config: dict[str, str] = {}
        self.warnings: list[tuple[float, str]] = []
        self.metrics_failures = 0
        self._warn = warn
        self._last: MetricsSample | None = None
        self._next_scrape = 0.0
        self._metrics_down = False
        self._sub: KVEventSubscriber | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.t0 = time.time()
        if metrics is not None:
            self._scrape(first=True)  # ConnectError now if the server is not there
        if events is not None:
            self._sub = KVEventSubscriber(events, replay_endpoint=replay, topic=topic, timeout=timeout,
                                          connect_timeout=connect_timeout, warn=False)
            self._sub.connect()  # ConnectError if no publisher answers
            self._sub_counts = self._counts()
        if background:
            self._thread = threading.Thread(target=self._loop, daemon=True, name="paged-connect")
            self._thread.start()

    # ---- polling ---------------------------------------------------------------------------------------
    @property
    def now(self) -> float:
        """Seconds since the source started (the records' clock)."""
        return time.time() - self.t0

    def poll(self, timeout: float = 0.1) -> int:
        """Take what arrived (waiting up to ``timeout`` for events) and scrape the metrics when due;
        returns the number of batches applied. Called by the background thread, or by you
        with ``background=False``."""
        n = 0
        if self._sub is not None:
            wait = timeout if self.metrics_url is None else max(0.0, min(timeout, self._next_scrape - time.monotonic()))
            seen = len(self._sub.status.warnings)
            try:
                batches = self._sub.poll(wait)
            except PagedError as e:
                self._note(f"events: {e}")
                batches = []
            for when, msg in self._sub.status.warnings[seen:]:
                self._note(msg)
            with self.lock:  # the counters readers see move only with the warnings they come with
                self._sub_counts = self._counts()
                for b in batches:
                    self._apply(b)
            n = len(batches)
        elif timeout > 0 and self.metrics_url is not None:
            time.sleep(max(0.0, min(timeout, self._next_scrape - time.monotonic())))
        if self.metrics_url is not None and time.monotonic() >= self._next_scrape:
            self._scrape()
        return n

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll(0.1)
            except Exception as e:  # noqa: BLE001 - the thread must survive anything; the error is shown
                self._note(f"poll failed: {type(e).__name__}: {e}")
                time.sleep(0.2)

    def wait_until(self, predicate: Callable[["ServerSource"], Any], timeout: float = 10.0) -> bool:
        """Poll (or wait for the background thread) until ``predicate(self)`` is true; False after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                if predicate(self):
                    return True
            if time.monotonic() >= deadline:
                return False
            if self._thread is None:
                self.poll(min(0.1, max(0.0, deadline - time.monotonic())))
            else:
                time.sleep(0.02)

    def scrape_now(self) -> None:
        """Scrape the metrics now (a row), whatever the interval."""
        if self.metrics_url is not None:
            self._scrape()

    # ---- applying ----------------------------------------------------------------------------------------
    def _apply(self, b: Batch) -> None:
        t = self.now
        step = len(self.rows)
        if b.after_restart and self.forest.live:
            cleared = self.forest.clear(t)
            self.events.append(ev.Event(step, ev.RESET, None, None, len(cleared)))
        for e in b.events:
            nodes = self.forest.apply(e, t)
            if isinstance(e, BlockStored):
                self.events.extend(ev.Event(step, ev.CACHE_BLOCK, None, n.node_id, len(n.token_ids)) for n in nodes)
            elif isinstance(e, BlockRemoved):
                self.events.extend(ev.Event(step, ev.EVICT, None, n.node_id, None) for n in nodes)
            else:
                self.events.append(ev.Event(step, ev.RESET, None, None, len(nodes)))
        self.wire.append({"t": t, "seq": b.seq, "ts": b.ts, "restart": b.after_restart,
                          "events": [event_json(e) for e in b.events]})

    def _scrape(self, first: bool = False) -> None:
        self._next_scrape = time.monotonic() + self.poll_interval
        try:
            sample = fetch_metrics(self.metrics_url, timeout=self.timeout)
        except PagedError as e:
            if first:
                raise
            if not self._metrics_down:
                self._metrics_down = True
                self._note(f"metrics: {e} (the view keeps what it has; retrying every {self.poll_interval:g} s)")
            with self.lock:  # counted after its warning: a reader seeing the count sees the warning
                self.metrics_failures += 1
            return
        if self._metrics_down:
            self._metrics_down = False
            self._note(f"metrics: {self.metrics_url} answers again")
        with self.lock:
            self._add_row(sample)

    def _add_row(self, s: MetricsSample) -> None:
        if s.cache_config:
            self.cache_config = s.cache_config
        prev = self._last
        t = s.time - self.t0
        v = s.values

        def delta(key: str) -> int:
            a = v.get(key, math.nan)
            b = prev.values.get(key, math.nan) if prev is not None else 0.0
            return 0 if math.isnan(a) else int(round(a - (0.0 if math.isnan(b) else b)))

        def val(key: str, default: float = 0.0) -> float:
            x = v.get(key, math.nan)
            return default if math.isnan(x) else x

        nblocks = s.num_gpu_blocks or 0
        usage = val("kv_cache_usage_perc")
        used = int(round(usage * nblocks))
        prompt, gen = delta("prompt_tokens"), delta("generation_tokens")
        row = {c: 0 for c in STEP_COLUMNS}
        row.update(step=len(self.rows), time_s=t, step_time_s=(t - self.rows[-1]["time_s"]) if self.rows else 0.0,
                   num_seqs=int(val("num_running")), num_prefill_tokens=prompt, num_decode_tokens=gen,
                   num_batched_tokens=prompt + gen, num_running=int(val("num_running")),
                   num_waiting=int(val("num_waiting")), num_preempted=delta("num_preemptions"),
                   kv_cache_usage_perc=usage, token_usage=math.nan, num_used_blocks=used,
                   num_free_blocks=max(nblocks - used, 0), prefix_cache_queries=int(val("prefix_cache_queries")),
                   prefix_cache_hits=int(val("prefix_cache_hits")), num_finished=delta("num_finished"))
        self.rows.append(row)
        q, h = val("prefix_cache_queries"), val("prefix_cache_hits")
        dq = q - (prev.values.get("prefix_cache_queries", 0.0) if prev is not None else 0.0)
        dh = h - (prev.values.get("prefix_cache_hits", 0.0) if prev is not None else 0.0)
        n = val("ttft_count")
        c = self.forest.counts()
        self.server_rows.append({"time_s": t, "kv_cache_usage_perc": usage, "prefix_cache_queries": q,
                                 "prefix_cache_hits": h, "hit_rate": h / q if q else math.nan,
                                 "interval_hit_rate": dh / dq if dq > 0 else math.nan,
                                 "num_running": val("num_running"), "num_waiting": val("num_waiting"),
                                 "num_preemptions": val("num_preemptions"), "live_blocks": c["live"],
                                 "stored_blocks": c["stored"], "removed_blocks": c["removed"],
                                 "ttft_mean_s": val("ttft_sum") / n if n else math.nan})
        self._last = s

    def _counts(self) -> dict[str, Any]:
        """The subscriber's counters but the raw event count, the clock and the warning list."""
        st = self._sub.status
        return {**{k: v for k, v in vars(st).items() if k not in ("events", "last_message_s", "warnings")},
                "unknown_events": dict(st.unknown_events)}

    def _note(self, msg: str) -> None:
        with self.lock:
            self.warnings.append((self.now, msg))
        if self._warn:
            warnings.warn(f"{self.label}: {msg}", ConnectWarning, stacklevel=2)

    # ---- records -------------------------------------------------------------------------------------------
    @property
    def status(self) -> dict:
        """Subscriber counters, forest counts, scrapes and failures, in one dict."""
        with self.lock:
            out: dict[str, Any] = {"scrapes": len(self.rows), "metrics_failures": self.metrics_failures,
                                   "warnings": len(self.warnings)}
            if self._sub is not None:
                out.update(self._sub_counts)
            out.update({f"forest_{k}": v for k, v in self.forest.counts().items()})
            return out

    def request_rows(self) -> list[dict]:
        return []  # a server's requests are not in its event stream or metrics

    def steps_frame(self):
        with self.lock:
            return super().steps_frame()

    def events_frame(self):
        with self.lock:
            return super().events_frame()

    def server_frame(self):
        """One row per scrape: ``SERVER_COLUMNS``."""
        import pandas as pd
        with self.lock:
            return pd.DataFrame(list(self.server_rows), columns=list(SERVER_COLUMNS))

    def forest_frame(self):
        """``PrefixForest.frame`` now, tokens decoded with the source's tokenizer."""
        with self.lock:
            return self.forest.frame(self.now, self.tokenizer)

    def close(self) -> None:
        """Stop polling and close the sockets (idempotent); the records stay."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(1.0, self.timeout + 1.0))
            self._thread = None
        if self._sub is not None:
            self._sub.close()
        self.done = True

    def __enter__(self) -> "ServerSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def connect(events: str | None = None, metrics: str | None = None, **kw: Any) -> ServerSource:
    """A ``ServerSource`` on a vLLM server (or our engine speaking its protocols); see ``ServerSource``."""
    return ServerSource(events, metrics, **kw)


__all__ = ["SERVER_COLUMNS", "ServerSource", "connect", "ConnectError", "ConnectWarning", "AllBlocksCleared"]
