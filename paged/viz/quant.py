"""Plotly figures of the KV quantization study, and a live view of the engine generating under two
formats (``paged.studies.kv_formats.side_by_side``, redrawn after every step).

Every figure function takes the DataFrames of :func:`paged.quant.study` /
:mod:`paged.quant.diagnostics` and returns a ``plotly.graph_objects.Figure``; nothing is computed here.
"""
from __future__ import annotations

import html
from typing import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from paged.quant.metrics import survival

from .prose import all_rows
from .sizing import ROW_PX, count_axis, heatmap_height, label_positions

__all__ = ["pareto", "front_vs_llamacpp", "quality_and_speed", "error_vs_context", "survival_curves", "layer_heatmap",
           "key_outlier_heatmap", "render", "live_side_by_side"]


def _front(d: pd.DataFrame, metric: str) -> pd.DataFrame | None:
    """The rows of ``d`` (sorted by bits) whose ``metric`` is below every row's before them: the Pareto front."""
    front, best = [], np.inf
    for _, r in d.iterrows():
        if r[metric] < best:
            front.append(r)
            best = r[metric]
    return pd.DataFrame(front) if front else None


def pareto(df: pd.DataFrame, context_length: int | None = None, metric: str = "kld_mean") -> go.Figure:
    """KLD (log) vs bits per value per format; the memory/error Pareto front as a line."""
    d = all_rows(df)
    ctx = context_length or int(d.context_length.max())
    d = d[(d.context_length == ctx) & (d[metric] > 0)].sort_values("bits_per_value")
    fig = go.Figure(go.Scatter(x=d.bits_per_value, y=d[metric], mode="markers+text", text=d.format,
                               textposition=label_positions(d.bits_per_value, d[metric], d.format, log_y=True), name="formats",
                               customdata=np.stack([d.tokens_per_gib, d.same_top1_pct], -1),
                               hovertemplate="%{text}<br>%{x:.3g} bits/value<br>KLD %{y:.3g}<br>"
                                             "%{customdata[0]:,.0f} tokens/GiB<br>same top-1 %{customdata[1]:.1f}%"))
    if (f := _front(d, metric)) is not None:
        fig.add_scatter(x=f.bits_per_value, y=f[metric], mode="lines", name="Pareto front", line=dict(dash="dot"))
    return fig.update_layout(title=f"Error vs memory (ctx {ctx}, {metric})", yaxis_title=metric, yaxis_type="log",
                             xaxis_title="bits per value (K and V mean)", height=450)


def front_vs_llamacpp(ours: pd.DataFrame, llama: pd.DataFrame | None = None, *, metric: str = "kld_mean",
                      title: str = "KV formats: KLD vs bits per value (licence text, ctx 512)") -> go.Figure:
    """Our formats and llama.cpp's cache types on one KLD (log) vs bits axis, with our Pareto front.
    ``ours``: rows with ``format``, ``bits`` (or ``bits_per_value``), ``metric`` and optionally
    ``kld_se`` (error bars) and ``group`` (one marker series per group, e.g. "front" vs
    "earlier formats"); ``llama``: rows with ``format``, ``bits_per_value``, ``metric`` and
    ``rotation`` (``"on"``: llama.cpp's default Hadamard rotation, ``"off"``:
    ``LLAMA_ATTN_ROT_DISABLE=1``), drawn as two series. The front is the lower-left hull of ours."""
    d = ours.rename(columns={"bits": "bits_per_value"}) if "bits_per_value" not in ours else ours
    d = d[d[metric] > 0].sort_values("bits_per_value")
    fig = go.Figure()
    for name, g in (d.groupby("group", sort=False) if "group" in d else [("ours", d)]):
        err = dict(type="data", array=g.kld_se, visible=True) if "kld_se" in g and metric == "kld_mean" else None
        fig.add_scatter(x=g.bits_per_value, y=g[metric], mode="markers+text", text=g.format, name=str(name),
                        textposition="top center", error_y=err,
                        hovertemplate="%{text}<br>%{x:.3g} bits/value<br>" + metric + " %{y:.3g}<extra></extra>")
    if (f := _front(d, metric)) is not None:
        fig.add_scatter(x=f.bits_per_value, y=f[metric], mode="lines", name="our Pareto front",
                        line=dict(dash="dot"), hoverinfo="skip")
    if llama is not None and len(llama):
        for rot, sym, label in (("on", "diamond", "llama.cpp (rotation on, its default)"),
                                ("off", "x", "llama.cpp (rotation off)")):
            g = llama[(llama.rotation == rot) & (llama[metric] > 0)].sort_values("bits_per_value")
            if len(g):  # 'q8_0/q8_0' reads 'q8_0'; only the default (rotation on) is labelled on the plot
                names = [k if k == v else f"{k}/{v}" for k, _, v in g.format.str.partition("/").values]
                fig.add_scatter(x=g.bits_per_value, y=g[metric], mode="markers+text+lines" if rot == "on"
                                else "markers+lines", text=names, name=label, marker=dict(symbol=sym, size=10),
                                textposition="bottom center", line=dict(width=1),
                                hovertemplate="llama.cpp %{text}<br>%{x:.3g} bits/value<br>" + metric
                                + " %{y:.3g}<extra></extra>")
    return fig.update_layout(title=title,
                             xaxis_title="bits per value (K and V mean; scales, zeros, staging at 2k context)",
                             yaxis_title="mean KL divergence vs fp32 (log)" if metric == "kld_mean" else metric,
                             yaxis=dict(type="log", dtick=1), height=500)


def _label_sides(x: list[float], y: list[float]) -> list[str]:
    """Label positions of points sorted by ``x`` (log axis): above, except a point near its left
    neighbour (``x`` within 25%, ``y`` within 0.05) takes the side the neighbour's label did not."""
    sides: list[str] = []
    for i in range(len(x)):
        near = i > 0 and x[i] <= 1.25 * x[i - 1] and abs(y[i] - y[i - 1]) < 0.05
        sides.append(("bottom center" if sides[-1] == "top center" else "top center") if near else "top center")
    return sides


def quality_and_speed(ours: pd.DataFrame, llama: pd.DataFrame, cost: pd.DataFrame) -> go.Figure:
    """Two panels sharing the bits axis: left :func:`front_vs_llamacpp` (KLD, log), right the decode
    step of each format over its tool's base (``cost``: rows of ``benchmarks/quant_cost.py`` with
    ``tool``, ``prompt``, ``format``, ``bits_per_value``, ``x_base``; ours over fp32, llama.cpp over
    its f16 cache), one marker series per tool and prompt length (our labels: :func:`_label_sides`;
    llama.cpp's below). Of our formats the right panel shows the base (``auto``) and those of the
    left, at the left's bits (every byte counted, the window's rows included)."""
    from plotly.subplots import make_subplots
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1,
                        subplot_titles=("quality: KLD vs fp32 (licence text, ctx 512; log)",
                                        "speed on this CPU: decode step / its tool's base"))
    for tr in front_vs_llamacpp(ours, llama).data:
        fig.add_trace(tr, row=1, col=1)
    symbols = {512: "circle", 2048: "square"}
    study_bits = ours.groupby("format")["bits_per_value" if "bits_per_value" in ours else "bits"].first()
    for (tool, prompt), g in cost.groupby(["tool", "prompt"], sort=False):
        mine = tool == "ours"
        if mine:
            g = g[g.format.isin(study_bits.index) | (g.format == "auto")]
            g = g.assign(bits_per_value=g.format.map(study_bits).fillna(g.bits_per_value))
        g = g.sort_values("bits_per_value")
        names = g.format.replace({"auto": "fp32"}).str.partition("/")[0]
        fig.add_scatter(x=g.bits_per_value, y=g.x_base, mode="markers+text", text=names, row=1, col=2,
                        name=f"{'ours (native C)' if mine else tool}, batch x {prompt}",
                        marker=dict(symbol=symbols.get(int(prompt), "circle") if mine else "diamond", size=9),
                        textposition=_label_sides(g.bits_per_value.tolist(), g.x_base.tolist()) if mine
                        else "bottom center",
                        hovertemplate="%{text}<br>%{x:.3g} bits/value<br>step x base %{y:.2f}<extra></extra>")
    fig.add_hline(y=1.0, line=dict(dash="dot", width=1), row=1, col=2)
    fig.update_yaxes(type="log", dtick=1, title_text="mean KL divergence (log)", row=1, col=1)
    lo, hi = (float(cost.x_base.min()), float(cost.x_base.max())) if len(cost) else (1.0, 1.0)
    fig.update_yaxes(title_text="decode time x base (lower is faster)",  # room for the labels above the top one
                     range=[min(0.8, lo - 0.05), max(1.0, hi) + 0.12], row=1, col=2)
    fig.update_xaxes(title_text="bits per value", row=1, col=1)
    fig.update_xaxes(title_text="bits per value", type="log", tickvals=[2, 3, 4, 5, 8, 16, 32], row=1, col=2)
    return fig.update_layout(height=520, legend=dict(orientation="h", y=-0.22), margin=dict(b=150))


def error_vs_context(df: pd.DataFrame, metric: str = "kld_mean", formats: Sequence[str] | None = None) -> go.Figure:
    """``metric`` against context length, one line per format (base excluded)."""
    d = all_rows(df)
    d = d[d.role != "base"]
    fig = go.Figure()
    for fmt, g in d.groupby("format", sort=False):
        if formats is None or fmt in formats:
            g = g.sort_values("context_length")
            fig.add_scatter(x=g.context_length, y=g[metric], mode="lines+markers", name=fmt)
    return fig.update_layout(title=f"{metric} vs context length", xaxis_title="context length (tokens)",
                             yaxis_title=metric, yaxis_type="log", xaxis_type="log", height=420)


def survival_curves(df: pd.DataFrame, context_length: int | None = None) -> go.Figure:
    """Fraction of prompts whose greedy continuation still equals the base run's after t tokens."""
    d = all_rows(df)
    ctx = context_length or int(d.context_length.max())
    fig = go.Figure()
    for _, r in d[(d.context_length == ctx) & (d.role != "base")].iterrows():
        first = r.first_div if isinstance(r.first_div, list) else \
            [int(x) for x in str(r.first_div).strip("[]").split(",") if x.strip()]  # read back from CSV
        t, alive = survival(np.asarray(first), int(r.divergence_tokens))
        fig.add_scatter(x=t, y=alive, mode="lines", line_shape="hv", name=r.format)
    return fig.update_layout(title=f"Greedy agreement with the fp32 cache (ctx {ctx} prompts)",
                             xaxis_title="generated tokens", yaxis_title="prompts still identical", height=420)


def layer_heatmap(errors: pd.DataFrame, metric: str = "out_rel_err_kv") -> go.Figure:
    """Formats x layers heatmap of a :func:`~paged.quant.diagnostics.layer_errors` (or
    sensitivity) column. Sized from its content: ``ROW_PX`` per format row (a one-row heatmap
    still has room for its colour bar), one categorical column per layer measured."""
    z = errors.pivot(index="format", columns="layer", values=metric)
    fig = go.Figure(go.Heatmap(z=z.values, x=[str(c) for c in z.columns], y=list(z.index), colorscale="Viridis",
                               colorbar=dict(title=dict(text=metric, side="right"), thickness=14),
                               hovertemplate="%{y}, layer %{x}: %{z:.3g}<extra></extra>"))
    fig.update_layout(title=f"{metric} per layer", xaxis_title="layer", margin=dict(l=90, r=20, t=50, b=50),
                      height=heatmap_height(len(z), row_px=max(ROW_PX, 28), top=50, bottom=50, colorbar=True))
    fig.update_xaxes(type="category")
    return fig.update_yaxes(type="category")


def key_outlier_heatmap(channels: pd.DataFrame) -> go.Figure:
    """Per-channel key absmax (max over KV heads), layers x head_dim channels (``ROW_PX`` per layer)."""
    z = channels.groupby(["layer", "channel"]).absmax.max().unstack()
    fig = go.Figure(go.Heatmap(z=z.values, x=z.columns, y=z.index, colorscale="Magma", colorbar_title="|K| max"))
    fig.update_layout(title="Key outlier channels (absmax per channel)", xaxis_title="channel",
                      yaxis_title="layer", margin=dict(l=60, r=20, t=50, b=50),
                      height=heatmap_height(len(z), row_px=16, top=50, bottom=50, colorbar=True))
    fig.update_yaxes(autorange="reversed", **count_axis(float(len(z))))
    return fig.update_xaxes(**count_axis(float(len(z.columns))))


def render(formats: Sequence[str], texts: Sequence[str], toks: Sequence[Sequence[int]], tokenizer=None) -> str:
    """HTML: one column per format; tokens after the first disagreement are highlighted."""
    first = next((j for j, ab in enumerate(zip(*toks)) if len(set(ab)) > 1), None)
    cols = []
    for f, text, t in zip(formats, texts, toks):
        if first is not None and tokenizer is not None:
            same, rest = tokenizer.decode(list(t[:first])), tokenizer.decode(list(t[first:]))
            body = html.escape(same) + f"<span style='background:#fde2a7'>{html.escape(rest)}</span>"
        else:
            body = html.escape(text)
        cols.append(f"<div style='flex:1;padding:6px;border:1px solid #ccc'><b>{html.escape(f)}</b><br>"
                    f"<span style='white-space:pre-wrap;font-family:monospace'>{body}</span></div>")
    note = "identical so far" if first is None else f"first difference at token {first}"
    return f"<div style='display:flex;gap:8px'>{''.join(cols)}</div><small>{note}</small>"


def live_side_by_side(prompt: str, formats: Sequence[str] = ("fp32", "int4"), max_tokens: int = 40, *,
                      model=None) -> pd.DataFrame:
    """:func:`paged.studies.kv_formats.side_by_side` with a notebook view updated after every engine step."""
    from IPython.display import HTML, display

    from paged.quant.runs import load
    from paged.studies.kv_formats import side_by_side
    lm = load(model)
    handle = display(HTML("<i>starting the engines...</i>"), display_id=True)

    def update(fmts, texts, toks) -> None:
        if handle is not None:
            handle.update(HTML(render(fmts, texts, toks, lm.tokenizer)))
    return side_by_side(prompt, formats, max_tokens, model=lm, on_token=update)
