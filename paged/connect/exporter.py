"""Serve our engine's counters as Prometheus metrics under vLLM's names (prometheus_client).

    m = MetricsExporter(model_name="smollm2", block_size=32, num_gpu_blocks=64, port=8001)
    m.update(running=2, waiting=0, usage=0.3, queries=640, hits=320, preemptions=0); m.finished(rows)

Each exporter has its own ``CollectorRegistry`` (engines in one process do not clash) and HTTP
thread (``start_http_server`` on ``host``; port 0: any free one). Counters advance by the increase
of our cumulative counters, so they only grow, as Prometheus requires. Labels: ``model_name``, ``engine``.
"""
from __future__ import annotations

import math
from typing import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

from paged.errors import ConfigError

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


class MetricsExporter:
    """vLLM-named metrics for one engine (see the module docstring)."""

    def __init__(self, model_name: str, *, block_size: int, num_gpu_blocks: int, cache_dtype: str = "auto",
                 enable_prefix_caching: bool = True, port: int | None = None, host: str = "127.0.0.1") -> None:
        if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 0 <= port < 65536):
            raise ConfigError(f"metrics_port must be an integer port in [0, 65535] (0: any free one), got {port!r}")
        self.registry = r = CollectorRegistry()
        lab = ["model_name", "engine"]
        self._labels = {"model_name": model_name, "engine": "0"}

        def labelled(kind, **kw):  # a Gauge/Counter/Histogram of this engine, with its labels set
            return lambda name, doc: kind(name, doc, lab, registry=r, **kw).labels(**self._labels)
        g, c, h = labelled(Gauge), labelled(Counter), labelled(Histogram, buckets=_LATENCY_BUCKETS)

        self.running = g("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = g("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.usage = g("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.queries = c("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.hits = c("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = c("vllm:num_preemptions", "Cumulative number of preemptions from the engine.")
        self.prompt_tokens = c("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = c("vllm:generation_tokens", "Number of generation tokens processed.")
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                lab + ["finished_reason"], registry=r)
        self.ttft = h("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.")
        self.e2e = h("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.")
        info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                     ["block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching", "engine"], registry=r)
        info.labels(block_size=str(block_size), num_gpu_blocks=str(num_gpu_blocks), cache_dtype=cache_dtype,
                    enable_prefix_caching=str(bool(enable_prefix_caching)), engine="0").set(1)
        self._last = {"queries": 0, "hits": 0, "preemptions": 0}
        self._server = self._thread = None
        self.host, self.port = host, None
        if port is not None:
            try:
                self._server, self._thread = start_http_server(port, addr=host, registry=r)
            except OSError as e:
                raise ConfigError(f"cannot serve metrics on {host}:{port}: {e}; pick a free metrics_port "
                                  "(0: any free one)") from None
            self.port = self._server.server_address[1]

    @property
    def url(self) -> str | None:
        return None if self.port is None else f"http://{self.host}:{self.port}/metrics"

    def update(self, *, running: int, waiting: int, usage: float, queries: int, hits: int, preemptions: int) -> None:
        """Set gauges and advance counters to our cumulative values."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.usage.set(usage)
        for name, counter, value in (("queries", self.queries, queries), ("hits", self.hits, hits),
                                     ("preemptions", self.preemptions, preemptions)):
            if value > self._last[name]:
                counter.inc(value - self._last[name])
                self._last[name] = value

    def finished(self, rows: Iterable[dict]) -> None:
        """Count finished requests (``paged.telemetry`` request rows) and observe their latencies."""
        for row in rows:
            self.prompt_tokens.inc(row["num_prompt_tokens"])
            self.generation_tokens.inc(row["num_output_tokens"])
            self._success.labels(**self._labels, finished_reason="length").inc()
            for hist, key in ((self.ttft, "ttft_s"), (self.e2e, "e2e_s")):
                v = row.get(key)
                if v is not None and not math.isnan(v):
                    hist.observe(v)

    def text(self) -> str:
        """The exposition text (what /metrics serves)."""
        return generate_latest(self.registry).decode()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
