"""Read a vLLM server's Prometheus ``/metrics``: fetch with a timeout, parse with prometheus_client.
``parse_metrics(text)`` -> ``MetricsSample``: every sample summed over label sets, the vLLM series
under their record names, and ``vllm:cache_config_info``'s labels. Counters stay cumulative, as vLLM
reports them (``paged.connect.source`` turns samples into step-like rows).
"""
from __future__ import annotations

import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from paged.errors import ConfigError, ConnectError, WireFormatError

# record name -> vLLM sample name (counters with their _total suffix, as exposed)
VLLM_SERIES = {
    "kv_cache_usage_perc": "vllm:kv_cache_usage_perc",
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "num_running": "vllm:num_requests_running",
    "num_waiting": "vllm:num_requests_waiting",
    "num_preemptions": "vllm:num_preemptions_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
    "num_finished": "vllm:request_success_total",
    "ttft_sum": "vllm:time_to_first_token_seconds_sum",
    "ttft_count": "vllm:time_to_first_token_seconds_count",
    "e2e_sum": "vllm:e2e_request_latency_seconds_sum",
    "e2e_count": "vllm:e2e_request_latency_seconds_count",
}


@dataclass
class MetricsSample:
    """One scrape: ``values`` (record name -> value, NaN when the server does not export it),
    ``samples`` (every sample name -> value summed over label sets), ``cache_config`` (labels of
    ``vllm:cache_config_info``), and the local time it was taken."""

    time: float
    values: dict[str, float]
    samples: dict[str, float]
    cache_config: dict[str, str] = field(default_factory=dict)

    def _int(self, key: str) -> int | None:
        v = self.cache_config.get(key)
        return int(v) if v not in (None, "", "None") else None

    @property
    def num_gpu_blocks(self) -> int | None:
        return self._int("num_gpu_blocks")

    @property
    def block_size(self) -> int | None:
        return self._int("block_size")


def parse_metrics(text: str, t: float | None = None) -> MetricsSample:
    """Parse Prometheus text exposition (WireFormatError if prometheus_client cannot)."""
    samples: dict[str, float] = {}
    config: dict[str, str] = {}
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                samples[s.name] = samples.get(s.name, 0.0) + float(s.value)
                if s.name == "vllm:cache_config_info" and not config:
                    config = dict(s.labels)
    except (ValueError, TypeError, IndexError) as e:
        raise WireFormatError(f"not Prometheus text exposition ({type(e).__name__}: {str(e)[:100]})") from None
    values = {k: samples.get(v, float("nan")) for k, v in VLLM_SERIES.items()}
    return MetricsSample(time.time() if t is None else t, values, samples, config)


def fetch_metrics(url: str, timeout: float = 5.0) -> MetricsSample:
    """GET ``url`` (e.g. ``http://127.0.0.1:8000/metrics``) and parse it. ConnectError when the
    server cannot be reached in ``timeout`` seconds or answers with an HTTP error."""
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"metrics URL {url!r} must start with http:// or https:// "
                          "(e.g. http://127.0.0.1:8000/metrics)")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - a URL the user gave
            text = r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        raise ConnectError(f"{url} answered HTTP {e.code}; is it a vLLM server's /metrics?") from None
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        raise ConnectError(f"cannot reach {url} within {timeout:g} s ({getattr(e, 'reason', e)}); "
                           "is the server running and the port right?") from None
    return parse_metrics(text)
