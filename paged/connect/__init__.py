"""paged.connect: the workbench and vLLM, both directions.

Watching a real server::

    src = paged.connect.connect(events="tcp://127.0.0.1:5557", metrics="http://127.0.0.1:8000/metrics")
    paged.connect.save(src, "server.npz"); paged.connect.chrome_trace(src, "server.trace.json")

Our engine speaking vLLM's protocols (``hash_fn=paged.connect.vllm_sha256`` gives vLLM's hashes)::

    llm = paged.LLM(block_size=32)
    speaker = paged.connect.publish(llm, kv_events_endpoint="tcp://*:5557", metrics_port=8001)

Why a request missed: ``paged.connect.MissLedger(llm).frame()``, ``explain_server_prompt``.

Modules: ``wire`` (the KV-event format), ``subscriber`` (ZMQ SUB, gaps, replay), ``metrics``
(Prometheus scrape), ``forest`` (the prefix forest), ``source`` (the live source), ``record``
(save, load, Perfetto), ``publisher`` / ``exporter`` / ``speak`` / ``tap`` (our engine's side),
``vllm_hash`` (vLLM's block hashes), ``misses`` (miss explanations), ``server`` (a vLLM CPU
server from its own venv). ``paged`` never imports vllm.
"""
from __future__ import annotations

import importlib

_NAMES = {
    "connect": "source", "ServerSource": "source", "SERVER_COLUMNS": "source",
    "ConnectWarning": "subscriber", "KVEventSubscriber": "subscriber",
    "PrefixForest": "forest", "KVEventPublisher": "publisher", "MetricsExporter": "exporter",
    "EngineSpeaker": "speak", "publish": "speak", "fetch_metrics": "metrics", "parse_metrics": "metrics",
    "vllm_sha256": "vllm_hash", "vllm_sha256_cbor": "vllm_hash",
    "save": "record", "load": "record", "chrome_trace": "record", "ServerRecording": "record",
    "MissLedger": "misses", "explain_server_prompt": "misses",
    "VLLMServer": "server", "Client": "server",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(f".{_NAMES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
