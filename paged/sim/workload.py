"""Request traces: seeded synthetic generators and loaders for common trace files.

A trace is a pandas DataFrame sorted by ``arrival_time`` with columns (see ``TRACE_COLUMNS``):

- ``arrival_time`` (float seconds from the start, >= 0),
- ``prompt_tokens`` (int >= 1, includes any shared prefix), ``output_tokens`` (int >= 1),
- ``prefix_id`` (int, -1 = none): requests with the same id share their first ``prefix_tokens``
  prompt tokens (a system prompt or an earlier turn of a session),
- optionally ``priority`` (int, lower is served first under ``policy="priority"``).

Length presets are lognormals clipped to ``[lo, hi]`` whose location is solved so that the
*clipped* mean equals a published mean:

- ShareGPT 161.31 / 337.99 and Alpaca 19.31 / 58.45 input / output tokens (vLLM paper, Kwon et
  al. SOSP 2023, section 6.1);
- Azure LLM inference trace 2023 (CC-BY): conversation input mean/median 1155/1020, output
  211/129; code input 2048/1469, output 28/13. The spread ``sigma`` is chosen from mean/median
  (``sigma = sqrt(2 ln(mean/median))``), so the Azure medians are matched approximately too.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist
from typing import Iterable

import numpy as np
import pandas as pd

from paged.errors import ConfigError, PagedError

TRACE_COLUMNS = ["arrival_time", "prompt_tokens", "output_tokens", "prefix_id", "prefix_tokens"]


class TraceFormatError(PagedError, ValueError):
    """A trace file or DataFrame has a malformed row; the message names the row and column."""


# ----------------------------------------------------------------------------------------------
# Length distributions
# ----------------------------------------------------------------------------------------------


@lru_cache(maxsize=256)
def _solve_mu(mean: float, sigma: float, lo: int, hi: int) -> float:
    """Location ``mu`` such that E[clip(round(exp(mu + sigma Z)), lo, hi)] == mean."""
    if not lo <= mean <= hi:
        raise ConfigError(f"mean {mean} outside clip range [{lo}, {hi}]")
    z = _normal_quantile_grid()

    def clipped_mean(mu: float) -> float:
        return float(np.clip(np.rint(np.exp(mu + sigma * z)), lo, hi).mean())

    a, b = math.log(max(lo, 0.5)) - 6 * sigma, math.log(hi) + 6 * sigma
    for _ in range(60):
        m = 0.5 * (a + b)
        if clipped_mean(m) < mean:
            a = m
        else:
            b = m
    return 0.5 * (a + b)


@lru_cache(maxsize=1)
def _normal_quantile_grid(n: int = 20000) -> np.ndarray:
    """Standard normal quantiles at the midpoints of ``n`` equal-probability bins."""
    nd = NormalDist()
    return np.array([nd.inv_cdf((i + 0.5) / n) for i in range(n)])


@dataclass(frozen=True, slots=True)
class LengthDist:
    """Lognormal token count with spread ``sigma``, clipped to ``[lo, hi]``, with clipped mean ``mean``."""

    mean: float
    sigma: float
    lo: int = 1
    hi: int = 4096

    @property
    def mu(self) -> float:
        return _solve_mu(float(self.mean), float(self.sigma), int(self.lo), int(self.hi))

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        x = np.rint(rng.lognormal(self.mu, self.sigma, n))
        return np.clip(x, self.lo, self.hi).astype(np.int64)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    name: str
    prompt: LengthDist
    output: LengthDist
    source: str


def _sigma(mean: float, median: float) -> float:
    return math.sqrt(2 * math.log(mean / median))


WORKLOADS: dict[str, WorkloadSpec] = {
    w.name: w
    for w in (
        WorkloadSpec("sharegpt", LengthDist(161.31, 1.1, 4, 1024), LengthDist(337.99, 1.0, 4, 1024),
                     "vLLM paper (SOSP'23) ShareGPT means 161.31/337.99"),
        WorkloadSpec("alpaca", LengthDist(19.31, 0.5, 4, 256), LengthDist(58.45, 0.8, 4, 512),
                     "vLLM paper (SOSP'23) Alpaca means 19.31/58.45"),
        WorkloadSpec("azure-conv", LengthDist(1155, _sigma(1155, 1020), 1, 8192),
                     LengthDist(211, _sigma(211, 129), 1, 2048),
                     "Azure LLM inference trace 2023, conversation: 1155/1020 in, 211/129 out (mean/median)"),
        WorkloadSpec("azure-code", LengthDist(2048, _sigma(2048, 1469), 1, 8192),
                     LengthDist(28, _sigma(28, 13), 1, 1024),
                     "Azure LLM inference trace 2023, code: 2048/1469 in, 28/13 out (mean/median)"),
    )
}


def get_workload(name: str) -> WorkloadSpec:
    key = name.lower().replace("_", "-")
    if key not in WORKLOADS:
        raise ConfigError(f"unknown workload {name!r}; choose one of {sorted(WORKLOADS)} or pass --trace FILE")
    return WORKLOADS[key]


# ----------------------------------------------------------------------------------------------
# Arrivals
# ----------------------------------------------------------------------------------------------


def arrival_times(n: int, rate: float, process: str = "poisson", cv: float = 2.0,
                  rng: np.random.Generator | None = None) -> np.ndarray:
    """``n`` arrival times (seconds, starting at the first gap) at mean ``rate`` requests/s.

    ``poisson``: exponential gaps; ``gamma``: Gamma gaps with coefficient of variation ``cv``
    (cv > 1 is bursty, as BurstGPT observes); ``fixed``: evenly spaced. ``rate = inf`` puts every
    request at t = 0 (an offline batch: throughput at saturation).
    """
    rng = rng or np.random.default_rng(0)
    if n < 0:
        raise ConfigError(f"number of requests must be >= 0, got {n}")
    if rate <= 0:
        raise ConfigError(f"rate must be > 0 requests/s (inf for all at once), got {rate}")
    if math.isinf(rate):
        return np.zeros(n)
    if process == "poisson":
        gaps = rng.exponential(1.0 / rate, n)
    elif process == "gamma":
        if cv <= 0:
            raise ConfigError(f"gamma arrivals need cv > 0, got {cv}")
        k = 1.0 / cv**2
        gaps = rng.gamma(k, 1.0 / (rate * k), n)
    elif process == "fixed":
        gaps = np.full(n, 1.0 / rate)
    else:
        raise ConfigError(f"unknown arrival process {process!r}; choose poisson, gamma or fixed")
    return np.cumsum(gaps)


# ----------------------------------------------------------------------------------------------
# Synthetic traces
# ----------------------------------------------------------------------------------------------


def synthetic_trace(workload: str | WorkloadSpec = "sharegpt", num_requests: int = 1000, rate: float = math.inf,
                    arrival: str = "poisson", cv: float = 2.0, seed: int = 0, max_model_len: int | None = None,
                    num_prefixes: int = 0, prefix_tokens: int = 0, prefix_fraction: float = 1.0) -> pd.DataFrame:
    """A seeded trace of ``num_requests`` requests with lengths from ``workload``.

    With ``max_model_len`` the prompt is cut to ``max_model_len - 1`` and the output to what is
    left, so every request fits. With ``num_prefixes > 0`` a ``prefix_fraction`` of requests get a
    shared prefix of ``prefix_tokens`` tokens prepended (ids drawn uniformly among the prefixes).
    """
    spec = workload if isinstance(workload, WorkloadSpec) else get_workload(workload)
    rng = np.random.default_rng(seed)
    prompt = spec.prompt.sample(rng, num_requests)
    output = spec.output.sample(rng, num_requests)
    t = arrival_times(num_requests, rate, arrival, cv, rng)
    df = pd.DataFrame({"arrival_time": t, "prompt_tokens": prompt, "output_tokens": output,
                       "prefix_id": np.full(num_requests, -1, dtype=np.int64),
                       "prefix_tokens": np.zeros(num_requests, dtype=np.int64)})
    if num_prefixes > 0 and prefix_tokens > 0:
        df = with_shared_prefix(df, num_prefixes, prefix_tokens, prefix_fraction, seed=seed + 1)
    if max_model_len is not None:
        df = fit_to_context(df, max_model_len)
    df.attrs["workload"] = spec.name
    return df


def with_shared_prefix(df: pd.DataFrame, num_prefixes: int, prefix_tokens: int, fraction: float = 1.0,
                       seed: int = 0) -> pd.DataFrame:
    """Prepend one of ``num_prefixes`` shared prefixes of ``prefix_tokens`` to a ``fraction`` of requests."""
    if not 0 <= fraction <= 1:
        raise ConfigError(f"prefix fraction must be in [0, 1], got {fraction}")
    rng = np.random.default_rng(seed)
    df = df.copy()
    n = len(df)
    has = rng.random(n) < fraction
    ids = rng.integers(0, num_prefixes, n)
    df["prefix_id"] = np.where(has, ids, -1).astype(np.int64)
    df["prefix_tokens"] = np.where(has, prefix_tokens, 0).astype(np.int64)
    df["prompt_tokens"] = (df["prompt_tokens"].to_numpy() + df["prefix_tokens"].to_numpy()).astype(np.int64)
    return df


def fit_to_context(df: pd.DataFrame, max_model_len: int) -> pd.DataFrame:
    """Cut prompts to ``max_model_len - 1`` and outputs so ``prompt + output <= max_model_len``."""
    df = df.copy()
    p = np.minimum(df["prompt_tokens"].to_numpy(), max_model_len - 1)
    df["prompt_tokens"] = p
    df["output_tokens"] = np.minimum(df["output_tokens"].to_numpy(), max_model_len - p)
    df["prefix_tokens"] = np.minimum(df["prefix_tokens"].to_numpy(), p - 1)
    return df


def concat_traces(traces: Iterable[pd.DataFrame]) -> pd.DataFrame:
    """Merge traces by arrival time (prefix ids are kept apart by offsetting them)."""
    parts, off = [], 0
    for tr in traces:
        tr = normalize_trace(tr)
        pid = tr["prefix_id"].to_numpy()
        tr = tr.assign(prefix_id=np.where(pid >= 0, pid + off, -1))
        off += int(pid.max()) + 1 if (pid >= 0).any() else 0
        parts.append(tr)
    out = pd.concat(parts, ignore_index=True)
    return out.sort_values("arrival_time", kind="stable").reset_index(drop=True)


# ----------------------------------------------------------------------------------------------
# Validation and loading
# ----------------------------------------------------------------------------------------------


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


__all__ = ["TRACE_COLUMNS", "TraceFormatError", "LengthDist", "WorkloadSpec", "WORKLOADS", "get_workload",
           "arrival_times", "synthetic_trace", "with_shared_prefix", "fit_to_context", "concat_traces",
           "normalize_trace", "load_trace", "save_trace"]
