"""One point, run where a worker is: the study's call, timed, caught, turned into table rows.

``execute(study, params)`` never raises for a study's own exception: the point becomes one row
with ``status="error"`` and ``error="<Type>: <message>"``. Every row carries the point's
parameters, its results and the columns of ``META``; values are plain Python scalars (numpy
scalars converted), so a row reads back from the point store exactly as it was written.
"""
from __future__ import annotations

import math
import os
import socket
import sys
import time
import traceback
from typing import Any, Mapping

from .registry import Study

# Columns the sweep adds to every row (a study result with one of these names gets "result_" before it).
META = ("status", "error", "wall_s", "cpu_s", "host", "pid", "node", "backend", "cached", "point")
ROW = "row"  # a study returning a DataFrame of n rows: 0..n-1, the row's index within its point


def plain(v: Any) -> Any:
    """A value as a plain Python scalar where it is a numpy/pandas scalar; containers become lists/dicts."""
    if hasattr(v, "item") and not isinstance(v, (str, bytes)) and getattr(v, "ndim", 0) == 0:
        try:
            v = v.item()
        except (ValueError, AttributeError):
            pass
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): plain(x) for k, x in v.items()}
    if hasattr(v, "tolist") and not isinstance(v, (str, bytes)):
        return plain(v.tolist())
    return v


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return bool(plain(a) == plain(b))
    except Exception:  # noqa: BLE001 - incomparable values are different
        return False


def result_rows(result: Any) -> list[dict[str, Any]]:
    """A study's return value as rows: a dict -> one row; a DataFrame -> its rows; None -> one empty row."""
    if result is None:
        return [{}]
    if isinstance(result, Mapping):
        return [{str(k): plain(v) for k, v in result.items()}]
    to_dict = getattr(result, "to_dict", None)
    if callable(to_dict) and hasattr(result, "columns"):  # a DataFrame (pandas imported only if the study did)
        return [{str(k): plain(v) for k, v in r.items()} for r in to_dict(orient="records")] or [{}]
    raise TypeError(f"a study returns a dict or a DataFrame, got {type(result).__name__}")


def merge(params: Mapping[str, Any], results: list[dict[str, Any]], study: Study) -> list[dict[str, Any]]:
    """Rows of parameters + results. A result equal to a parameter of the same name (an echo) is
    dropped; a different one, or one named like a ``META`` column or ``row``, keeps its value as
    ``result_<name>``; ``study.drop`` columns are left out."""
    rows = []
    for i, res in enumerate(results):
        row = {k: plain(v) for k, v in params.items()}
        if len(results) > 1:
            row[ROW] = i
        for k, v in res.items():
            if k in study.drop:
                continue
            if k in params:
                if _same(v, params[k]):
                    continue
                k = f"result_{k}"
            elif k in META or k == ROW:
                k = f"result_{k}"
            row[k] = v
        rows.append(row)
    return rows


def where() -> dict[str, Any]:
    """Host, process and (under Ray) node id of this worker."""
    node = socket.gethostname()
    ray = sys.modules.get("ray")  # only if this process already runs under Ray (never imported here)
    if ray is not None and ray.is_initialized():
        node = ray.get_runtime_context().get_node_id()
    return {"host": socket.gethostname(), "pid": os.getpid(), "node": node}


def execute(study: Study, params: Mapping[str, Any], backend: str = "local") -> list[dict[str, Any]]:
    """Run one point; rows with parameters, results and ``META`` (``cached=False``, ``point`` unset)."""
    t0, c0 = time.perf_counter(), time.process_time()
    status, error = "ok", None
    try:
        rows = merge(params, result_rows(study(params)), study)
    except Exception as e:  # noqa: BLE001 - a failing point is a row with its error, not a failed sweep
        status, error = "error", f"{type(e).__name__}: {e}"
        tb = traceback.extract_tb(e.__traceback__)
        if tb and not isinstance(e, (ValueError, KeyError, TypeError)):  # unexpected: say where
            error += f" (at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno})"
        rows = [{k: plain(v) for k, v in params.items()}]
    meta = {"status": status, "error": error, "wall_s": time.perf_counter() - t0,
            "cpu_s": time.process_time() - c0, **where(), "backend": backend, "cached": False, "point": None}
    return [{**r, **meta} for r in rows]


__all__ = ["META", "ROW", "execute", "merge", "result_rows", "plain", "where"]
