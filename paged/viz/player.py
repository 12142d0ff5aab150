"""Player: a play/pause button and a step slider that tick in the browser.

The timer runs in the page, so a replay keeps moving after the notebook finished and on a Voilà
page. Unlike ``ipywidgets.Play`` (whose timer starts only when ``playing`` *changes* in a rendered
view, so ``Play(playing=True)`` never moves), ``autoplay`` starts this one when a view first
renders. The kernel reads and writes ``value``; moving the slider by hand pauses the player.

Invariants: one timer per widget model whatever the number of views; ``min <= value <= max``.
"""
from __future__ import annotations

import anywidget
import traitlets

__all__ = ["Player"]

_ESM = r"""
const timers = new Map();   // model -> timer id: one timer per model, however many views
const started = new WeakSet();
function halt(model) { clearInterval(timers.get(model)); timers.delete(model); }
function stop(model) {
  halt(model);
  if (model.get("playing")) { model.set("playing", false); model.save_changes(); }
}
function start(model) {
  if (timers.has(model)) return;
  if (model.get("value") >= model.get("max")) { model.set("value", model.get("min")); }
  model.set("playing", true); model.save_changes();
  timers.set(model, setInterval(() => {
    let v = model.get("value") + 1;
    if (v > model.get("max")) {
      if (!model.get("repeat")) { stop(model); return; }
      v = model.get("min");
    }
    model.set("value", v); model.save_changes();
  }, Math.max(30, model.get("interval_ms"))));
}
function render({ model, el }) {
  const box = document.createElement("div");
  box.style.cssText = "display:flex;align-items:center;gap:10px;font:13px sans-serif;margin:4px 0";
  const btn = document.createElement("button");
  btn.className = "jupyter-button paged-player-button";
  btn.style.cssText = "min-width:84px";
  const range = document.createElement("input");
  range.type = "range"; range.className = "paged-player-slider"; range.style.cssText = "flex:1;max-width:560px";
  const label = document.createElement("span");
  label.className = "paged-player-label";
  box.append(btn, range, label);
  el.appendChild(box);
  const show = () => {
    range.min = model.get("min"); range.max = model.get("max"); range.value = model.get("value");
    btn.textContent = model.get("playing") ? "⏸ pause" : "▶ replay";
    label.textContent = `${model.get("label")} ${model.get("value")} / ${model.get("max")}`;
  };
  btn.onclick = () => (timers.has(model) ? stop(model) : start(model));
  range.oninput = () => { stop(model); model.set("value", Number(range.value)); model.save_changes(); };
  const onPlaying = () => { if (!model.get("playing")) halt(model); };  // the kernel paused it
  model.on("change", show);
  model.on("change:playing", onPlaying);
  show();
  if (model.get("autoplay") && !started.has(model)) { started.add(model); start(model); }
  return () => { model.off("change", show); model.off("change:playing", onPlaying); };
}
export default { render };
"""


class Player(anywidget.AnyWidget):
    """``Player(min=1, max=n, interval_ms=250, autoplay=True)``; observe ``value`` in the kernel."""

    _esm = _ESM
    value = traitlets.Int(0).tag(sync=True)
    min = traitlets.Int(0).tag(sync=True)
    max = traitlets.Int(0).tag(sync=True)
    interval_ms = traitlets.Int(250).tag(sync=True)
    playing = traitlets.Bool(False).tag(sync=True)
    autoplay = traitlets.Bool(True).tag(sync=True)
    repeat = traitlets.Bool(True).tag(sync=True)
    label = traitlets.Unicode("step").tag(sync=True)

    @traitlets.validate("value")
    def _clip(self, proposal):
        return max(self.min, min(self.max, int(proposal["value"])))
