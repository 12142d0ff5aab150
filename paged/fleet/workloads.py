"""Fleet workloads: shared-prefix traces in the simulator's trace format (``paged.sim.workload``).

``shared_prefix_trace``: Poisson arrivals; request i shares its first ``prefix_tokens`` tokens with
every request of the same ``prefix_id`` (a system prompt, a document, a conversation so far), the
rest is its own. ``hot_share`` of the requests use prefix 0 (a hot prefix: the case where pure
cache affinity overloads one replica); the others spread uniformly over the remaining prefixes.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from paged.errors import ConfigError


def shared_prefix_trace(num_requests: int = 400, rate: float = 20.0, num_prefixes: int = 16,
                        prompt_tokens: int = 1200, prefix_tokens: int = 1024, output_tokens: int = 64,
                        hot_share: float = 0.0, seed: int = 0) -> pd.DataFrame:
    """A trace (columns ``arrival_time, prompt_tokens, output_tokens, prefix_id, prefix_tokens``);
    output lengths uniform in [output_tokens / 2, 3 * output_tokens / 2]."""
    if not (isinstance(num_requests, int) and num_requests >= 1):
        raise ConfigError(f"num_requests must be an integer >= 1, got {num_requests!r}")
    if not rate > 0:
        raise ConfigError(f"rate must be > 0 requests per second, got {rate!r}")
    if not (isinstance(num_prefixes, int) and num_prefixes >= 1):
        raise ConfigError(f"num_prefixes must be an integer >= 1, got {num_prefixes!r}")
    if not 0 <= prefix_tokens <= prompt_tokens:
        raise ConfigError(f"prefix_tokens ({prefix_tokens}) must be in [0, prompt_tokens={prompt_tokens}]")
    if not 0.0 <= hot_share <= 1.0 or (hot_share > 0 and num_prefixes < 2 and hot_share < 1):
        raise ConfigError(f"hot_share is a fraction in [0, 1] (with num_prefixes >= 2 below 1), got {hot_share!r}")
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, num_requests))
    if hot_share > 0:
        hot = rng.random(num_requests) < hot_share
        pid = np.where(hot, 0, rng.integers(1, max(num_prefixes, 2), num_requests))
    else:
        pid = rng.integers(0, num_prefixes, num_requests)
    lo, hi = max(1, output_tokens // 2), max(1, output_tokens // 2) + output_tokens
    return pd.DataFrame({"arrival_time": arrivals - arrivals[0], "prompt_tokens": prompt_tokens,
                         "output_tokens": rng.integers(lo, hi, num_requests), "prefix_id": pid,
                         "prefix_tokens": prefix_tokens})
