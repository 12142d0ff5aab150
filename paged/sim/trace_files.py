"""Trace files: the trace format's checks, loaders for common trace files, and the writer.

A trace is the DataFrame described in ``paged.sim.workload`` (columns ``TRACE_COLUMNS``, sorted by
``arrival_time``). ``normalize_trace`` checks one and returns a sorted copy; ``load_trace`` reads
``paged``, ``vidur`` and ``azure`` CSV files and LLMServingSim-style JSONL; ``save_trace`` writes
``paged`` CSV. Every error is a ``TraceFormatError`` naming the file's row and column.
"""
from __future__ import annotations

import json
import math
import os

import numpy as np
import pandas as pd

from paged.errors import ConfigError, PagedError

__all__ = ["TRACE_COLUMNS", "TraceFormatError", "normalize_trace", "load_trace", "save_trace"]

TRACE_COLUMNS = ["arrival_time", "prompt_tokens", "output_tokens", "prefix_id", "prefix_tokens"]


class TraceFormatError(PagedError, ValueError):
    """A trace file or DataFrame has a malformed row; the message names the row and column."""


INT64_LIMIT = 2.0 ** 63  # integer columns hold int64: values must stay below this
MAX_ARRIVAL_S = 2.0 ** 33  # ~272 years; beyond it float64 cannot resolve microsecond step times


def _numeric(df: pd.DataFrame, col: str, src: str, row_offset: int | np.ndarray, integer: bool, minimum: float,
             names: dict[str, str] | None = None, below: float | None = None) -> np.ndarray:
    raw = df[col]
    vals = pd.to_numeric(raw, errors="coerce").to_numpy(dtype=np.float64)
    bad = ~np.isfinite(vals) | (vals < minimum) | (vals >= (below or np.inf))
    if integer:
        bad |= np.isfinite(vals) & ((vals != np.floor(vals)) | (np.abs(vals) >= INT64_LIMIT))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        need = f"an integer >= {int(minimum)} and < 2**63" if integer else f"a number >= {minimum}"
        if below == MAX_ARRIVAL_S:
            need += " and < 2**33 seconds (divide nanoseconds by 1e9, or rebase times to the first request)"
        shown = (names or {}).get(col, col)
        raise TraceFormatError(f"{src}: row {_row(i, row_offset)}, column {shown!r}: got {raw.iloc[i]!r}, need {need}")
    return vals


def _row(i: int, row_offset: int | np.ndarray) -> int:
    return int(row_offset[i]) if isinstance(row_offset, np.ndarray) else i + row_offset


def normalize_trace(df: pd.DataFrame, src: str = "trace", row_offset: int | np.ndarray = 0,
                    names: dict[str, str] | None = None) -> pd.DataFrame:
    """Validate a DataFrame with ``TRACE_COLUMNS`` (prefix columns optional); return a sorted copy.

    ``row_offset`` maps DataFrame positions to the row numbers reported in errors (an int added
    to the position, or one row number per position) and ``names`` maps our column names to the
    file's.
    """
    for col in ("arrival_time", "prompt_tokens", "output_tokens"):
        if col not in df.columns:
            raise TraceFormatError(f"{src}: missing column {col!r}; have {list(df.columns)}")
    arrival = _numeric(df, "arrival_time", src, row_offset, False, 0.0, names, below=MAX_ARRIVAL_S)
    out = pd.DataFrame({
        "arrival_time": arrival,
        "prompt_tokens": _numeric(df, "prompt_tokens", src, row_offset, True, 1, names).astype(np.int64),
        "output_tokens": _numeric(df, "output_tokens", src, row_offset, True, 1, names).astype(np.int64),
    })
    if "prefix_id" in df.columns:
        out["prefix_id"] = _numeric(df, "prefix_id", src, row_offset, True, -1).astype(np.int64)
    else:
        out["prefix_id"] = np.int64(-1)
    if "prefix_tokens" in df.columns:
        out["prefix_tokens"] = _numeric(df, "prefix_tokens", src, row_offset, True, 0).astype(np.int64)
    else:
        out["prefix_tokens"] = np.int64(0)
    if "priority" in df.columns:  # optional, for policy="priority" (lower = served first)
        out["priority"] = _numeric(df, "priority", src, row_offset, True, -(2**62)).astype(np.int64)
    bad = (out["prefix_tokens"] >= out["prompt_tokens"]) | ((out["prefix_id"] >= 0) != (out["prefix_tokens"] > 0))
    if bad.any():
        i = int(np.flatnonzero(bad.to_numpy())[0])
        raise TraceFormatError(f"{src}: row {_row(i, row_offset)}, column 'prefix_tokens': need 0 < prefix_tokens < "
                               f"prompt_tokens when prefix_id >= 0 (and 0 otherwise)")
    out.attrs.update(df.attrs)
    return out.sort_values("arrival_time", kind="stable").reset_index(drop=True)


_CSV_FORMATS = {
    "paged": {"arrival_time": "arrival_time", "prompt_tokens": "prompt_tokens", "output_tokens": "output_tokens"},
    "vidur": {"arrived_at": "arrival_time", "num_prefill_tokens": "prompt_tokens",
              "num_decode_tokens": "output_tokens"},
    "azure": {"TIMESTAMP": "arrival_time", "ContextTokens": "prompt_tokens", "GeneratedTokens": "output_tokens"},
}


def load_trace(path: str | os.PathLike, fmt: str = "auto") -> pd.DataFrame:
    """Load a trace file into the normalized DataFrame.

    Formats: ``paged`` CSV (``TRACE_COLUMNS``), ``vidur`` CSV (``arrived_at,num_prefill_tokens,
    num_decode_tokens``), ``azure`` CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``; times become
    seconds after the first request), ``jsonl`` (``input_toks,output_toks,arrival_time_ns``, as in
    LLMServingSim). ``auto`` picks by extension and header. Rows are numbered as in the file
    (header = row 1 for CSV, first line = row 1 for JSONL).
    """
    path = os.fspath(path)
    src = os.path.basename(path)
    if not os.path.exists(path):
        raise TraceFormatError(f"trace file {path!r} does not exist")
    if os.path.isdir(path):
        raise TraceFormatError(f"trace {path!r} is a directory; give a trace file (CSV or JSONL)")
    if fmt == "jsonl" or (fmt == "auto" and path.endswith((".jsonl", ".json"))):
        return _load_jsonl(path, src)
    try:
        raw = pd.read_csv(path, dtype=str, keep_default_na=False, skipinitialspace=True)
    except pd.errors.EmptyDataError:
        raise TraceFormatError(f"{src}: the file is empty; a trace needs a header and at least one request") from None
    except (pd.errors.ParserError, UnicodeDecodeError) as exc:
        raise TraceFormatError(f"{src}: not a readable CSV: {exc}") from exc
    if raw.empty:
        raise TraceFormatError(f"{src}: no requests (only a header)")
    if fmt == "auto":
        fmt = next((k for k, cols in _CSV_FORMATS.items() if set(cols) <= set(raw.columns)), "")
        near = max(_CSV_FORMATS, key=lambda k: len(set(_CSV_FORMATS[k]) & set(raw.columns)))
        if not fmt and set(_CSV_FORMATS[near]) & set(raw.columns):  # one format, some columns missing
            missing = [c for c in _CSV_FORMATS[near] if c not in raw.columns]
            raise TraceFormatError(f"{src}: missing column(s) {', '.join(missing)} of the {near!r} trace format "
                                   f"(columns {', '.join(_CSV_FORMATS[near])}); add them to the header")
        if not fmt:
            raise TraceFormatError(f"{src}: unknown CSV header {list(raw.columns)}; expected one of "
                                   + "; ".join(",".join(c) for c in _CSV_FORMATS.values()))
    if fmt not in _CSV_FORMATS:
        raise ConfigError(f"unknown trace format {fmt!r}; choose auto, jsonl or one of {sorted(_CSV_FORMATS)}")
    cols = _CSV_FORMATS[fmt]
    missing = [c for c in cols if c not in raw.columns]
    if missing:
        raise TraceFormatError(f"{src}: missing column(s) {missing} for format {fmt!r}")
    df = raw.rename(columns=cols)
    lines = _csv_line_numbers(path, len(raw))
    if fmt == "azure":
        ts = pd.to_datetime(df["arrival_time"], errors="coerce", format="mixed")
        if ts.isna().any():
            i = int(np.flatnonzero(ts.isna().to_numpy())[0])
            raise TraceFormatError(f"{src}: row {_row(i, lines)}, column 'TIMESTAMP': cannot parse "
                                   f"{raw['TIMESTAMP'].iloc[i]!r} as a date-time")
        df["arrival_time"] = (ts - ts.min()).dt.total_seconds()
    out = normalize_trace(df, src, row_offset=lines, names={v: k for k, v in cols.items()})
    out.attrs["source"] = path
    return out


def _csv_line_numbers(path: str, num_rows: int) -> np.ndarray | int:
    """File line number of each data row. pandas skips blank lines, so position + 2 would name the
    wrong line after one; falls back to that offset if the count disagrees (quoted newlines)."""
    with open(path, encoding="utf-8", errors="replace", newline="") as fh:
        nums = [k for k, line in enumerate(fh, 1) if line.strip()]
    nums = nums[1:]  # the header
    return np.asarray(nums, dtype=np.int64) if len(nums) == num_rows else 2


def _load_jsonl(path: str, src: str) -> pd.DataFrame:
    cols = (("arrival_time_ns", 0.0, False), ("input_toks", 1, True), ("output_toks", 1, True))
    rows: list[tuple[float, int, int]] = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceFormatError(f"{src}: row {lineno}: invalid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise TraceFormatError(f"{src}: row {lineno}: expected a JSON object")
            vals = []
            for key, minimum, integer in cols:
                v = obj.get(key, 0 if key == "arrival_time_ns" else None)
                ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= minimum
                if not ok or (integer and (v != int(v) or v >= INT64_LIMIT)):
                    need = f"an integer >= {minimum} and < 2**63" if integer else "a number >= 0"
                    raise TraceFormatError(f"{src}: row {lineno}, column {key!r}: got {v!r}, need {need}")
                vals.append(v)
            rows.append((vals[0] * 1e-9, int(vals[1]), int(vals[2])))
    if not rows:
        raise TraceFormatError(f"{src}: no requests")
    df = pd.DataFrame(rows, columns=["arrival_time", "prompt_tokens", "output_tokens"])
    out = normalize_trace(df, src)
    out.attrs["source"] = path
    return out


def save_trace(df: pd.DataFrame, path: str | os.PathLike) -> None:
    """Write a trace as ``paged`` CSV (``TRACE_COLUMNS``)."""
    normalize_trace(df).to_csv(path, index=False, float_format="%.6f")
