"""The control panel of a live dashboard: play / pause / step / reset, speed, settings.

`ControlPanel(dash)` holds no run state: cache settings (EngineConfig / SimConfig field names) and
workload settings apply on Reset, which builds a fresh run with them; speed applies at once.
"""
from __future__ import annotations

from typing import Any

import anywidget
import ipywidgets as W
import traitlets

TOKENS_HINT = "<i>click a block to see its request and tokens</i>"


class ScrollAnchor(anywidget.AnyWidget):
    """An invisible mark at the top of a dashboard: each increment of ``scroll`` scrolls it to the top of
    the view (Run All brings a starting run's dashboard in) and holds it there while the dashboard renders,
    until the person scrolls. The page records the requests it carried out (``scrolled``), so a view that
    renders after the run began (a busy page, a Voilà page still arriving) still scrolls, once."""

    _esm = """
    const HOLD_MS = 30000;  // keep the mark at the top while the dashboard below it renders
    function hold(el) {
      // The browser's scroll anchoring keeps whatever node it picked in place as content above it grows:
      // a dashboard rendering under the mark would push itself out of view. Re-align on every frame for a
      // while, and stop at once when the person scrolls or types.
      const until = performance.now() + HOLD_MS;
      let stopped = false;
      const stop = () => { stopped = true; };
      const events = ["wheel", "touchstart", "keydown", "mousedown"];
      events.forEach((e) => window.addEventListener(e, stop, { once: true, passive: true, capture: true }));
      const tick = () => {
        if (stopped || performance.now() > until || !el.isConnected) {
          events.forEach((e) => window.removeEventListener(e, stop, { capture: true }));
          return;
        }
        if (Math.abs(el.getBoundingClientRect().top) > 2) el.scrollIntoView({ block: "start" });
        requestAnimationFrame(tick);
      };
      el.scrollIntoView({ block: "start" });
      requestAnimationFrame(tick);
    }
    function render({ model, el }) {
      el.style.cssText = "height:0;margin:0;padding:0";
      const go = () => {
        if (model.get("scroll") > model.get("scrolled")) {
          model.set("scrolled", model.get("scroll")); model.save_changes();
          setTimeout(() => hold(el), 0);
        }
      };
      model.on("change:scroll", go);
      go();
      return () => model.off("change:scroll", go);
    }
    export default { render };
    """
    scroll = traitlets.Int(0).tag(sync=True)
    scrolled = traitlets.Int(0).tag(sync=True)

# name -> (widget kind, options); the dashboard shows those its run has
CACHE_SETTINGS: dict[str, tuple[str, Any]] = {
    "num_blocks": ("int", (4, 512, 4)),
    "block_size": ("choice", (4, 8, 16, 32)),
    "enable_prefix_caching": ("bool", None),
    "enable_chunked_prefill": ("bool", None),
    "max_num_batched_tokens": ("int", (16, 2048, 16)),
    "max_num_seqs": ("int", (1, 64, 1)),
    "preemption_mode": ("choice", ("recompute", "swap")),
    "enable_host_tier": ("bool", None),
    "host_tier_threshold": ("choice", (1.0, 0.9, 0.7, 0.5)),
    "enable_block_compaction": ("bool", None),
    "swap_mode": ("choice", ("sync", "overlap")),
    "swap_compression": ("choice", (None, "fp8", "int4")),
}
WORKLOAD_SETTINGS: dict[str, tuple[int, int]] = {
    "num_requests": (1, 32), "n": (1, 8), "max_tokens": (4, 128), "arrive_every": (0, 16),
    "num_decoders": (1, 16), "decode_tokens": (8, 256), "num_long": (0, 8), "long_prompt_tokens": (32, 1024),
    "long_every": (1, 64),
}


def _widget(name: str, value: Any) -> W.Widget:
    kind, opts = CACHE_SETTINGS.get(name, ("int", None))
    style = {"description_width": "initial"}
    if kind == "bool":
        return W.Checkbox(value=bool(value), description=name, style=style, indent=False)
    if kind == "choice":
        options = list(opts) if value in opts else [value, *opts]
        return W.Dropdown(options=options, value=value, description=name, style=style)
    lo, hi, step = opts if opts else (*WORKLOAD_SETTINGS.get(name, (0, max(1, 4 * int(value)))), 1)
    return W.IntSlider(value=int(value), min=lo, max=max(hi, int(value)), step=step, description=name,
                       style=style, continuous_update=False)


class ControlPanel:
    """Buttons and settings for `dash`; `.widget` is the box to display."""

    def __init__(self, dash, settings: dict[str, Any] | None = None, workload: dict[str, Any] | None = None) -> None:
        self.dash = dash
        self.play = W.ToggleButton(value=False, description="play", icon="play", tooltip="run in the background")
        self.step = W.Button(description="step", icon="step-forward", tooltip="one engine step")
        self.reset = W.Button(description="reset", icon="refresh", tooltip="a fresh run with the settings below")
        self.speed = W.FloatLogSlider(value=dash.steps_per_second or 1000.0, base=10, min=-0.5, max=3,
                                      description="steps/s", continuous_update=False,
                                      tooltip="1000 = as fast as the executor goes")
        self.status = W.HTML()
        self.tokens = W.HTML(value=TOKENS_HINT)
        self.settings = {k: _widget(k, v) for k, v in (settings or {}).items()}
        self.workload = {k: _widget(k, v) for k, v in (workload or {}).items() if isinstance(v, int)}
        self.play.observe(self._on_play, "value")
        self.step.on_click(lambda _: dash.step_once(draw=True))
        self.reset.on_click(lambda _: dash.reset(**self.values()))
        self.speed.observe(lambda ch: dash.set_speed(ch["new"]), "value")
        rows = [W.HBox([self.play, self.step, self.reset, self.speed]), self.status]
        extra = list(self.settings.values()) + list(self.workload.values())
        if extra:
            acc = W.Accordion(children=[W.GridBox(extra, layout=W.Layout(
                grid_template_columns="repeat(3, 330px)"))])
            acc.set_title(0, "cache, scheduler and workload settings (apply on reset)")
            rows.append(acc)
        rows.append(self.tokens)
        self.widget = W.VBox(rows)

    def _on_play(self, change) -> None:
        self.play.description = self.play.icon = "pause" if change["new"] else "play"
        (self.dash.play if change["new"] else self.dash.pause)()

    def values(self) -> dict[str, Any]:
        out = {k: w.value for k, w in self.settings.items()}
        if self.workload:
            out["workload"] = {k: w.value for k, w in self.workload.items()}
        return out

    def stopped(self) -> None:
        """The run paused or ended: show the play button again (no callback loop)."""
        if self.play.value:
            self.play.unobserve(self._on_play, "value")
            self.play.value, self.play.description, self.play.icon = False, "play", "play"
            self.play.observe(self._on_play, "value")

    def clear_tokens(self) -> None:
        """Forget the block shown under the panel (a reset starts a new run)."""
        self.tokens.value = TOKENS_HINT
