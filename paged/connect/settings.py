"""The engine's two connect settings, checked without importing zmq or prometheus_client:
``kv_events_endpoint`` (None, a ZMQ endpoint: ``"tcp://*:5557"`` binds, ``"tcp://HOST:PORT"``
connects, ``ipc://`` / ``inproc://``; or a dict of vLLM's ``KVEventsConfig`` keys, ``endpoint``
required, ours also ``int_hashes``) and ``metrics_port`` (None, or a port on 127.0.0.1; 0: any free one).
"""
from __future__ import annotations

from typing import Any, Callable

from paged.checks import is_int
from paged.errors import ConfigError

EVENT_KEYS = ("endpoint", "replay_endpoint", "topic", "buffer_steps", "hwm", "int_hashes")
_SCHEMES = ("tcp://", "ipc://", "inproc://")


def is_bind(endpoint: str) -> bool:
    """Whether vLLM's publisher binds ``endpoint`` (``*`` or ``::`` in it, or ipc/inproc) rather than connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def events_settings(value: Any, error: Callable[[str], Exception] = ConfigError) -> dict | None:
    """``kv_events_endpoint`` as a dict of publisher settings; ``error(message)`` is raised when wrong."""
    if value is None:
        return None
    if isinstance(value, str):
        value = {"endpoint": value}
    if not isinstance(value, dict):
        raise error(f"kv_events_endpoint must be a ZMQ endpoint such as 'tcp://*:5557' or a dict of vLLM's "
                    f"KVEventsConfig keys, got {value!r}")
    unknown = sorted(set(value) - set(EVENT_KEYS) - {"enable_kv_cache_events", "publisher"})
    if unknown or "endpoint" not in value:
        raise error(f"kv_events_endpoint: a dict needs 'endpoint' and may have {', '.join(EVENT_KEYS[1:])}"
                    f"{'; unknown: ' + ', '.join(unknown) if unknown else ''}")
    if value.get("publisher", "zmq") != "zmq":
        raise error(f"kv_events_endpoint: only the 'zmq' publisher is spoken, got {value['publisher']!r}")
    for key in ("endpoint", "replay_endpoint"):
        v = value.get(key)
        if v is not None and not (isinstance(v, str) and v.startswith(_SCHEMES)):
            raise error(f"kv_events_endpoint: {key} must be tcp://HOST:PORT (tcp://*:PORT binds), ipc://PATH "
                        f"or inproc://NAME, got {v!r}")
    r = value.get("replay_endpoint")
    if r is not None and not is_bind(r):
        raise error(f"kv_events_endpoint: the replay endpoint {r!r} is bound, so it needs '*' (tcp://*:PORT) or ipc://")
    return {k: v for k, v in value.items() if k in EVENT_KEYS}


def check_connect_settings(events: Any, metrics_port: Any, error: Callable[[str], Exception] = ConfigError) -> None:
    """Raise ``error(message)`` for a bad ``kv_events_endpoint`` or ``metrics_port``."""
    events_settings(events, error)
    if metrics_port is not None and (not is_int(metrics_port) or not 0 <= metrics_port < 65536):
        raise error(f"metrics_port must be None or an integer port in [0, 65535] (0: any free one), "
                    f"got {metrics_port!r}")
