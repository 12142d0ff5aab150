"""Figures of the KV-budget study (``paged.studies.budget``): numbers -> ``go.Figure``, the sizing
formula as text, the claims as a table, and one ipywidgets panel that redraws the figures from sliders."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from paged.errors import ConfigError
from paged.sim.specs import KV_FORMATS
from paged.studies.budget import (GB, batch_budget, check_claims, model_choices, model_spec, paged_waste,
                                  request_kv_bytes, reservation_waste)

from .sizing import styled

TOKEN_COLOUR, WASTE_COLOUR, PAGED_COLOUR = "#2a9d8f", "#e76f51", "#264653"


def claims_table(df: pd.DataFrame | None = None):
    """``check_claims()`` as a left-aligned, untruncated table (a pandas Styler) for a notebook."""
    df = check_claims() if df is None else df
    return df.style.hide(axis="index").set_properties(**{"text-align": "left", "white-space": "normal"}) \
        .set_table_styles([{"selector": "th", "props": [("text-align", "left")]}])


def kv_growth_figure(model: str | ModelSpec, context: int, batch: int = 1, kv_format: str = "fp16",
                     gpu: str = "a100-80gb", tensor_parallel: int = 1, max_tokens: int | None = None) -> go.Figure:
    """KV bytes of a batch (per GPU) against tokens per request (a straight line), the chosen context
    marked, and one GPU's room for KV (HBM x 0.9 minus its share of the weights) as a horizontal line."""
    b = batch_budget(model, context, batch, kv_format, gpu, tensor_parallel)
    top = max_tokens or max(context * 2, 1024)
    t = np.linspace(0, top, 65)
    y = request_kv_bytes(model, t.round(), kv_format, tensor_parallel) * batch / GB
    fig = go.Figure([
        go.Scatter(x=t, y=y, mode="lines", name=f"KV of {batch} request(s)", line=dict(color=PAGED_COLOUR),
                   hovertemplate="%{x:.0f} tokens: %{y:.2f} GB<extra></extra>"),
        go.Scatter(x=[context], y=[b["bytes_per_batch"] / GB], mode="markers+text", name="chosen context",
                   text=[f"{b['bytes_per_batch'] / GB:.2f} GB"], textposition="top left",
                   marker=dict(size=11, color=WASTE_COLOUR)),
        go.Scatter(x=[0, top], y=[b["kv_room_bytes"] / GB] * 2, mode="lines", name=f"room for KV on each {b['gpu']}",
                   line=dict(dash="dash", color="grey")),
    ])
    tp = f" · tensor parallel {tensor_parallel}" if tensor_parallel > 1 else ""
    shape = "KV grows linearly with tokens" if not model_spec(model).layer_pattern else \
        "past the window only full layers grow"
    return styled(fig, f"{b['model']} · {b['kv_format']} · batch {batch}{tp}: {shape}", 380, x="tokens per request",
                  y="KV cache per GPU (GB)", legend_y=-0.25)


def kv_format_figure(model: str | ModelSpec, context: int, batch: int = 1,
                     formats: Sequence[str] = ("fp32", "fp16", "fp8", "int8", "int4"),
                     tensor_parallel: int = 1) -> go.Figure:
    """KV bytes of the batch per GPU in each storage format (scale overhead included), fp16 as the
    reference; formats the model's layout has no size for (MLA with scaled formats) are left out."""
    sized = []
    for f in formats:
        try:
            sized.append((f, float(request_kv_bytes(model, context, f, tensor_parallel)) * batch / GB))
        except ConfigError:
            continue
    formats, gb = [f for f, _ in sized], [g for _, g in sized]
    ref = float(request_kv_bytes(model, context, "fp16", tensor_parallel)) * batch / GB
    fig = go.Figure(go.Bar(x=list(formats), y=gb, marker_color=PAGED_COLOUR,
                           text=[f"{g:.2f} GB ({g / ref:.2f}x)" for g in gb], textposition="outside"))
    return styled(fig, f"{model_spec(model).name}: {batch} x {context:,} tokens in each KV format", 360,
                  y="KV cache per GPU (GB)", margin=(60, 20, 50, 40), yaxis_range=[0, max(gb) * 1.2])


def waste_curve_figure(max_len: int = 4096, block_size: int = 16, marks: Sequence[int] = (50, 150, 200, 3200)) -> go.Figure:
    """Share of reserved KV holding no token vs request length: a ``max_len`` reservation against paging."""
    t = np.unique(np.concatenate([np.geomspace(1, max_len, 200).round(), np.asarray(marks, dtype=float)]))
    xs = sorted(int(m) for m in marks)
    fig = go.Figure([
        go.Scatter(x=t, y=reservation_waste(t, max_len) * 100, mode="lines", name=f"contiguous, {max_len:,} reserved",
                   line=dict(color=WASTE_COLOUR)),
        go.Scatter(x=t, y=paged_waste(t, block_size) * 100, mode="lines", name=f"paged, blocks of {block_size}",
                   line=dict(color=PAGED_COLOUR)),
        go.Scatter(x=xs, y=[float(reservation_waste(m, max_len)) * 100 for m in xs], mode="markers+text",
                   text=[f"{m:,}: {float(reservation_waste(m, max_len)):.1%}" for m in xs],
                   textposition=_label_positions(xs, max_len), marker=dict(size=9, color=WASTE_COLOUR),
                   showlegend=False, cliponaxis=False),
    ])
    styled(fig, "Wasted share of a request's KV memory", 400, x="tokens in the request", y="% of its KV slots empty",
           legend_y=-0.25, margin=(60, 30, 50, 50), xaxis_type="log", yaxis_range=[0, 112])
    return fig.update_xaxes(range=[0, np.log10(max_len) + 0.05])


def _label_positions(xs: Sequence[int], max_len: int, near: float = 0.3) -> list[str]:
    """Text positions for marks on a log axis (sorted): to the right, below when the previous
    label is within `near` decades (so neighbours do not collide), to the left in the last
    quarter of the axis (so no label runs past its edge)."""
    out: list[str] = []
    for i, x in enumerate(xs):
        side = "left" if np.log10(max(x, 1)) > 0.75 * np.log10(max_len) else "right"
        close = i > 0 and np.log10(x) - np.log10(max(xs[i - 1], 1)) < near and out[-1].startswith("top")
        out.append(f"{'bottom' if close else 'top'} {side}")
    return out


def preallocation_figure(lengths: Sequence[int] | np.ndarray, max_len: int = 4096, block_size: int = 16,
                         bytes_per_token: float = 1.0) -> go.Figure:
    """Memory of a set of requests: tokens held vs empty slots, reserving ``max_len`` each vs paging.
    ``lengths`` are tokens per request (prompt + output); bytes_per_token scales slots to bytes (1 = slots)."""
    L = np.minimum(np.asarray(lengths, dtype=np.float64), max_len)
    held = L.sum() * bytes_per_token
    contiguous = len(L) * max_len * bytes_per_token
    paged = float(np.ceil(L / block_size).sum() * block_size) * bytes_per_token
    unit, scale = ("GB", GB) if bytes_per_token > 1 else ("slots", 1.0)
    x = [f"contiguous ({max_len:,} each)", f"paged (blocks of {block_size})"]
    fig = go.Figure([
        go.Bar(x=x, y=[held / scale, held / scale], name="holding tokens", marker_color=TOKEN_COLOUR),
        go.Bar(x=x, y=[(contiguous - held) / scale, (paged - held) / scale], name="reserved, empty",
               marker_color=WASTE_COLOUR,
               text=[f"{1 - held / contiguous:.1%} empty", f"{1 - held / paged:.1%} empty"], textposition="outside"),
    ])
    return styled(fig, f"{len(L)} requests, mean {L.mean():.0f} tokens: reserved KV memory", 380, y=f"KV ({unit})",
                  margin=(60, 20, 50, 40), barmode="stack")


def formula_text(b: dict) -> str:
    """The sizing formula with this configuration's numbers filled in (HTML for an ipywidgets.HTML)."""
    tp = b.get("tensor_parallel", 1)
    split = f" ÷ {tp} GPUs" if tp > 1 else ""
    room = (f"room for {b['requests_fit']:.1f} such requests." if b["kv_room_bytes"] > 0 else
            "no room at all: raise tensor parallelism or pick a larger GPU.")
    head = (f"{b['layout_formula']}" if b.get("layout_formula") else
            f"2 × {b['layers']} layers × {b['context']:,} tokens × {b['kv_heads']} KV heads{split} × {b['head_dim']} "
            f"× {b['bytes_per_element']:g} bytes")
    return (f"<b>{head} = {b['bytes_per_request'] / GB:.3f} GB per request</b>"
            f"{' per GPU' if tp > 1 else ''}; × batch {b['batch']} = {b['bytes_per_batch'] / GB:.2f} GB. "
            f"Each {b['gpu']} has {b['kv_room_bytes'] / GB:.1f} GB left after {b['weight_bytes'] / GB:.1f} GB of weights: "
            + room)


def budget_panel(model: str = "llama-2-70b", context: int = 4096, batch: int = 8, kv_format: str = "fp16",
                 gpu: str = "a100-80gb", tensor_parallel: int = 1):
    """Sliders (model, context, batch, KV format, GPU, tensor parallelism) over the figures and the formula.
    Returns an ``ipywidgets.VBox``; each change redraws both ``LivePlot``s inside ``batch_update`` (not plotly's
    FigureWidget: on a busy machine its model misses anywidget's start-up window and stays empty; see liveplot)."""
    import ipywidgets as W

    ctl = dict(
        model=W.Dropdown(options=model_choices(), value=model_spec(model).name, description="model"),
        context=W.IntSlider(value=context, min=128, max=131072, step=128, description="context", continuous_update=False),
        batch=W.IntSlider(value=batch, min=1, max=256, description="batch", continuous_update=False),
        kv_format=W.Dropdown(options=[f for f in ("fp32", "fp16", "bf16", "fp8", "int8", "int4", "int4_kivi") if f in KV_FORMATS],
                             value=kv_format, description="KV format"),
        gpu=W.Dropdown(options=["a100-40gb", "a100-80gb", "h100-sxm", "h200", "l4"], value=gpu, description="GPU"),
        tensor_parallel=W.Dropdown(options=[1, 2, 4, 8], value=tensor_parallel, description="GPUs (tp)"),
    )
    from .liveplot import LivePlot

    growth = LivePlot(kv_growth_figure(model, context, batch, kv_format, gpu, tensor_parallel))
    formats = LivePlot(kv_format_figure(model, context, batch, tensor_parallel=tensor_parallel))
    text = W.HTML(formula_text(batch_budget(model, context, batch, kv_format, gpu, tensor_parallel)))

    def redraw(_change=None) -> None:
        v = {k: c.value for k, c in ctl.items()}
        try:
            text.value = formula_text(batch_budget(**v))
        except ConfigError as exc:  # e.g. 8 KV heads do not split over the chosen GPUs
            text.value = f"<b style='color:{WASTE_COLOUR}'>{exc}</b>"
            return
        grown, sized = kv_growth_figure(**v), kv_format_figure(v["model"], v["context"], v["batch"],
                                                               tensor_parallel=v["tensor_parallel"])
        growth.replace_figure(grown)  # both built first: a failure changes neither
        formats.replace_figure(sized)

    for c in ctl.values():
        c.observe(redraw, names="value")
    return W.VBox([W.HBox([ctl["model"], ctl["kv_format"], ctl["gpu"]]),
                   W.HBox([ctl["context"], ctl["batch"], ctl["tensor_parallel"]]),
                   text, growth, formats])


__all__ = ["budget_panel", "claims_table", "formula_text", "kv_format_figure", "kv_growth_figure",
           "preallocation_figure", "waste_curve_figure"]
