"""Static figure export that works offline: ``save_figure(fig, "fig.png")``.

``.png``, ``.svg``, ``.pdf`` and ``.jpg`` go through kaleido (>= 1.0), which drives a Chromium
already on the machine (``/usr/bin/chromium`` or ``$BROWSER_PATH``; kaleido downloads nothing
unless asked); ``.html`` embeds plotly.js, so the page opens without a network. The figure is
drawn at its own ``layout.width``/``height`` (the sizes ``paged.viz.sizing`` gave it) unless
``width``/``height`` are passed.
"""
from __future__ import annotations

import os
from pathlib import Path

import plotly.graph_objects as go

from paged.errors import ConfigError

__all__ = ["IMAGE_FORMATS", "save_figure"]

IMAGE_FORMATS = ("png", "svg", "pdf", "jpg", "jpeg", "webp")


def save_figure(fig: go.Figure, path: str | os.PathLike, *, width: int | None = None, height: int | None = None,
                scale: float = 2.0) -> Path:
    """Write ``fig`` to ``path`` (format from the suffix: an image format or ``.html``) and return
    the path; ``scale`` multiplies the pixels of raster images (2: sharp on slides)."""
    path = Path(path)
    suffix = path.suffix.lower().lstrip(".")
    if not path.parent.is_dir():
        raise ConfigError(f"save_figure: folder {path.parent} does not exist; create it first")
    if suffix == "html":
        fig.write_html(path, include_plotlyjs=True, full_html=True)
        return path
    if suffix not in IMAGE_FORMATS:
        raise ConfigError(f"save_figure: {path.name!r} has no known suffix; use .html or one of "
                          f"{', '.join('.' + f for f in IMAGE_FORMATS)}")
    try:
        import kaleido  # noqa: F401
    except ImportError:
        raise ConfigError("save_figure needs kaleido for images: pip install 'kaleido>=1.0' (it uses the "
                          "Chromium installed here), or save as .html") from None
    w = width or fig.layout.width or 900
    h = height or fig.layout.height or 500
    try:
        for attempt in range(3):
            try:
                fig.write_image(path, format=suffix, width=w, height=h, scale=scale)
                break
            except Exception as e:  # noqa: BLE001 - kaleido's own start-up race, retried; others re-raised
                # kaleido 1.x sometimes evaluates before its page script loaded ("kaleido_scopes is not
                # defined"), seen on a loaded 2-core machine; a fresh attempt then succeeds
                if "kaleido_scopes" not in str(e) or attempt == 2:
                    raise
    except (RuntimeError, OSError, ValueError) as e:
        if "chrom" in str(e).lower() or "browser" in str(e).lower():
            raise ConfigError(f"save_figure: kaleido found no Chromium ({e}); install one (apt install chromium) "
                              "or point $BROWSER_PATH at it; .html needs none") from e
        raise
    return path
