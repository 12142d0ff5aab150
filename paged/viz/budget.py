"""KV-cache budget: how many bytes a request's K/V take, what preallocation wastes, and circulating claims checked.

Numbers first (pure functions, no plotting), then figure builders (numbers -> ``go.Figure``), then
one ipywidgets panel that redraws the figures from sliders.

Invariants:
- ``kv_bytes(layers, tokens, kv_heads, head_dim, bytes_per_element)`` is exactly
  ``2 x layers x tokens x kv_heads x head_dim x bytes`` (the 2 is K and V): linear in tokens.
- ``request_kv_bytes(model, tokens, kv_format)`` = ``tokens x ModelSpec.kv_bytes_per_token(kv_format)``
  (the package's one sizing rule, scale overhead of int8/int4 included).
- ``reservation_waste(used, reserved)`` = ``1 - used / reserved``: the share of a contiguous
  reservation holding no token; ``paged_waste`` is the same for the last partly filled block only.
- GB are decimal (1e9 bytes), as articles quote them; GiB = 2**30 where the GPU's driver figure is meant.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from paged.errors import ConfigError
from paged.sim.specs import GiB, KV_FORMATS, MODEL_PRESETS, ModelSpec, get_gpu, get_kv_format, get_model

GB = 1e9

# LLaMA-1 65B (Touvron et al. 2023, Table 2): 80 layers, dim 8192, 64 heads; multi-head attention (no GQA).
LLAMA_65B = ModelSpec("llama-65b", 80, 8192, 64, 64, 22016, 32000, max_model_len=2048)

# Colours shared by every figure of this module
TOKEN_COLOUR, WASTE_COLOUR, PAGED_COLOUR = "#2a9d8f", "#e76f51", "#264653"


def kv_bytes(layers: int, tokens: int | np.ndarray, kv_heads: int, head_dim: int,
             bytes_per_element: float = 2.0) -> float | np.ndarray:
    """``2 x layers x tokens x kv_heads x head_dim x bytes``: K and V of every layer for ``tokens`` tokens."""
    for name, v in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim),
                    ("bytes_per_element", bytes_per_element)):
        if v <= 0:
            raise ConfigError(f"{name} must be positive, got {v}")
    out = 2.0 * layers * np.asarray(tokens, dtype=np.float64) * kv_heads * head_dim * bytes_per_element
    return out if isinstance(tokens, np.ndarray) else float(out)


def _model(model: str | ModelSpec) -> ModelSpec:
    if isinstance(model, str) and model.lower() == LLAMA_65B.name:
        return LLAMA_65B
    return get_model(model)


def model_choices() -> list[str]:
    """Preset names a panel offers: the package's presets plus LLaMA-65B (for the 160 GB claim)."""
    return sorted([*MODEL_PRESETS, LLAMA_65B.name])


def request_kv_bytes(model: str | ModelSpec, tokens: int | np.ndarray, kv_format: str = "fp16",
                     tensor_parallel: int = 1) -> float | np.ndarray:
    """KV bytes of one request holding ``tokens`` tokens (per GPU under tensor parallelism)."""
    per_tok = _model(model).kv_bytes_per_token(kv_format, tensor_parallel)
    return np.asarray(tokens, dtype=np.float64) * per_tok if isinstance(tokens, np.ndarray) else tokens * per_tok


def reservation_waste(used: float | np.ndarray, reserved: float) -> float | np.ndarray:
    """Share of a contiguous reservation of ``reserved`` slots that holds no token (0..1)."""
    if reserved <= 0:
        raise ConfigError(f"reserved must be positive, got {reserved}")
    if np.any(np.asarray(used) > reserved) or np.any(np.asarray(used) < 0):
        raise ConfigError(f"used tokens must lie in [0, {reserved}]; raise the reservation")
    return 1.0 - np.asarray(used, dtype=np.float64) / reserved if isinstance(used, np.ndarray) else 1.0 - used / reserved


def paged_waste(used: int | np.ndarray, block_size: int) -> float | np.ndarray:
    """Share of a request's paged slots (whole blocks) holding no token: only its last block is partly empty."""
    if block_size <= 0:
        raise ConfigError(f"block_size must be positive, got {block_size}")
    u = np.asarray(used, dtype=np.float64)
    slots = np.ceil(u / block_size) * block_size
    out = np.where(slots > 0, 1.0 - u / np.maximum(slots, 1), 0.0)
    return out if isinstance(used, np.ndarray) else float(out)


def tokens_for_waste(waste: float, reserved: int) -> float:
    """The request length at which a ``reserved``-slot reservation wastes ``waste`` (inverse of reservation_waste)."""
    return reserved * (1.0 - waste)


def requests_that_fit(model: str | ModelSpec, tokens: int, memory_bytes: float, kv_format: str = "fp16") -> float:
    """How many ``tokens``-token requests' KV fit in ``memory_bytes`` (a fraction: the budget's reading)."""
    return memory_bytes / float(request_kv_bytes(model, tokens, kv_format))


def batch_budget(model: str | ModelSpec, context: int, batch: int, kv_format: str = "fp16",
                 gpu: str = "a100-80gb", tensor_parallel: int = 1) -> dict[str, float]:
    """One configuration in numbers, per GPU: KV bytes per token, request and batch, and the GPU's room for it.

    ``kv_room_bytes`` = HBM x 0.9 - weights/tp (vLLM's default utilisation; activations ignored), floored at 0.
    """
    m, g = _model(model), get_gpu(gpu)
    per_tok = m.kv_bytes_per_token(kv_format, tensor_parallel)
    heads = max(1, m.num_kv_heads // tensor_parallel)
    room = max(0.0, 0.9 * g.hbm_bytes - m.weight_bytes() / tensor_parallel)
    return {"model": m.name, "kv_format": get_kv_format(kv_format).name, "context": context, "batch": batch,
            "layers": m.num_layers, "kv_heads": m.num_kv_heads, "kv_heads_per_gpu": heads, "head_dim": m.head_dim,
            "bytes_per_element": per_tok / (2 * m.num_layers * heads * m.head_dim),
            "bytes_per_token": per_tok, "bytes_per_request": per_tok * context, "bytes_per_batch": per_tok * context * batch,
            "weight_bytes": m.weight_bytes() / tensor_parallel, "gpu": g.name, "tensor_parallel": tensor_parallel, "hbm_bytes": g.hbm_bytes,
            "kv_room_bytes": room, "requests_fit": room / (per_tok * context) if context else math.inf}


def claims_table(df: pd.DataFrame | None = None):
    """``check_claims()`` as a left-aligned, untruncated table (a pandas Styler) for a notebook."""
    df = check_claims() if df is None else df
    return df.style.hide(axis="index").set_properties(**{"text-align": "left", "white-space": "normal"}) \
        .set_table_styles([{"selector": "th", "props": [("text-align", "left")]}])


def check_claims() -> pd.DataFrame:
    """Figures that circulate in articles about KV caches, recomputed by this package.

    Columns: claim, published, computed, verdict. Each computed value comes from the functions above.
    """
    l2 = get_model("llama-2-70b")
    rows = []
    gb70 = float(request_kv_bytes(l2, 4096, "fp16")) / GB
    rows.append(("LLaMA-2-70B (80 layers, 8 KV heads, head_dim 128), 4,096 tokens, FP16: KV per request",
                 "1.34 GB", f"{gb70:.2f} GB ({gb70 * GB / GiB:.2f} GiB)",
                 "right (decimal GB)" if round(gb70, 2) == 1.34 else "wrong"))
    for published, tokens in ((0.988, 150), (0.951, 3200)):
        w = float(reservation_waste(tokens, 4096))
        rows.append((f"{tokens:,}-token request in a 4,096-token reservation: share wasted", f"{published:.1%}",
                     f"{w:.1%}", f"wrong: {published:.1%} is a ~{tokens_for_waste(published, 4096):.0f}-token request"))
    r = float(request_kv_bytes(l2, 8192)) / float(request_kv_bytes(l2, 4096))
    rows.append(("KV size grows with the square of the sequence length", "x4 when the length doubles",
                 f"x{r:.2f} when the length doubles",
                 "wrong: KV bytes are linear in tokens (the attention compute over them is quadratic in prefill)"))
    gb65 = float(request_kv_bytes(LLAMA_65B, 2048, "fp16")) / GB
    rows.append(("LLaMA-65B (80 layers, 64 heads, no GQA), 2,048 tokens, FP16: KV needed", "160 GB",
                 f"{gb65:.2f} GB per request; 160 GB = {160 / gb65:.1f} requests",
                 "wrong for one request; right only for a batch of ~30"))
    return pd.DataFrame(rows, columns=["claim", "published", "computed", "verdict"])


# ----------------------------------------------------------------------------------------------
# Figures
# ----------------------------------------------------------------------------------------------


def kv_growth_figure(model: str | ModelSpec, context: int, batch: int = 1, kv_format: str = "fp16",
                     gpu: str = "a100-80gb", tensor_parallel: int = 1, max_tokens: int | None = None) -> go.Figure:
    """KV bytes of a batch (per GPU) against tokens per request (a straight line), the chosen context
    marked, and one GPU's room for KV (HBM x 0.9 minus its share of the weights) as a horizontal line."""
    b = batch_budget(model, context, batch, kv_format, gpu, tensor_parallel)
    top = max_tokens or max(context * 2, 1024)
    t = np.linspace(0, top, 65)
    y = t * b["bytes_per_token"] * batch / GB
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
    fig.update_layout(title=f"{b['model']} · {b['kv_format']} · batch {batch}{tp}: KV grows linearly with tokens",
                      xaxis_title="tokens per request", yaxis_title="KV cache per GPU (GB)", height=380,
                      margin=dict(l=60, r=20, t=50, b=50), legend=dict(orientation="h", y=-0.25))
    return fig


def kv_format_figure(model: str | ModelSpec, context: int, batch: int = 1,
                     formats: Sequence[str] = ("fp32", "fp16", "fp8", "int8", "int4"),
                     tensor_parallel: int = 1) -> go.Figure:
    """KV bytes of the batch per GPU in each storage format (scale overhead included), fp16 as the reference."""
    gb = [float(request_kv_bytes(model, context, f, tensor_parallel)) * batch / GB for f in formats]
    ref = float(request_kv_bytes(model, context, "fp16", tensor_parallel)) * batch / GB
    fig = go.Figure(go.Bar(x=list(formats), y=gb, marker_color=PAGED_COLOUR,
                           text=[f"{g:.2f} GB ({g / ref:.2f}x)" for g in gb], textposition="outside"))
    fig.update_layout(title=f"{_model(model).name}: {batch} x {context:,} tokens in each KV format",
                      yaxis_title="KV cache per GPU (GB)", height=360, margin=dict(l=60, r=20, t=50, b=40),
                      yaxis_range=[0, max(gb) * 1.2])
    return fig


def waste_curve_figure(max_len: int = 4096, block_size: int = 16, marks: Sequence[int] = (50, 150, 200, 3200)) -> go.Figure:
    """Share of reserved KV holding no token vs request length: a ``max_len`` reservation against paging."""
    t = np.unique(np.concatenate([np.geomspace(1, max_len, 200).round(), np.asarray(marks, dtype=float)]))
    fig = go.Figure([
        go.Scatter(x=t, y=reservation_waste(t, max_len) * 100, mode="lines", name=f"contiguous, {max_len:,} reserved",
                   line=dict(color=WASTE_COLOUR)),
        go.Scatter(x=t, y=paged_waste(t, block_size) * 100, mode="lines", name=f"paged, blocks of {block_size}",
                   line=dict(color=PAGED_COLOUR)),
        go.Scatter(x=list(marks), y=[float(reservation_waste(m, max_len)) * 100 for m in marks], mode="markers+text",
                   text=[f"{m:,}: {float(reservation_waste(m, max_len)):.1%}" for m in marks],
                   textposition="top right", marker=dict(size=9, color=WASTE_COLOUR), showlegend=False),
    ])
    fig.update_layout(title="Wasted share of a request's KV memory", xaxis_type="log", xaxis_title="tokens in the request",
                      yaxis_title="% of its KV slots empty", yaxis_range=[0, 105], height=380,
                      margin=dict(l=60, r=20, t=50, b=50), legend=dict(orientation="h", y=-0.25))
    return fig


def preallocation_figure(lengths: Sequence[int] | np.ndarray, max_len: int = 4096, block_size: int = 16,
                         bytes_per_token: float = 1.0) -> go.Figure:
    """Memory of a set of requests: tokens held vs empty slots, reserving ``max_len`` each vs paging.

    ``lengths`` are tokens per request (prompt + output); bytes_per_token scales slots to bytes (1 = slots).
    """
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
    fig.update_layout(barmode="stack", title=f"{len(L)} requests, mean {L.mean():.0f} tokens: reserved KV memory",
                      yaxis_title=f"KV ({unit})", height=380, margin=dict(l=60, r=20, t=50, b=40))
    return fig


def workload_lengths(workload: str = "sharegpt", num_requests: int = 1000, max_len: int = 4096,
                     seed: int = 0) -> np.ndarray:
    """Tokens per request (prompt + output) of a seeded synthetic trace fitted to ``max_len``."""
    from paged.sim.workload import synthetic_trace

    tr = synthetic_trace(workload, num_requests, seed=seed, max_model_len=max_len)
    return (tr["prompt_tokens"] + tr["output_tokens"]).to_numpy()


def formula_text(b: dict) -> str:
    """The sizing formula with this configuration's numbers filled in (HTML for an ipywidgets.HTML)."""
    tp = b.get("tensor_parallel", 1)
    split = f" ÷ {tp} GPUs" if tp > 1 else ""
    room = (f"room for {b['requests_fit']:.1f} such requests." if b["kv_room_bytes"] > 0 else
            "no room at all: raise tensor parallelism or pick a larger GPU.")
    return (f"<b>2 × {b['layers']} layers × {b['context']:,} tokens × {b['kv_heads']} KV heads{split} × {b['head_dim']} "
            f"× {b['bytes_per_element']:g} bytes = {b['bytes_per_request'] / GB:.3f} GB per request</b>"
            f"{' per GPU' if tp > 1 else ''}; × batch {b['batch']} = {b['bytes_per_batch'] / GB:.2f} GB. "
            f"Each {b['gpu']} has {b['kv_room_bytes'] / GB:.1f} GB left after {b['weight_bytes'] / GB:.1f} GB of weights: "
            + room)


def budget_panel(model: str = "llama-2-70b", context: int = 4096, batch: int = 8, kv_format: str = "fp16",
                 gpu: str = "a100-80gb", tensor_parallel: int = 1):
    """Sliders (model, context, batch, KV format, GPU, tensor parallelism) over the figures and the formula.

    Returns an ``ipywidgets.VBox``; each change redraws both ``FigureWidget``s inside ``batch_update``.
    """
    import ipywidgets as W

    ctl = dict(
        model=W.Dropdown(options=model_choices(), value=_model(model).name, description="model"),
        context=W.IntSlider(value=context, min=128, max=32768, step=128, description="context", continuous_update=False),
        batch=W.IntSlider(value=batch, min=1, max=256, description="batch", continuous_update=False),
        kv_format=W.Dropdown(options=[f for f in ("fp32", "fp16", "bf16", "fp8", "int8", "int4", "int4_kivi") if f in KV_FORMATS],
                             value=kv_format, description="KV format"),
        gpu=W.Dropdown(options=["a100-40gb", "a100-80gb", "h100-sxm", "h200", "l4"], value=gpu, description="GPU"),
        tensor_parallel=W.Dropdown(options=[1, 2, 4, 8], value=tensor_parallel, description="GPUs (tp)"),
    )
    growth = go.FigureWidget(kv_growth_figure(model, context, batch, kv_format, gpu, tensor_parallel))
    formats = go.FigureWidget(kv_format_figure(model, context, batch, tensor_parallel=tensor_parallel))
    text = W.HTML(formula_text(batch_budget(model, context, batch, kv_format, gpu, tensor_parallel)))

    def redraw(_change=None) -> None:
        v = {k: c.value for k, c in ctl.items()}
        try:
            text.value = formula_text(batch_budget(**v))
        except ConfigError as exc:  # e.g. 8 KV heads do not split over the chosen GPUs
            text.value = f"<b style='color:{WASTE_COLOUR}'>{exc}</b>"
            return
        for widget, new in ((growth, kv_growth_figure(**v)),
                            (formats, kv_format_figure(v["model"], v["context"], v["batch"],
                                                      tensor_parallel=v["tensor_parallel"]))):
            with widget.batch_update():
                for old, fresh in zip(widget.data, new.data):
                    old.update(fresh.to_plotly_json())
                widget.layout.update(new.layout.to_plotly_json())

    for c in ctl.values():
        c.observe(redraw, names="value")
    return W.VBox([W.HBox([ctl["model"], ctl["kv_format"], ctl["gpu"]]),
                   W.HBox([ctl["context"], ctl["batch"], ctl["tensor_parallel"]]),
                   text, growth, formats])


__all__ = ["GB", "LLAMA_65B", "kv_bytes", "request_kv_bytes", "reservation_waste", "paged_waste", "tokens_for_waste",
           "requests_that_fit", "batch_budget", "check_claims", "claims_table", "model_choices", "kv_growth_figure", "kv_format_figure",
           "waste_curve_figure", "preallocation_figure", "workload_lengths", "formula_text", "budget_panel"]
