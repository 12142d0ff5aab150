"""Trace files: the trace format's checks, loaders for common trace files, and the writer.

A trace is the DataFrame described in ``paged.sim.workload`` (columns ``TRACE_COLUMNS``, sorted by
``arrival_time``), optionally with content blocks (``paged.sim.content_blocks``).
``normalize_trace`` checks one and returns a sorted copy; ``load_trace`` reads ``paged``, ``vidur``
and ``azure`` CSV files, LLMServingSim-style JSONL and Mooncake JSONL (with ``hash_ids``), plain or
gzipped, telling them apart by content; ``save_trace`` writes ``paged`` CSV. Every error is a
``TraceFormatError`` naming the file's row and column.
"""
from __future__ import annotations

import gzip
import io
import json
import math
import os
from pathlib import Path

import numpy as np
import pandas as pd

from paged.errors import ConfigError, PagedError
from paged.sim.content_blocks import BLOCK_COLUMN, BLOCK_SIZE_ATTR, check_block_column

__all__ = ["TRACE_COLUMNS", "TraceFormatError", "normalize_trace", "load_trace", "save_trace", "MOONCAKE_DIR",
           "mooncake_trace"]

MOONCAKE_DIR = Path(__file__).resolve().parents[2] / "data" / "traces" / "mooncake"

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
    out = pd.DataFrame({
        "arrival_time": _numeric(df, "arrival_time", src, row_offset, False, 0.0, names, below=MAX_ARRIVAL_S),
        "prompt_tokens": _numeric(df, "prompt_tokens", src, row_offset, True, 1, names).astype(np.int64),
        "output_tokens": _numeric(df, "output_tokens", src, row_offset, True, 1, names).astype(np.int64),
    })
    for col, absent in (("prefix_id", -1), ("prefix_tokens", 0)):  # optional; absent: every row at the minimum
        out[col] = (_numeric(df, col, src, row_offset, True, absent).astype(np.int64) if col in df.columns
                    else np.int64(absent))
    if "priority" in df.columns:  # optional, for policy="priority" (lower = served first)
        out["priority"] = _numeric(df, "priority", src, row_offset, True, -(2**62)).astype(np.int64)
    bad = (out["prefix_tokens"] >= out["prompt_tokens"]) | ((out["prefix_id"] >= 0) != (out["prefix_tokens"] > 0))
    if bad.any():
        i = int(np.flatnonzero(bad.to_numpy())[0])
        raise TraceFormatError(f"{src}: row {_row(i, row_offset)}, column 'prefix_tokens': need 0 < prefix_tokens < "
                               f"prompt_tokens when prefix_id >= 0 (and 0 otherwise)")
    if BLOCK_COLUMN in df.columns:  # content blocks (paged.sim.content_blocks), checked row by row
        rows = [_row(i, row_offset) for i in range(len(df))]
        col = check_block_column(list(df[BLOCK_COLUMN]), out["prompt_tokens"].to_numpy(),
                                 df.attrs.get(BLOCK_SIZE_ATTR), out["prefix_id"].to_numpy(), src, rows,
                                 (names or {}).get(BLOCK_COLUMN, BLOCK_COLUMN), TraceFormatError)
        holder = np.empty(len(col), dtype=object)
        holder[:] = col
        out[BLOCK_COLUMN] = holder
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

    Formats: ``paged`` CSV (``TRACE_COLUMNS``, optionally ``block_hashes`` as space-separated ids
    with a ``content_block_size`` column), ``vidur`` CSV (``arrived_at,num_prefill_tokens,
    num_decode_tokens``), ``azure`` CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``, the Azure LLM
    inference traces 2023 and 2024; times become seconds after the first request), ``jsonl``
    (LLMServingSim's ``input_toks,output_toks,arrival_time_ns``) and ``mooncake`` JSONL
    (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids`` of 512-token blocks).
    ``auto`` tells them apart by content (gzip or not, JSON or CSV, then the header or the first
    object's keys). Rows are numbered as in the file (header = row 1 for CSV, first line = row 1
    for JSONL).
    """
    path = os.fspath(path)
    src = os.path.basename(path)
    if not os.path.exists(path):
        raise TraceFormatError(f"trace file {path!r} does not exist")
    if os.path.isdir(path):
        raise TraceFormatError(f"trace {path!r} is a directory; give a trace file (CSV or JSONL)")
    text = _read_text(path, src)
    jsonl = fmt in ("jsonl", "mooncake") or (fmt == "auto" and text.lstrip()[:1] in ("{", "["))
    out = (_load_jsonl if jsonl else _load_csv)(text, src, fmt)
    out.attrs["source"] = path
    return out


def _read_text(path: str, src: str) -> str:
    """The file's text, gunzipped when it starts with gzip's magic bytes."""
    data = Path(path).read_bytes()
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as exc:
            raise TraceFormatError(f"{src}: a damaged gzip file ({exc})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TraceFormatError(f"{src}: not UTF-8 text ({exc}); give a CSV or JSONL trace") from None


def _load_csv(text: str, src: str, fmt: str) -> pd.DataFrame:
    try:
        raw = pd.read_csv(io.StringIO(text), dtype=str, keep_default_na=False, skipinitialspace=True)
    except pd.errors.EmptyDataError:
        raise TraceFormatError(f"{src}: the file is empty; a trace needs a header and at least one request") from None
    except pd.errors.ParserError as exc:
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
                                   + "; ".join(",".join(c) for c in _CSV_FORMATS.values())
                                   + "; or JSONL (LLMServingSim or Mooncake)")
    if fmt not in _CSV_FORMATS:
        raise ConfigError(f"unknown trace format {fmt!r}; choose auto, jsonl, mooncake or one of "
                          f"{sorted(_CSV_FORMATS)}")
    cols = _CSV_FORMATS[fmt]
    missing = [c for c in cols if c not in raw.columns]
    if missing:
        raise TraceFormatError(f"{src}: missing column(s) {missing} for format {fmt!r}")
    df = raw.rename(columns=cols)
    lines = _csv_line_numbers(text, len(raw))
    if fmt == "azure":
        ts = pd.to_datetime(df["arrival_time"], errors="coerce", format="mixed", utc=True)
        if ts.isna().any():
            i = int(np.flatnonzero(ts.isna().to_numpy())[0])
            raise TraceFormatError(f"{src}: row {_row(i, lines)}, column 'TIMESTAMP': cannot parse "
                                   f"{raw['TIMESTAMP'].iloc[i]!r} as a date-time")
        df["arrival_time"] = (ts - ts.min()).dt.total_seconds()
    if fmt == "paged" and BLOCK_COLUMN in raw.columns:
        df = _csv_blocks(df, src, lines)
    return normalize_trace(df, src, row_offset=lines, names={v: k for k, v in cols.items()})


def _csv_blocks(df: pd.DataFrame, src: str, lines: np.ndarray | int) -> pd.DataFrame:
    """``block_hashes`` cells (space-separated ids) as id lists, and the one ``content_block_size``."""
    if BLOCK_SIZE_ATTR not in df.columns:
        raise TraceFormatError(f"{src}: column {BLOCK_COLUMN!r} needs a {BLOCK_SIZE_ATTR!r} column (tokens per block)")
    sizes = df[BLOCK_SIZE_ATTR].unique()
    if len(sizes) != 1 or not sizes[0].isdigit() or int(sizes[0]) < 1:
        i = int(np.flatnonzero((df[BLOCK_SIZE_ATTR] != sizes[0]).to_numpy())[0]) if len(sizes) > 1 else 0
        raise TraceFormatError(f"{src}: row {_row(i, lines)}, column {BLOCK_SIZE_ATTR!r}: need one integer >= 1 "
                               f"on every row, got {sorted(sizes)[:3]}")
    ids = []
    for i, cell in enumerate(df[BLOCK_COLUMN]):
        parts = cell.split()
        if not all(p.isdigit() for p in parts):
            raise TraceFormatError(f"{src}: row {_row(i, lines)}, column {BLOCK_COLUMN!r}: got {cell[:40]!r}, need "
                                   f"space-separated integer block ids >= 0")
        ids.append([int(p) for p in parts])
    df = df.drop(columns=[BLOCK_SIZE_ATTR]).assign(**{BLOCK_COLUMN: ids})
    df.attrs[BLOCK_SIZE_ATTR] = int(sizes[0])
    return df


def _csv_line_numbers(text: str, num_rows: int) -> np.ndarray | int:
    """File line number of each data row. pandas skips blank lines, so position + 2 would name the
    wrong line after one; falls back to that offset if the count disagrees (quoted newlines)."""
    nums = [k for k, line in enumerate(text.splitlines(), 1) if line.strip()][1:]  # [1:]: the header
    return np.asarray(nums, dtype=np.int64) if len(nums) == num_rows else 2


# JSONL schemas: (key, our column, minimum, integer, scale to our unit)
_JSONL_FORMATS = {
    "jsonl": (("arrival_time_ns", "arrival_time", 0.0, False, 1e-9), ("input_toks", "prompt_tokens", 1, True, 1),
              ("output_toks", "output_tokens", 1, True, 1)),
    "mooncake": (("timestamp", "arrival_time", 0.0, False, 1e-3), ("input_length", "prompt_tokens", 1, True, 1),
                 ("output_length", "output_tokens", 1, True, 1)),
}
MOONCAKE_BLOCK_SIZE = 512  # tokens per hash id in Mooncake's FAST'25 traces (their README)


def _load_jsonl(text: str, src: str, fmt: str) -> pd.DataFrame:
    cols: tuple | None = _JSONL_FORMATS.get(fmt)
    rows: list[tuple[float, int, int]] = []
    blocks: list[object] = []
    linenos: list[int] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"{src}: row {lineno}: invalid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise TraceFormatError(f"{src}: row {lineno}: expected a JSON object")
        if cols is None:  # auto: the first object's keys name the schema
            fmt = "mooncake" if "hash_ids" in obj or "input_length" in obj else "jsonl"
            cols = _JSONL_FORMATS[fmt]
        vals = []
        for key, _, minimum, integer, scale in cols:
            v = obj.get(key, 0 if minimum == 0.0 else None)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= minimum
            if not ok or (integer and (v != int(v) or v >= INT64_LIMIT)):
                need = f"an integer >= {minimum} and < 2**63" if integer else "a number >= 0"
                raise TraceFormatError(f"{src}: row {lineno}, column {key!r}: got {v!r}, need {need}")
            vals.append(v * scale if not integer else int(v))
        rows.append(tuple(vals))
        linenos.append(lineno)
        if fmt == "mooncake":
            if "hash_ids" not in obj:
                raise TraceFormatError(f"{src}: row {lineno}: missing 'hash_ids' (Mooncake rows name their "
                                       f"{MOONCAKE_BLOCK_SIZE}-token blocks)")
            blocks.append(obj["hash_ids"])
    if not rows:
        raise TraceFormatError(f"{src}: no requests")
    df = pd.DataFrame(rows, columns=["arrival_time", "prompt_tokens", "output_tokens"])
    names = {c[1]: c[0] for c in cols}
    if fmt == "mooncake":
        df[BLOCK_COLUMN] = blocks
        df.attrs[BLOCK_SIZE_ATTR] = MOONCAKE_BLOCK_SIZE
        names[BLOCK_COLUMN] = "hash_ids"
    df.attrs["format"] = fmt
    return normalize_trace(df, src, row_offset=np.asarray(linenos, dtype=np.int64), names=names)


def save_trace(df: pd.DataFrame, path: str | os.PathLike) -> None:
    """Write a trace as ``paged`` CSV (``TRACE_COLUMNS``; content blocks as space-separated ids
    beside a ``content_block_size`` column)."""
    tr = normalize_trace(df)
    if BLOCK_COLUMN in tr.columns:
        tr = tr.assign(**{BLOCK_COLUMN: [" ".join(map(str, ids.tolist())) for ids in tr[BLOCK_COLUMN]],
                          BLOCK_SIZE_ATTR: int(tr.attrs[BLOCK_SIZE_ATTR])})
    tr.to_csv(path, index=False, float_format="%.6f")


def mooncake_trace(name: str, num_requests: int | None = None) -> pd.DataFrame:
    """A Mooncake trace by name (``conversation``, ``synthetic``; ``toolagent`` if its file was put
    in ``data/traces/mooncake``) or by path, cut to its first ``num_requests`` rows."""
    path = Path(name)
    if not path.exists():
        found = sorted(MOONCAKE_DIR.glob(f"{name}_trace.jsonl*"))
        if not found:
            have = sorted(p.name.split("_trace")[0] for p in MOONCAKE_DIR.glob("*_trace.jsonl*"))
            raise ConfigError(f"no Mooncake trace {name!r} in {MOONCAKE_DIR}; have {have} (toolagent_trace.jsonl is "
                              f"stored apart by Mooncake: put it there), or give a file path")
        path = found[0]
    tr = load_trace(path)
    return tr.iloc[:num_requests] if num_requests else tr
