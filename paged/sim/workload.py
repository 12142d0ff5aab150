"""Request traces: seeded synthetic generators (length presets, arrival processes, shared prefixes).

Reading, checking and writing trace files is ``paged.sim.trace_files`` (its names are importable
from here too). A trace is a pandas DataFrame sorted by ``arrival_time`` with columns (see ``TRACE_COLUMNS``):

- ``arrival_time`` (float seconds from the start, >= 0),
- ``prompt_tokens`` (int >= 1, includes any shared prefix), ``output_tokens`` (int >= 1),
- ``prefix_id`` (int, -1 = none): requests with the same id share their first ``prefix_tokens``
  prompt tokens (a system prompt or an earlier turn of a session),
- optionally ``priority`` (int, lower is served first under ``policy="priority"``),
- optionally ``block_hashes`` (the ids of the prompt's content blocks of
  ``attrs["content_block_size"]`` tokens, as in Mooncake's traces): equal ids mean equal prompt
  tokens, see ``paged.sim.content_blocks``.

Length presets are lognormals clipped to ``[lo, hi]`` whose location is solved so that the
*clipped* mean equals a published mean:

- ShareGPT 161.31 / 337.99 and Alpaca 19.31 / 58.45 input / output tokens (vLLM paper, Kwon et
  al. SOSP 2023, section 6.1);
- Azure LLM inference trace 2023 (CC-BY): conversation input mean/median 1155/1020, output
  211/129; code input 2048/1469, output 28/13. The spread ``sigma`` is chosen from mean/median
  (``sigma = sqrt(2 ln(mean/median))``), so the Azure medians are matched approximately too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist
from typing import Iterable

import numpy as np
import pandas as pd

from paged.errors import ConfigError
from paged.sim.content_blocks import BLOCK_COLUMN, content_block_size, cut_blocks
from paged.sim.trace_files import TRACE_COLUMNS, TraceFormatError, load_trace, normalize_trace, save_trace

# ---- Length distributions ----------------------------------------------------------------------


@lru_cache(maxsize=256)
def _solve_mu(mean: float, sigma: float, lo: int, hi: int) -> float:
    """Location ``mu`` such that E[clip(round(exp(mu + sigma Z)), lo, hi)] == mean."""
    if not lo <= mean <= hi:
        raise ConfigError(f"mean {mean} outside clip range [{lo}, {hi}]")
    z = _normal_quantile_grid()
    a, b = math.log(max(lo, 0.5)) - 6 * sigma, math.log(hi) + 6 * sigma
    for _ in range(60):
        m = 0.5 * (a + b)
        if float(np.clip(np.rint(np.exp(m + sigma * z)), lo, hi).mean()) < mean:
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
        return np.clip(np.rint(rng.lognormal(self.mu, self.sigma, n)), self.lo, self.hi).astype(np.int64)


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


# ---- Arrivals ----------------------------------------------------------------------------------


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


# ---- Synthetic traces --------------------------------------------------------------------------


def synthetic_trace(workload: str | WorkloadSpec = "sharegpt", num_requests: int = 1000, rate: float = math.inf,
                    arrival: str = "poisson", cv: float = 2.0, trace_seed: int = 0, max_model_len: int | None = None,
                    num_prefixes: int = 0, prefix_tokens: int = 0, prefix_fraction: float = 1.0,
                    prefix_zipf: float = 0.0) -> pd.DataFrame:
    """A trace of ``num_requests`` requests with lengths from ``workload``, the same for the same
    ``trace_seed``.

    With ``max_model_len`` the prompt is cut to ``max_model_len - 1`` and the output to what is
    left, so every request fits. With ``num_prefixes > 0`` a ``prefix_fraction`` of requests get a
    shared prefix of ``prefix_tokens`` tokens prepended: tenant popularity ``prefix_zipf`` (see
    ``with_shared_prefix``; 0: uniform).
    """
    spec = workload if isinstance(workload, WorkloadSpec) else get_workload(workload)
    rng = np.random.default_rng(trace_seed)
    prompt = spec.prompt.sample(rng, num_requests)
    output = spec.output.sample(rng, num_requests)
    t = arrival_times(num_requests, rate, arrival, cv, rng)
    df = pd.DataFrame({"arrival_time": t, "prompt_tokens": prompt, "output_tokens": output,
                       "prefix_id": np.full(num_requests, -1, dtype=np.int64),
                       "prefix_tokens": np.zeros(num_requests, dtype=np.int64)})
    if num_prefixes > 0 and prefix_tokens > 0:
        df = with_shared_prefix(df, num_prefixes, prefix_tokens, prefix_fraction, prefix_zipf=prefix_zipf,
                                trace_seed=trace_seed + 1)
    elif prefix_zipf:
        raise ConfigError(f"prefix_zipf={prefix_zipf} needs shared prefixes: give num_prefixes >= 1 and "
                          "prefix_tokens >= 1")
    if max_model_len is not None:
        df = fit_to_context(df, max_model_len)
    df.attrs["workload"] = spec.name
    return df


def with_shared_prefix(df: pd.DataFrame, num_prefixes: int, prefix_tokens: int, prefix_fraction: float = 1.0,
                       prefix_zipf: float = 0.0, trace_seed: int = 0) -> pd.DataFrame:
    """Prepend one of ``num_prefixes`` shared prefixes of ``prefix_tokens`` to a ``prefix_fraction``
    of requests. Tenant popularity: prefix ``i`` (0-based) is drawn with probability proportional
    to ``1 / (i + 1) ** prefix_zipf`` (a Zipf law; 0: uniform, 1: the classic 1/rank)."""
    if not 0 <= prefix_fraction <= 1:
        raise ConfigError(f"prefix_fraction must be in [0, 1], got {prefix_fraction}")
    if not (isinstance(prefix_zipf, (int, float)) and not isinstance(prefix_zipf, bool) and 0 <= prefix_zipf < 1e3):
        raise ConfigError(f"prefix_zipf must be a number >= 0 (0: uniform tenants, 1: popularity ~ 1/rank), "
                          f"got {prefix_zipf!r}")
    if num_prefixes < 1:
        raise ConfigError(f"num_prefixes must be >= 1 to share prefixes, got {num_prefixes}")
    rng = np.random.default_rng(trace_seed)
    df = df.copy()
    n = len(df)
    has = rng.random(n) < prefix_fraction
    ids = (rng.choice(num_prefixes, size=n, p=tenant_weights(num_prefixes, prefix_zipf)) if prefix_zipf
           else rng.integers(0, num_prefixes, n))
    df["prefix_id"] = np.where(has, ids, -1).astype(np.int64)
    df["prefix_tokens"] = np.where(has, prefix_tokens, 0).astype(np.int64)
    df["prompt_tokens"] = (df["prompt_tokens"].to_numpy() + df["prefix_tokens"].to_numpy()).astype(np.int64)
    return df


def tenant_weights(num_prefixes: int, prefix_zipf: float) -> np.ndarray:
    """The probability of each of ``num_prefixes`` tenants (shared prefixes) under Zipf popularity:
    proportional to ``1 / rank ** prefix_zipf`` (0: uniform); sums to 1."""
    w = 1.0 / np.arange(1, num_prefixes + 1) ** float(prefix_zipf)
    return w / w.sum()


def fit_to_context(df: pd.DataFrame, max_model_len: int) -> pd.DataFrame:
    """Cut prompts to ``max_model_len - 1`` and outputs so ``prompt + output <= max_model_len``
    (content blocks are cut with their prompt)."""
    df = df.copy()
    p = np.minimum(df["prompt_tokens"].to_numpy(), max_model_len - 1)
    df["prompt_tokens"] = p
    df["output_tokens"] = np.minimum(df["output_tokens"].to_numpy(), max_model_len - p)
    df["prefix_tokens"] = np.minimum(df["prefix_tokens"].to_numpy(), p - 1)
    if BLOCK_COLUMN in df.columns:
        bs = content_block_size(df)
        cut = np.empty(len(df), dtype=object)
        cut[:] = [cut_blocks(ids, int(n), bs) for ids, n in zip(df[BLOCK_COLUMN], p)]
        df[BLOCK_COLUMN] = cut
    return df


def concat_traces(traces: Iterable[pd.DataFrame]) -> pd.DataFrame:
    """Merge traces by arrival time (prefix ids are kept apart by offsetting them; traces with
    content blocks are refused: their ids would have to be renumbered apart)."""
    parts, off = [], 0
    for tr in traces:
        tr = normalize_trace(tr)
        if BLOCK_COLUMN in tr.columns:
            raise ConfigError("concat_traces does not merge traces with content blocks (block_hashes); "
                              "merge their rows yourself, keeping their block ids apart")
        pid = tr["prefix_id"].to_numpy()
        tr = tr.assign(prefix_id=np.where(pid >= 0, pid + off, -1))
        off += int(pid.max()) + 1 if (pid >= 0).any() else 0
        parts.append(tr)
    out = pd.concat(parts, ignore_index=True)
    return out.sort_values("arrival_time", kind="stable").reset_index(drop=True)


__all__ = ["TRACE_COLUMNS", "TraceFormatError", "LengthDist", "WorkloadSpec", "WORKLOADS", "get_workload",
           "arrival_times", "synthetic_trace", "tenant_weights", "with_shared_prefix", "fit_to_context", "concat_traces",
           "normalize_trace", "load_trace", "save_trace"]
