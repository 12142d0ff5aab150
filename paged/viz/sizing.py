"""Sizes and axes that make a figure readable by construction (what `tests/figure_check.py` verifies).

Numbers a builder needs to size a figure from its content, so no figure is a 1-px line or a
1,000-px empty grid:

- `ROW_PX`: the height of one heatmap row (at least 12 px: a label and a colour both fit);
- `heatmap_height(rows)`: the figure height that gives `rows` rows `ROW_PX` each, plus margins
  and room for a colour bar (`MIN_COLORBAR_PX`);
- `count_axis(max_value)`: axis properties for counted things (blocks, tokens, requests, steps):
  integer ticks only, whether the data are known now (a fixed integer ``dtick``) or arrive later
  in a live view (the range always includes 0..10, where plotly's own ticks are integers);
- `CONTENT_WIDTH`: what a notebook output gets on a 1366-px laptop screen, the width tables
  and titles must fit (`paged.viz.tables.fit_table`);
- `styled(fig, title, height, ...)`: the layout the study figures share (title, axis titles,
  height, margins, a horizontal legend), set in one call.
"""
from __future__ import annotations

import math

ROW_PX = 22            # px per heatmap row (>= MIN_ROW_PX with room for a label)
MIN_ROW_PX = 12        # below this, labels are skipped and rows blur together
MIN_HEIGHT = 160       # no figure is shorter
MIN_COLORBAR_PX = 110  # a colour bar shorter than this overprints its tick labels
CONTENT_WIDTH = 950    # px of a notebook output on a 1366-px screen with JupyterLab's file browser open
INTEGER_SPAN = 10      # plotly's automatic ticks are integers on a span of at least this


def heatmap_height(rows: int, *, row_px: int = ROW_PX, top: int = 50, bottom: int = 50,
                   colorbar: bool = False) -> int:
    """Figure height for a heatmap of `rows` rows of `row_px` px between margins `top`/`bottom`;
    with `colorbar`, at least tall enough for a legible colour bar."""
    plot = max(max(rows, 1) * row_px, MIN_COLORBAR_PX if colorbar else 0)
    return max(MIN_HEIGHT, plot + top + bottom)


def nice_step(span: float, ticks: int = 8) -> int:
    """An integer tick step (1, 2, 5 x 10^k) that puts at most about `ticks` ticks on `span`."""
    if span <= ticks:
        return 1
    raw = span / ticks
    base = 10 ** math.floor(math.log10(raw))
    return int(next((m * base for m in (1, 2, 5) if m * base >= raw), 10 * base))


def count_axis(max_value: float | None = None, *, ticks: int = 8) -> dict:
    """Axis properties for a count (blocks, tokens, requests, steps): integer ticks only.
    `max_value` known (a static figure): a fixed integer step from 0. Unknown or still growing
    (a live view, `None`): the autorange always includes 0..INTEGER_SPAN, where plotly's own
    tick steps are whole numbers, so no 0.5 or 0.383 ever shows."""
    if max_value is None or not math.isfinite(max_value):
        return dict(rangemode="tozero", autorangeoptions=dict(include=[0, INTEGER_SPAN]), tickformat=",d")
    return dict(rangemode="tozero", tick0=0, dtick=nice_step(max(float(max_value), 1.0), ticks), tickformat=",d")


def styled(fig, title: str, height: int, *, x: str | None = None, y: str | None = None,
           legend_y: float | None = None, margin: tuple[int, int, int, int] | None = (60, 20, 50, 50), **layout):
    """`fig` with a title, axis titles `x`/`y`, a height, margins (left, right, top, bottom px; None:
    plotly's) and, with `legend_y`, a horizontal legend at that height; `layout`: any other layout keys."""
    if x is not None:
        layout["xaxis_title"] = x
    if y is not None:
        layout["yaxis_title"] = y
    if legend_y is not None:
        layout["legend"] = dict(orientation="h", y=legend_y)
    if margin is not None:
        layout["margin"] = dict(zip("lrtb", margin))
    return fig.update_layout(title=title, height=height, **layout)


POSITIONS = ("top center", "bottom center", "middle right", "middle left", "top right", "bottom left",
             "top left", "bottom right")
TEXT_PX, CHAR_EM = 12, 0.58  # plotly's default text size and the width of an average character (em)


def _box(px: float, py: float, text: str, pos: str) -> tuple[float, float, float, float]:
    w, h = len(text) * TEXT_PX * CHAR_EM, TEXT_PX * 1.3
    cx = px + (w / 2 + 5 if "right" in pos else -w / 2 - 5 if "left" in pos else 0)
    cy = py + (h / 2 + 5 if "top" in pos else -h / 2 - 5 if "bottom" in pos else 0)
    return cx - w / 2, cx + w / 2, cy - h / 2, cy + h / 2


def label_positions(x, y, texts=None, *, log_x: bool = False, log_y: bool = False, width: float = 800,
                    height: float = 270) -> list[str]:
    """A text position per point such that, on a plot area of `width` x `height` px, no label
    box overlaps another label or a marker (greedy, in point order; when every position
    collides, the one overlapping least). `texts` default to equal-width labels."""
    import numpy as np
    xs = np.log10(np.maximum(np.asarray(x, float), 1e-300)) if log_x else np.asarray(x, float)
    ys = np.log10(np.maximum(np.asarray(y, float), 1e-300)) if log_y else np.asarray(y, float)
    if not len(xs):
        return []
    texts = [str(t) for t in texts] if texts is not None else ["label"] * len(xs)
    px = (xs - xs.min()) / (float(np.ptp(xs)) or 1.0) * width * 0.9 + width * 0.05
    py = (ys - ys.min()) / (float(np.ptp(ys)) or 1.0) * height * 0.9 + height * 0.05
    marks = [(a - 4, a + 4, b - 4, b + 4) for a, b in zip(px, py)]
    placed: list[tuple[float, float, float, float]] = []
    out: list[str] = []

    def overlap(a, b) -> float:
        return max(0.0, min(a[1], b[1]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[2], b[2]))

    for i in range(len(xs)):
        best, cost = POSITIONS[0], float("inf")
        for pos in POSITIONS:
            b = _box(px[i], py[i], texts[i], pos)
            c = sum(overlap(b, o) for o in placed) + sum(overlap(b, m) for j, m in enumerate(marks) if j != i)
            c += max(0.0, b[1] - width) * 20 + max(0.0, -b[0]) * 20  # off the plot's sides
            if c < cost:
                best, cost = pos, c
            if c == 0:
                break
        out.append(best)
        placed.append(_box(px[i], py[i], texts[i], best))
    return out


__all__ = ["CONTENT_WIDTH", "POSITIONS", "label_positions", "INTEGER_SPAN", "MIN_COLORBAR_PX", "MIN_HEIGHT", "MIN_ROW_PX", "ROW_PX", "count_axis",
           "heatmap_height", "nice_step", "styled"]
