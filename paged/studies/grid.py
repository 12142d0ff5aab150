"""Simulated runs over a grid of points: each point is trace keys (``TRACE_KEYS``) plus
``SimConfig`` fields; one row per point (its parameters, then the run's summary), in order, in
worker processes when ``jobs > 1``. Keys starting with ``_`` ride along unused (labels)."""
from __future__ import annotations

from typing import Any

import pandas as pd

from paged.sim.simulator import SimConfig, Simulator
from paged.sim.workload import load_trace, synthetic_trace

__all__ = ["TRACE_KEYS", "run_grid", "run_point", "trace_for"]

TRACE_KEYS = ("workload", "num_requests", "rate", "arrival", "cv", "trace_seed", "num_prefixes", "prefix_tokens",
              "prefix_fraction", "trace")


def trace_for(point: dict[str, Any], max_model_len: int) -> pd.DataFrame:
    """The trace of a point's trace keys (``TRACE_KEYS``): the first ``num_requests`` rows of
    ``trace`` (all when None), else ``num_requests`` (default 1000) synthetic requests of
    ``workload``, seeded by ``trace_seed`` (default ``seed``)."""
    if point.get("trace"):
        tr = load_trace(point["trace"])
        limit = point.get("num_requests")
        return tr.iloc[: int(limit)] if limit and int(limit) < len(tr) else tr
    return synthetic_trace(point.get("workload", "sharegpt"), int(point.get("num_requests") or 1000),
                           rate=float(point.get("rate", float("inf"))), arrival=point.get("arrival", "poisson"),
                           cv=float(point.get("cv", 2.0)), seed=int(point.get("trace_seed", point.get("seed", 0))),
                           max_model_len=max_model_len, num_prefixes=int(point.get("num_prefixes", 0)),
                           prefix_tokens=int(point.get("prefix_tokens", 0)),
                           prefix_fraction=float(point.get("prefix_fraction", 1.0)))


def run_point(point: dict[str, Any]) -> dict[str, Any]:
    """One grid point: trace keys (``TRACE_KEYS``) + ``SimConfig`` fields -> params and summary."""
    sim = Simulator(SimConfig(**{k: v for k, v in point.items() if k not in TRACE_KEYS and not k.startswith("_")}))
    s = sim.run(trace_for(point, sim.max_model_len)).summary
    return {**{k: v for k, v in point.items() if not k.startswith("_")}, **s}


def run_grid(points: list[dict[str, Any]], jobs: int = 1, progress: bool = False) -> pd.DataFrame:
    """Run grid points (in ``jobs`` worker processes when > 1) into one row each, in order."""
    if jobs > 1 and len(points) > 1:
        from concurrent.futures import ProcessPoolExecutor
        import multiprocessing as mp

        # fork: works from notebooks and unguarded scripts; the workers only run pure Python
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        with ProcessPoolExecutor(max_workers=min(jobs, len(points)), mp_context=ctx) as ex:
            futures = [ex.submit(run_point, p) for p in points]
            it = futures
            if progress:
                from concurrent.futures import as_completed
                from tqdm.auto import tqdm
                for _ in tqdm(as_completed(futures), total=len(futures), unit="run", leave=False):
                    pass
            rows = [f.result() for f in it]
    else:
        it = points
        if progress:
            from tqdm.auto import tqdm
            it = tqdm(points, unit="run", leave=False)
        rows = [run_point(p) for p in it]
    return pd.DataFrame(rows)
