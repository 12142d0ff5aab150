"""Readability checks of a plotly figure or a table, computed from the figure's own JSON.

    figure_problems(fig) -> list[str]      # [] when nothing below is found
    table_problems(df_or_styler) -> list[str]
    output_problems(text) -> list[str]     # a path of this machine in a printed output

What `figure_problems` finds (the px estimates follow plotly.js defaults: height 450, margins
100/80/80/80, a title font of 17 px and text of 12 px, an output `sizing.CONTENT_WIDTH` wide):

- a figure shorter than `sizing.MIN_HEIGHT` px, or a plot area with no height left after its margins;
- a heatmap with fewer than `sizing.MIN_ROW_PX` px per row, or a colour bar too short for its ticks;
- a count axis (named in `count_axes`, or titled with a counted thing: blocks, tokens, requests,
  steps, count...) whose ticks can fall between integers (plotly picks 0.5 or 0.2 steps on a
  span under 10 unless the axis fixes an integer `dtick`, integer `tickvals`, a category or log type);
- histograms overlaid on one axis (they hide each other: ECDFs compare), and a linear
  histogram whose one bin holds nearly every sample while a tail exists (invisible: log or ECDF);
- text labels of a trace that overlap each other or run past the figure's edge; a title wider than the figure.

The checks are estimates (no browser): they flag what is certainly unreadable, not every flaw.
The browser test measures rendered heights in the page.
"""
from __future__ import annotations

import math
import re
from typing import Iterable

import numpy as np

from paged.viz.sizing import CONTENT_WIDTH, INTEGER_SPAN, MIN_COLORBAR_PX, MIN_HEIGHT, MIN_ROW_PX

__all__ = ["figure_problems", "output_problems", "table_problems", "table_width"]

COUNT_WORDS = ("count", "blocks", "tokens in", "tokens per step", "requests", "preemptions", "logical block",
               "step", "number of", "copies")
NOT_COUNTS = ("per block", "/s", "/ s", "per s", "throughput", "time", "%", "ms", "(s)", "share", "rate", "gb", "gib",
              "bits", "tokens / ", "error", "kld", "distance")
DEFAULT_MARGIN = dict(l=80, r=80, t=100, b=80)
TITLE_PX, TEXT_PX, CHAR_EM = 17, 12, 0.58
PATH_RE = re.compile(r"(?<![\w.])/(?:home|root|work|tmp|Users|var|mnt|opt|srv)/[\w.\-/]+")


def _plain(text: str | None) -> str:
    return re.sub(r"<[^>]+>", "", text or "")


def _text_px(text: str, size: float = TEXT_PX) -> float:
    lines = re.split(r"<br\s*/?>", text or "")
    return max(len(_plain(s)) for s in lines) * size * CHAR_EM


def _layout(fig) -> dict:
    return fig.to_plotly_json().get("layout", {}) if hasattr(fig, "to_plotly_json") else dict(fig.get("layout", {}))


def _traces(fig) -> list[dict]:
    return fig.to_plotly_json().get("data", []) if hasattr(fig, "to_plotly_json") else list(fig.get("data", []))


def _axis_key(ref: str | None, letter: str) -> str:
    """'y2' -> 'yaxis2'; None -> 'yaxis'."""
    ref = ref or letter
    return f"{letter}axis{ref[1:]}"


def _title_text(t) -> str:
    if isinstance(t, dict):
        return _plain(t.get("text"))
    return _plain(t) if isinstance(t, str) else ""


def _size(layout: dict) -> tuple[float, float, dict]:
    height = float(layout.get("height") or 450)
    width = float(layout.get("width") or CONTENT_WIDTH)
    m = dict(DEFAULT_MARGIN)
    m.update({k: v for k, v in (layout.get("margin") or {}).items() if k in m and v is not None})
    return height, width, m


def _axis_px(layout: dict, key: str, height: float, width: float, m: dict) -> float:
    dom = (layout.get(key) or {}).get("domain") or [0, 1]
    full = (height - m["t"] - m["b"]) if key.startswith("y") else (width - m["l"] - m["r"])
    return max(0.0, full) * (dom[1] - dom[0])


def _values(v) -> np.ndarray:
    if v is None:
        return np.zeros(0)
    if isinstance(v, dict) and "bdata" in v:  # plotly's typed-array JSON
        import base64
        return np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"])).astype(float)
    try:
        a = np.asarray(v, dtype=float).ravel()
    except (TypeError, ValueError):
        return np.zeros(0)
    return a[np.isfinite(a)]


def _rows(z) -> int:
    """Rows of a heatmap's z (nested lists, a numpy array or plotly's typed-array JSON)."""
    if z is None:
        return 0
    if isinstance(z, dict):
        shape = str(z.get("shape", "")).split(",")
        return int(shape[0]) if shape[0].strip() else 0
    if isinstance(z, (list, tuple)):
        return len(z)
    a = np.asarray(z)
    return int(a.shape[0]) if a.ndim else 0


def _data_span(traces: list[dict], key: str, layout: dict) -> float | None:
    """The data extent on axis `key` (None: nothing numeric drawn there)."""
    letter = key[0]
    ref = "y" if key == "yaxis" else "x" if key == "xaxis" else letter + key[5:]
    mine = [t for t in traces if (t.get(f"{letter}axis") or letter) == ref]
    hi, lo, found = -math.inf, math.inf, False
    stacks: dict[float, float] = {}
    for t in mine:
        kind = t.get("type", "scatter")
        if kind == "histogram":
            if letter == "y" and t.get("orientation", "v") == "v":
                x = _values(t.get("x"))
                if len(x):
                    counts, _ = np.histogram(x, bins=int(t.get("nbinsx") or min(30, max(1, int(math.sqrt(len(x)))))))
                    hi, lo, found = max(hi, counts.max()), min(lo, 0), True
            continue
        if kind == "heatmap":
            continue
        v = _values(t.get(letter))
        if not len(v):
            continue
        if kind == "bar" and letter == "y" and layout.get("barmode") == "stack":
            xs = t.get("x") or list(range(len(v)))
            for xv, yv in zip(xs, v):
                k = hash(str(xv))
                stacks[k] = stacks.get(k, 0.0) + yv
            continue
        if kind == "bar" and letter == "y":
            lo = min(lo, 0)
        hi, lo, found = max(hi, v.max()), min(lo, v.min()), True
    if stacks:
        hi, lo, found = max(hi, max(stacks.values())), min(lo, 0), True
    return (hi - lo) if found else None


def _is_count_axis(ax: dict, key: str, declared: set[str]) -> bool:
    if key in declared:
        return True
    title = _title_text(ax.get("title")).lower()
    if not title or any(w in title for w in NOT_COUNTS):
        return False
    return any(w in title for w in COUNT_WORDS)


def _integer_ticks(ax: dict, span: float | None) -> bool:
    """True if plotly can only draw whole-number ticks on this axis."""
    if ax.get("type") in ("category", "multicategory", "log") or ax.get("showticklabels") is False:
        return True
    if ax.get("tickmode") == "array":
        vals = _values(ax.get("tickvals"))
        return bool(len(vals)) and bool(np.all(vals == np.round(vals)))
    dtick = ax.get("dtick")
    if dtick is not None:
        try:
            d = float(dtick)
        except (TypeError, ValueError):
            return False
        return d >= 1 and d == round(d) and float(ax.get("tick0") or 0) == round(float(ax.get("tick0") or 0))
    rng = ax.get("range")
    if rng and ax.get("autorange") in (None, False) and None not in rng:
        return abs(float(rng[1]) - float(rng[0])) >= INTEGER_SPAN
    include = _values((ax.get("autorangeoptions") or {}).get("include"))
    if len(include) and include.max() - min(include.min(), 0) >= INTEGER_SPAN:
        return True
    return span is not None and span >= INTEGER_SPAN


def _axis_range(ax: dict, vals: np.ndarray) -> tuple[float, float] | None:
    rng = ax.get("range")
    log = ax.get("type") == "log"
    if rng and None not in rng:
        a, b = float(rng[0]), float(rng[1])  # a log axis's range is already in log10 units
        return (a, b) if b != a else None
    v = vals[vals > 0] if log else vals
    if not len(v):
        return None
    a, b = (np.log10(v.min()), np.log10(v.max())) if log else (v.min(), v.max())
    pad = 0.05 * (b - a) if b > a else 0.5
    return a - pad, b + pad


def _label_problems(t: dict, layout: dict, height: float, width: float, m: dict) -> list[str]:
    """Overlapping or clipped text labels of one scatter trace (estimated boxes in px)."""
    mode = t.get("mode") or ""
    texts = t.get("text")
    if isinstance(texts, np.ndarray):
        texts = texts.tolist()
    if "text" not in mode or not isinstance(texts, (list, tuple)) or len(texts) < 1:
        return []
    xk, yk = _axis_key(t.get("xaxis"), "x"), _axis_key(t.get("yaxis"), "y")
    xa, ya = layout.get(xk) or {}, layout.get(yk) or {}
    if xa.get("type") == "category" or ya.get("type") == "category":
        return []
    x, y = _values(t.get("x")), _values(t.get("y"))
    if len(x) != len(texts) or len(y) != len(texts):
        return []
    xr, yr = _axis_range(xa, x), _axis_range(ya, y)
    if xr is None or yr is None:
        return []
    wpx, hpx = _axis_px(layout, xk, height, width, m), _axis_px(layout, yk, height, width, m)
    xdom = (xa.get("domain") or [0, 1])[0] * (width - m["l"] - m["r"])
    tx = (np.log10(np.maximum(x, 1e-300)) if xa.get("type") == "log" else x)
    ty = (np.log10(np.maximum(y, 1e-300)) if ya.get("type") == "log" else y)
    px = m["l"] + xdom + (tx - xr[0]) / (xr[1] - xr[0]) * wpx
    py = (ty - yr[0]) / (yr[1] - yr[0]) * hpx
    pos_all = t.get("textposition") or "middle center"
    size = float((t.get("textfont") or {}).get("size") or TEXT_PX)
    boxes = []
    for i, s in enumerate(texts):
        pos = pos_all if isinstance(pos_all, str) else str(pos_all[i])
        w, h = _text_px(str(s), size), size * 1.3
        cx = px[i] + (w / 2 + 4 if "right" in pos else -w / 2 - 4 if "left" in pos else 0)
        cy = py[i] + (h / 2 + 4 if "top" in pos else -h / 2 - 4 if "bottom" in pos else 0)
        boxes.append((cx - w / 2, cx + w / 2, cy - h / 2, cy + h / 2, str(s)))
    out = []
    for b in boxes:
        if b[1] > width - 2 or b[0] < 2:
            out.append(f"label {_plain(b[4])!r} runs past the figure's edge (about x = {b[1]:.0f} of {width:.0f} px)")
    for i in range(len(boxes)):
        for j in range(i + 1, len(boxes)):
            a, b = boxes[i], boxes[j]
            if a[0] < b[1] and b[0] < a[1] and a[2] < b[3] and b[2] < a[3]:
                out.append(f"labels {_plain(a[4])!r} and {_plain(b[4])!r} overlap")
    return out


def figure_problems(fig, *, count_axes: Iterable[str] = (), min_height: int = MIN_HEIGHT,
                    min_row_px: int = MIN_ROW_PX, width: float | None = None) -> list[str]:
    """What makes `fig` (a go.Figure, a LivePlot's figure or its JSON dict) hard to read; [] if nothing.

    `count_axes`: layout keys ('yaxis', 'xaxis2', ...) that show counts, besides those whose
    title names a counted thing; `width`: the px the figure gets (default: a laptop notebook)."""
    layout, traces = _layout(fig), _traces(fig)
    height, fwidth, m = _size(layout)
    if width is not None and not layout.get("width"):
        fwidth = float(width)
    out: list[str] = []
    if height < min_height:
        out.append(f"figure is {height:.0f} px tall (< {min_height})")
    if height - m["t"] - m["b"] < 60:
        out.append(f"plot area is {height - m['t'] - m['b']:.0f} px tall after margins {m['t']}+{m['b']}")
    title = _title_text(layout.get("title"))
    if title and _text_px(title, TITLE_PX) > fwidth - 20:
        out.append(f"title of {len(title)} characters is wider than the figure ({_text_px(title, TITLE_PX):.0f} > {fwidth:.0f} px)")
    declared = set(count_axes)
    for key in sorted(k for k in layout if re.fullmatch(r"[xy]axis\d*", k)) or []:
        ax = layout.get(key) or {}
        if _is_count_axis(ax, key, declared) and not _integer_ticks(ax, _data_span(traces, key, layout)):
            out.append(f"{key} ({_title_text(ax.get('title')) or 'untitled'}) counts things but its ticks can fall "
                       "between integers: use sizing.count_axis()")
    for key in declared - {k for k in layout if re.fullmatch(r"[xy]axis\d*", k)}:
        if not _integer_ticks({}, _data_span(traces, key, layout)):
            out.append(f"{key} counts things but has no integer ticks set: use sizing.count_axis()")
    hists: dict[tuple, int] = {}
    for t in traces:
        kind = t.get("type", "scatter")
        if kind == "heatmap":
            yk = _axis_key(t.get("yaxis"), "y")
            ya = layout.get(yk) or {}
            rows = _rows(t.get("z"))
            if ya.get("range") and ya.get("autorange") in (None, False) and None not in ya["range"]:
                rows = max(rows, int(round(abs(ya["range"][1] - ya["range"][0]))))
            if rows:
                per = _axis_px(layout, yk, height, fwidth, m) / rows
                if per < min_row_px:
                    out.append(f"heatmap rows are {per:.1f} px tall (< {min_row_px}): {rows} rows in "
                               f"{_axis_px(layout, yk, height, fwidth, m):.0f} px")
            if t.get("showscale", True) is not False and not (t.get("colorscale") and t.get("showscale") is None
                                                                 and layout.get("coloraxis")):
                cb = t.get("colorbar") or {}
                length = float(cb.get("len") or 1.0)
                px = length if cb.get("lenmode") == "pixels" else length * (height - m["t"] - m["b"])
                if px < MIN_COLORBAR_PX:
                    out.append(f"colour bar is {px:.0f} px tall (< {MIN_COLORBAR_PX}): its tick labels overprint")
        elif kind == "histogram":
            xk = _axis_key(t.get("xaxis"), "x")
            hists[(xk, _axis_key(t.get("yaxis"), "y"))] = hists.get((xk, _axis_key(t.get("yaxis"), "y")), 0) + 1
            x = _values(t.get("x"))
            if len(x) >= 10 and (layout.get(xk) or {}).get("type") != "log":
                counts, _ = np.histogram(x, bins=int(t.get("nbinsx") or 30))
                if counts.max() >= 0.9 * len(x) and counts.max() < len(x):
                    out.append(f"histogram {t.get('name') or ''!r}: one bin holds {counts.max()} of {len(x)} samples, "
                               "the tail is invisible: use a log axis or an ECDF")
        elif kind in ("scatter", "scattergl"):
            out += _label_problems(t, layout, height, fwidth, m)
    if layout.get("barmode") == "overlay":
        out += [f"{n} histograms overlaid on {k[0]}/{k[1]} hide each other: draw ECDFs" for k, n in hists.items() if n > 1]
    return out


# ---- tables ----------------------------------------------------------------------------
def _cell_px(s: str, wrap: bool) -> float:
    s = _plain(str(s))
    parts = re.split(r"\s+", s) if wrap else [s]
    return max((len(p) for p in parts), default=0) * 13 * 0.6 + 20  # 13-px table font, padding and border


def table_width(table) -> float:
    """Estimated min-content width (px) of a DataFrame or Styler as a notebook shows it: each
    column as wide as its longest unbreakable word (headers and cells wrap at spaces)."""
    df, hidden = _frame(table)
    idx = [] if hidden else [max([_cell_px(v, True) for v in map(str, df.index)] +
                                 [_cell_px(str(df.index.name or ""), True)])]
    cols = []
    for c in df.columns:
        head = " ".join(map(str, c)) if isinstance(c, tuple) else str(c)
        cols.append(max([_cell_px(head, True)] + [_cell_px(_fmt(v), True) for v in df[c].tolist()]))
    return float(sum(idx) + sum(cols))


def _frame(table):
    """(DataFrame, index hidden?) of a DataFrame or a pandas Styler."""
    import pandas as pd
    if isinstance(table, pd.DataFrame):
        return table, False
    return table.data, bool(getattr(table, "hide_index_", [False])[0])


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def table_problems(table, max_width: float = CONTENT_WIDTH) -> list[str]:
    """Problems of a table shown in a notebook: wider than a laptop screen, cells pandas would
    truncate (a DataFrame shows at most ``display.max_colwidth`` characters), paths of this machine."""
    import pandas as pd
    out = []
    w = table_width(table)
    if w > max_width:
        out.append(f"table needs about {w:.0f} px (> {max_width:.0f}): shorten or wrap its headers and cells")
    df, _ = _frame(table)
    limit = pd.get_option("display.max_colwidth")
    if isinstance(table, pd.DataFrame) and limit is not None:
        long = [c for c in df.columns if df[c].astype(str).str.len().max() > limit]
        if long:
            out.append(f"columns {long} hold text longer than pandas shows ({limit} characters): use a Styler")
    out += output_problems(df.to_string())
    return out


def output_problems(text: str) -> list[str]:
    """A path of this machine (home, /tmp, /work...) in an output: it says nothing to a reader."""
    return [f"output shows a path of this machine: {p}" for p in sorted(set(PATH_RE.findall(text or "")))]
