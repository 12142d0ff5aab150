"""``sweep(study, grid, ...)``: every point of a grid through one study, into one tidy DataFrame.

Columns, in order: the points' parameters (grid key order), ``row`` (only when the study returns
several rows for some point: the row's index within its point), the study's results, then ``META``: ``status`` ("ok" | "error": the
study raised, ``error`` says what | "lost": its worker died past the retries), ``error``,
``wall_s`` and ``cpu_s`` (of the point, measured in its worker), ``host``, ``pid``, ``node``
(where it ran; a Ray node id under Ray), ``backend``, ``cached`` (read from the point store, not
computed by this call) and ``point`` (its key in the store). Rows follow the grid's order
whatever order points finish in, so a sweep is reproducible row for row.

Every finished point ("ok" or "error") is stored at once (``paged.sweeps.store``); a later call
with the same study and points reads them back and runs only the others. ``force=True``
recomputes everything; ``retry_errors=True`` recomputes points stored with an error.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Literal, Mapping

import pandas as pd

from paged.errors import ConfigError, SweepPointError

from .backends import LocalBackend, RayBackend
from .grid import Grid, expand, point_id
from .point import META, ROW
from .registry import Study, get_study
from .store import PointStore, normalize, read_rows

Rows = list[dict[str, Any]]


def default_store_dir() -> Path:
    """``$PAGED_SWEEP_DIR``, else ``.cache/sweeps`` under the working directory (git-ignored)."""
    return Path(os.environ.get("PAGED_SWEEP_DIR") or Path(".cache") / "sweeps")


def _backend(backend: str, jobs: int, address: str | None, max_retries: int, ray_init: Mapping[str, Any] | None):
    if backend == "local":
        if address is not None:
            raise ConfigError(f"address={address!r} is for backend='ray'; drop it or pass backend='ray'")
        return LocalBackend(jobs)
    if backend == "ray":
        return RayBackend(address, max_retries=max_retries, init=ray_init)
    raise ConfigError(f"backend must be 'local' or 'ray', got {backend!r}")


def _frame(rows: Rows) -> pd.DataFrame:
    """Rows -> DataFrame with parameters first and ``META`` last; ``row`` 0 for one-row points."""
    df = pd.DataFrame(rows)
    if ROW in df.columns:
        df[ROW] = df[ROW].fillna(0).astype(int)
    meta = [c for c in META if c in df.columns]
    head = [c for c in df.columns if c not in meta]
    return df[head + meta]


def sweep(study: "str | Study | Callable[..., Any]", grid: Grid, *, backend: Literal["local", "ray"] = "local",
          jobs: int = 1, address: str | None = None, store: "str | os.PathLike | bool | None" = None,
          force: bool = False, retry_errors: bool = False, progress: bool = True,
          on_result: Callable[[Rows], None] | None = None, num_cpus: float | None = None,
          num_gpus: float | None = None, max_retries: int = 3, version: str | None = None,
          ray_init: Mapping[str, Any] | None = None, on_error: Literal["row", "raise"] = "row") -> pd.DataFrame:
    """Run ``study`` (a registered name such as ``"simulate"``, a ``Study`` or a module-level
    function) on every point of ``grid`` (see ``paged.sweeps.grid``); one row per point (per
    result row for studies that return several).

    - ``backend="local"``: in this process (``jobs=1``) or ``jobs`` worker processes;
      ``backend="ray"``: one Ray task per point, on the Ray instance this process has started,
      else an embedded local one (``address=None``: the machine's cores), or a cluster (``address="auto"`` / ``"ray://host:10001"``).
      Results are identical; only the ``META`` timing and placement columns differ.
    - ``num_cpus``/``num_gpus``: what one point asks of Ray (default: the study's); ``ray_init``
      goes to ``ray.init`` (e.g. ``{"num_cpus": 2}`` for a smaller embedded instance, or
      ``{"runtime_env": {"working_dir": "."}}`` for a cluster).
    - ``store``: folder of the point store (default ``default_store_dir()``); ``False``: none.
    - ``on_result(rows)``: called in this process with each point's rows as it arrives (stored
      points first), e.g. ``paged.viz.sweep.SweepView.add``; ``progress``: a tqdm bar.

    Every point's keys are checked against the study's (``Study.check_keys``) before any runs.
    ``on_error="raise"``: a point that failed raises ``SweepPointError`` (after the others
    finished and were stored) instead of being a ``status="error"`` row.

    Interrupting (Ctrl-C, or an exception from ``on_result``) cancels the points in flight; the
    finished ones are stored, so the same call resumes."""
    s = get_study(study, num_cpus=num_cpus, num_gpus=num_gpus)
    points = expand(grid)
    if not points:
        raise ConfigError("the grid has no points")
    if on_error not in ("row", "raise"):
        raise ConfigError(f"on_error must be 'row' or 'raise', got {on_error!r}")
    s.check_keys(points)
    runner = _backend(backend, jobs, address, max_retries, ray_init)
    ps: PointStore | None = None
    if store is not False:
        root = default_store_dir() if store is None or store is True else Path(store)
        ps = PointStore(root, s, version)
    keys = [ps.key(p) if ps is not None else point_id(p) for p in points]

    t0 = time.perf_counter()
    results: list[Rows | None] = [None] * len(points)
    if ps is not None and not force:
        stored = ps.keys()
        for i, k in enumerate(keys):
            if k in stored:
                rows = ps.load(k)
                if rows and not (retry_errors and rows[0].get("status") == "error"):
                    results[i] = rows
    todo = [(i, points[i]) for i, r in enumerate(results) if r is None]

    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(points), initial=len(points) - len(todo), unit="pt", desc=s.name, leave=False)
    try:
        if on_result is not None:
            for r in filter(None, results):
                on_result(r)
        for i, rows in runner.run(s, todo):
            for r in rows:
                r["point"] = keys[i] if ps is not None else None
            rows = normalize(rows)
            if ps is not None and rows[0]["status"] != "lost":
                ps.save(keys[i], rows, points[i])
            results[i] = rows
            if bar is not None:
                bar.update(1)
                if rows[0]["status"] != "ok":
                    bar.set_postfix_str(f"{sum(1 for x in results if x and x[0]['status'] != 'ok')} failed")
            if on_result is not None:
                on_result(rows)
    finally:
        if bar is not None:
            bar.close()

    df = _frame([r for rows in results for r in rows])  # type: ignore[union-attr]
    status = [rows[0]["status"] for rows in results]  # type: ignore[index]
    df.attrs["sweep"] = {
        "study": s.name, "backend": runner.name, "points": len(points), "computed": len(todo),
        "cached": len(points) - len(todo), "errors": status.count("error"),
        "lost": status.count("lost"), "seconds": time.perf_counter() - t0,
        "store": str(ps.folder) if ps is not None else None, "version": ps.version if ps is not None else None}
    if on_error == "raise" and (failed := [(i, rows[0]) for i, rows in enumerate(results)  # type: ignore[index]
                                           if rows[0]["status"] != "ok"]):
        i, row = failed[0]
        raise SweepPointError(f"{len(failed)} of {len(points)} point(s) of study {s.name!r} failed; the first, "
                              f"point {i} {points[i]}: {row.get('error') or row['status']}")
    return df


def load(study: "str | Study", store: "str | os.PathLike | None" = None) -> pd.DataFrame:
    """Every point stored for ``study`` (any grid, any version), as ``sweep`` would return them."""
    s = get_study(study)
    folder = (default_store_dir() if store is None else Path(store)) / s.name
    if not folder.is_dir():
        raise ConfigError(f"no stored points for study {s.name!r} in {folder}; run paged.sweep first "
                          f"or pass the store folder it used")
    return _frame([r for p in sorted(folder.glob("*.parquet")) for r in read_rows(p)])


__all__ = ["sweep", "load", "default_store_dir"]
