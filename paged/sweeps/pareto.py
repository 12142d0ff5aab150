"""The Pareto front of a sweep: the points no other point beats on every objective at once."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd

from paged.errors import ConfigError


def pareto_front(df: pd.DataFrame, maximize: Sequence[str] = (), minimize: Sequence[str] = ()) -> pd.Series:
    """Boolean Series over ``df``'s rows: True where no other row is at least as good on every
    objective and strictly better on one. Rows with a missing/NaN objective (or
    ``status != "ok"``) are never on the front and dominate nothing."""
    cols = list(maximize) + list(minimize)
    if not cols:
        raise ConfigError("pareto_front needs at least one objective in maximize= or minimize=")
    missing = [c for c in cols if c not in df.columns]
    if missing:
        raise ConfigError(f"pareto_front: no column(s) {missing}; the table has {list(df.columns)}")
    # every objective as "larger is better"
    x = np.column_stack([df[c].to_numpy(dtype=float) for c in maximize] +
                        [-df[c].to_numpy(dtype=float) for c in minimize]) if len(df) else np.empty((0, len(cols)))
    ok = np.isfinite(x).all(axis=1)
    if "status" in df.columns:
        ok &= (df["status"] == "ok").to_numpy()
    front = np.zeros(len(df), dtype=bool)
    cand = x[ok]
    for j, row in zip(np.flatnonzero(ok), cand):  # dominated: some row >= on every objective and > on one
        front[j] = not ((cand >= row).all(axis=1) & (cand > row).any(axis=1)).any()
    return pd.Series(front, index=df.index, name="pareto")


__all__ = ["pareto_front"]
