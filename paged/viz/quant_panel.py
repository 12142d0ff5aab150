"""The control panels of notebook 05: pick KV formats, context lengths and texts, press run; and
serve one format beside fp32 and generate with both.

    panel = StudyPanel(lm, formats=[...], contexts=(512,), sources=("kjv", "python", "licenses"))
    panel.run()     # what the button does: paged.quant.study with the chosen settings
    panel           # displays the controls, then the table, two sentences and the Pareto figure
    panel.df        # the last study's table
    chat = ChatPanel(lm, ["kvq3", "int8"], prompt="...")   # a format picker, a prompt, a generate button
    chat.run()      # both engines generate greedily in lockstep; the view updates after every step

The panel holds no study logic: `run` calls :func:`paged.quant.study` and draws its table with
:func:`paged.viz.tables.fit_table`, :func:`paged.viz.quant.pareto` and the sentences of
:mod:`paged.viz.prose`. A run blocks the kernel for its duration (seconds per format and context
on a CPU at 512 tokens); the status line says what runs and how long the last run took.
"""
from __future__ import annotations

import html
import time
from typing import Sequence

import plotly.graph_objects as go

from paged.errors import ConfigError

__all__ = ["CONTEXT_CHOICES", "ChatPanel", "StudyPanel", "chat_panel", "study_panel"]

CONTEXT_CHOICES = (64, 128, 256, 512, 1024, 2048, 4096)
TABLE_COLUMNS = ["context_length", "format", "bits_per_value", "tokens_per_gib", "kld_mean", "kld_p99", "delta_nll",
                 "same_top1_pct", "first_div_median"]


class StudyPanel:
    """ipywidgets over :func:`paged.quant.study` (formats, contexts, texts, chunks; a run button)."""

    def __init__(self, lm, formats: Sequence[str], contexts: Sequence[int] = (512,),
                 sources: Sequence[str] | None = None, max_chunks: int | None = 1, divergence_tokens: int = 32) -> None:
        import ipywidgets as W

        from paged.quant import DEFAULT_SCHEMES, SOURCES
        sources = list(SOURCES) if sources is None else list(sources)
        bad = [s for s in sources if s not in SOURCES]
        if bad:
            raise ConfigError(f"unknown text source(s) {bad}; choose from {list(SOURCES)}")
        self.lm, self.df, self.divergence_tokens = lm, None, divergence_tokens
        options = list(dict.fromkeys([*DEFAULT_SCHEMES, *formats]))
        style = {"description_width": "initial"}
        self.formats = W.SelectMultiple(options=options, value=tuple(formats), rows=8, description="formats",
                                        style=style, layout=W.Layout(width="260px"))
        self.contexts = W.SelectMultiple(options=list(dict.fromkeys([*CONTEXT_CHOICES, *contexts])),
                                         value=tuple(contexts), rows=7, description="context (tokens)", style=style,
                                         layout=W.Layout(width="220px"))
        self.sources = W.SelectMultiple(options=list(SOURCES), value=tuple(sources), rows=3, description="texts",
                                        style=style, layout=W.Layout(width="220px"))
        self.chunks = W.BoundedIntText(value=max_chunks or 0, min=0, max=16, description="chunks per text (0 = all)",
                                       style=style, layout=W.Layout(width="220px"))
        self.button = W.Button(description="run the study", icon="play", button_style="primary")
        self.status = W.HTML("<i>choose formats, context lengths and texts, then press <b>run the study</b> "
                             "(Ctrl/Shift-click to pick several)</i>")
        self.out = W.Output()  # the table and the sentences
        from .liveplot import LivePlot  # the Pareto figure, redrawn in place (a plotly output inside an
        self.plot = LivePlot(go.Figure().update_layout(height=450))  # Output widget rendered out of order)
        self.button.on_click(lambda _: self.run())
        self.widget = W.VBox([W.HBox([self.formats, self.contexts, W.VBox([self.sources, self.chunks, self.button])]),
                              self.status, self.out, self.plot])

    def settings(self) -> dict:
        """The study's keyword arguments from the controls (a clear error when a choice is empty)."""
        if not self.formats.value or not self.contexts.value or not self.sources.value:
            raise ConfigError("pick at least one format, one context length and one text")
        return dict(formats=list(self.formats.value), context_lengths=tuple(sorted(self.contexts.value)),
                    sources=list(self.sources.value), max_chunks=self.chunks.value or None)

    def run(self):
        """Run the study with the controls' settings; show and return its table."""
        from paged import quant

        from . import prose
        from .quant import pareto
        from .tables import fit_table
        try:
            s = self.settings()
        except ConfigError as exc:
            self.status.value = f"<b style='color:#b00'>{html.escape(str(exc))}</b>"
            return self.df
        what = (f"{len(s['formats'])} format(s) × {len(s['context_lengths'])} context length(s) on "
                f"{', '.join(s['sources'])}")
        self.status.value = f"<i>running {html.escape(what)}...</i>"
        self.button.disabled = True
        t0 = time.perf_counter()
        try:
            self.df = quant.study(self.lm, formats=s["formats"], texts=quant.load_texts(s["sources"]),
                                  context_lengths=s["context_lengths"], max_chunks=s["max_chunks"],
                                  divergence_tokens=self.divergence_tokens, progress=False)
        finally:
            self.button.disabled = False
        self.status.value = f"{html.escape(what)}: done in {time.perf_counter() - t0:.0f} s"
        d = prose.all_rows(self.df)
        self.out.outputs = ()
        for shown in (fit_table(d, [c for c in TABLE_COLUMNS if c in d.columns]), prose.format_errors(self.df),
                      prose.context_trend(self.df)):
            self.out.append_display_data(shown)
        self.plot.replace_figure(pareto(self.df))
        return self.df

    def _ipython_display_(self) -> None:
        from IPython.display import display
        display(self.widget)


def study_panel(lm, formats: Sequence[str], contexts: Sequence[int] = (512,), sources: Sequence[str] | None = None,
                max_chunks: int | None = 1, divergence_tokens: int = 32, run: bool = True) -> StudyPanel:
    """A `StudyPanel`, already run once with these settings when `run` (so Run All shows results)."""
    panel = StudyPanel(lm, formats, contexts, sources, max_chunks, divergence_tokens)
    if run:
        panel.run()
    return panel


class ChatPanel:
    """ipywidgets over :func:`paged.studies.kv_formats.side_by_side`: the real engine serves
    ``base`` and the picked format (``paged.quant.engine_settings`` spells each for ``paged.LLM``),
    both generate the prompt greedily in lockstep, and the text after their first disagreement is
    highlighted. A format the engine cannot serve shows its error in the status line."""

    def __init__(self, lm, formats: Sequence[str], prompt: str, max_tokens: int = 40, base: str = "fp32") -> None:
        import ipywidgets as W
        if not formats:
            raise ConfigError("ChatPanel needs at least one format to serve beside the base")
        self.lm, self.base, self.df = lm, base, None
        style = {"description_width": "initial"}
        self.format = W.Dropdown(options=list(formats), value=formats[0], description=f"serve beside {base}",
                                 style=style, layout=W.Layout(width="320px"))
        self.prompt = W.Textarea(value=prompt, description="prompt", style=style, layout=W.Layout(width="600px"))
        self.tokens = W.BoundedIntText(value=max_tokens, min=1, max=256, description="tokens", style=style,
                                       layout=W.Layout(width="160px"))
        self.button = W.Button(description="generate", icon="play", button_style="primary")
        self.status = W.HTML("<i>pick a format and press <b>generate</b></i>")
        self.view = W.HTML()
        self.button.on_click(lambda _: self.run())
        self.widget = W.VBox([W.HBox([self.format, self.tokens, self.button]), self.prompt, self.status, self.view])

    def run(self):
        """Generate with both formats; show the texts as they grow; return the side-by-side table."""
        from paged.errors import PagedError
        from paged.studies.kv_formats import side_by_side

        from .quant import render
        formats = (self.base, self.format.value)
        self.status.value = f"<i>serving {html.escape(' and '.join(formats))}...</i>"
        self.button.disabled = True

        def update(fmts, texts, toks) -> None:
            self.view.value = render(fmts, texts, toks, self.lm.tokenizer)
        t0 = time.perf_counter()
        try:
            self.df = side_by_side(self.prompt.value, formats, self.tokens.value, model=self.lm, on_token=update)
        except PagedError as exc:
            self.status.value = f"<b style='color:#b00'>{html.escape(str(exc))}</b>"
            return self.df
        finally:
            self.button.disabled = False
        first = int(self.df["first_divergence"].iloc[0])
        n = int(self.df["num_tokens"].min())
        same = "identical" if first >= n else f"the same for {first} of {n} tokens"
        speed = ", ".join(f"{html.escape(f)} {r:.1f} tokens/s" for f, r in
                          zip(self.df["format"], self.df["decode_tokens_per_s"]))
        self.status.value = (f"{html.escape(' vs '.join(formats))}: {same}; decode {speed} "
                             f"({time.perf_counter() - t0:.1f} s for both engines)")
        return self.df

    def _ipython_display_(self) -> None:
        from IPython.display import display
        display(self.widget)


def chat_panel(lm, formats: Sequence[str], prompt: str, max_tokens: int = 40, base: str = "fp32",
               run: bool = True) -> ChatPanel:
    """A `ChatPanel`, already run once with its first format when `run` (so Run All shows a result)."""
    panel = ChatPanel(lm, formats, prompt, max_tokens, base)
    if run:
        panel.run()
    return panel
