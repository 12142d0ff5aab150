"""Tables that fit a laptop screen: ``fit_table(df)`` -> a pandas Styler that wraps instead of overflowing.

A DataFrame shows one column per unbreakable header: 15 snake_case headers overflow a 1366-px
screen and the last columns (often the one that matters, e.g. ``outputs_identical``) scroll out of
sight; pandas also cuts text at 50 characters. `fit_table` wraps headers at words, shows numbers to
3 significant digits and wraps long text, keeping every value (`table_problems` of `tests/figure_check.py` measures it).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import pandas as pd

from .sizing import CONTENT_WIDTH

__all__ = ["fit_table", "number"]


def number(v, digits: int = 3) -> str:
    """A number as a reader wants it: thousands separated, `digits` significant digits, integers whole."""
    if isinstance(v, (bool, np.bool_)):
        return "yes" if v else "no"
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, (int, np.integer)):
        return f"{int(v):,}"
    if isinstance(v, (float, np.floating)):
        f = float(v)
        if math.isinf(f):
            return "∞" if f > 0 else "−∞"
        if f == int(f) and abs(f) < 1e15:
            return f"{int(f):,}"
        if abs(f) >= 10 ** digits:
            return f"{f:,.0f}"
        if abs(f) < 1e-3:
            return f"{f:.{digits - 1}e}"
        decimals = max(0, digits - 1 - int(math.floor(math.log10(abs(f)))))
        return f"{f:,.{decimals}f}"
    return str(v)


def _header(name) -> str:
    return (" ".join(map(str, name)) if isinstance(name, tuple) else str(name)).replace("_", " ")


def fit_table(df: pd.DataFrame, columns: Sequence[str] | None = None, *, digits: int = 3, index: bool | None = None,
              max_cell_em: int = 24):
    """`df` as a Styler that fits `sizing.CONTENT_WIDTH` px or wraps: word-wrapped headers,
    numbers to `digits` significant digits, text cells wrapped at `max_cell_em` em (never cut).
    `index`: show the index (default: only when it is not a plain 0..n-1 range)."""
    if columns is not None:
        missing = [c for c in columns if c not in df.columns]
        if missing:
            from paged.errors import ConfigError
            raise ConfigError(f"fit_table: no columns {missing} in the table; it has {list(df.columns)}")
        df = df[list(columns)]
    if index is None:  # an index of row numbers (a RangeIndex, or what is left of one after a filter) says nothing
        index = df.index.name is not None or not pd.api.types.is_integer_dtype(df.index)
    shown = df.rename(columns=_header)
    if index and df.index.name:
        shown.index = shown.index.rename(_header(df.index.name))
    sty = shown.style.format(lambda v: number(v, digits))
    if not index:
        sty = sty.hide(axis="index")
    # words stay whole (a header wraps between words); only a word longer than a cell breaks
    cell = [("white-space", "normal"), ("overflow-wrap", "break-word"), ("max-width", f"{max_cell_em}em"),
            ("vertical-align", "top")]  # numbers keep the notebook's right alignment; text columns go left below
    sty = sty.set_table_styles([
        {"selector": "th", "props": cell + [("text-align", "left"), ("min-width", "3em")]},
        {"selector": "td", "props": cell},
    ]).set_table_attributes(f'style="max-width:{CONTENT_WIDTH}px"')
    text_cols = [_header(c) for c in df.columns if df[c].dtype == object]
    if text_cols:
        sty = sty.set_properties(subset=text_cols, **{"text-align": "left"})
    return sty
