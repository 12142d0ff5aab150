"""One simulated point: trace keys (``TRACE_KEYS``) plus ``SimConfig`` fields -> the run's summary.

This is the ``"simulate"`` study of ``paged.sweep``, which runs grids of them (in worker
processes or on Ray, stored and resumable). Keys starting with ``_`` ride along unused (labels).
"""
from __future__ import annotations

from typing import Any

import pandas as pd

from paged.sim.simulator import SimConfig, Simulator
from paged.sim.workload import load_trace, synthetic_trace

__all__ = ["TRACE_KEYS", "point_keys", "run_point", "trace_for"]

TRACE_KEYS = ("workload", "num_requests", "rate", "arrival", "cv", "trace_seed", "num_prefixes", "prefix_tokens",
              "prefix_fraction", "prefix_zipf", "trace")


def point_keys() -> tuple[str, ...]:
    """Every key a ``"simulate"`` point may have: the ``SimConfig`` settings, then ``TRACE_KEYS``."""
    return (*SimConfig.knob_fields(), *TRACE_KEYS)


def trace_for(point: dict[str, Any], max_model_len: int) -> pd.DataFrame:
    """The trace of a point's trace keys (``TRACE_KEYS``): the first ``num_requests`` rows of
    ``trace`` (all when None), else ``num_requests`` (default 1000) synthetic requests of
    ``workload`` (``paged.sim.workload.synthetic_trace``'s defaults for the keys not given)."""
    if point.get("trace"):
        tr = load_trace(point["trace"])
        limit = point.get("num_requests")
        return tr.iloc[: int(limit)] if limit and int(limit) < len(tr) else tr
    return synthetic_trace(point.get("workload", "sharegpt"), int(point.get("num_requests") or 1000),
                           rate=float(point.get("rate", float("inf"))), arrival=point.get("arrival", "poisson"),
                           cv=float(point.get("cv", 2.0)), trace_seed=int(point.get("trace_seed", 0)),
                           max_model_len=max_model_len, num_prefixes=int(point.get("num_prefixes", 0)),
                           prefix_tokens=int(point.get("prefix_tokens", 0)),
                           prefix_fraction=float(point.get("prefix_fraction", 1.0)),
                           prefix_zipf=float(point.get("prefix_zipf", 0.0)))


def run_point(point: dict[str, Any]) -> dict[str, Any]:
    """One grid point: trace keys (``TRACE_KEYS``) + ``SimConfig`` fields -> params and summary."""
    SimConfig.check_names({k: v for k, v in point.items() if not k.startswith("_")}, TRACE_KEYS)
    sim = Simulator(SimConfig(**{k: v for k, v in point.items() if k not in TRACE_KEYS and not k.startswith("_")}))
    s = sim.run(trace_for(point, sim.max_model_len)).summary
    return {**{k: v for k, v in point.items() if not k.startswith("_")}, **s}
