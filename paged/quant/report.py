"""Markdown tables of a study (for docs and notes)."""
from __future__ import annotations

import pandas as pd

__all__ = ["markdown_table"]

_COLS = [("format", "format"), ("bits_per_value", "bits/value"), ("tokens_per_gib", "tokens/GiB"),
         ("kld_mean", "KLD mean"), ("kld_p99", "KLD p99"), ("delta_nll", "ΔNLL"),
         ("same_top1_pct", "same top-1 %"), ("first_div_median", "median first divergence")]


def markdown_table(df: pd.DataFrame, context_length: int, source: str = "all") -> str:
    """One context length and source of :func:`paged.quant.study` as a markdown table, base first,
    then the noise floor, then by bits per value (descending)."""
    d = df[(df.context_length == context_length) & (df.source == source)].copy()
    order = {"base": 0, "noise_floor": 1, "quantized": 2}
    d = d.assign(_o=d.role.map(order)).sort_values(["_o", "bits_per_value", "kld_mean"], ascending=[True, False, True])
    head = "| " + " | ".join(h for _, h in _COLS) + " |\n|" + " --- |" * len(_COLS) + "\n"
    fmt = {"bits_per_value": "{:.4g}", "tokens_per_gib": "{:,.0f}", "kld_mean": "{:.3g}", "kld_p99": "{:.3g}",
           "delta_nll": "{:+.4f}", "same_top1_pct": "{:.2f}", "first_div_median": "{:.0f}"}
    lines = ["| " + " | ".join(fmt[c].format(r[c]) if c in fmt else str(r[c]) for c, _ in _COLS) + " |"
             for _, r in d.iterrows()]
    return head + "\n".join(lines) + "\n"
