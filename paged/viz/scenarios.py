"""A scenario picker for the tour (notebook 00): choose a mechanism, press run, watch it live.

``scenario_panel(run)``: each press builds a fresh run (`paged.studies.tour.scenario_run`, same
loaded model) and a `paged.viz.live.Dashboard` over it, replacing the previous one, and plays it in
the background (the kernel stays responsive). Without widgets it says so and shows nothing else.
"""
from __future__ import annotations

import html

from paged.studies.tour import SCENARIOS, scenario_run

__all__ = ["ScenarioPanel", "scenario_panel"]


class ScenarioPanel:
    """Dropdown + description + run button over an Output that holds the chosen scenario's dashboard."""

    def __init__(self, run, scenario: str = "chat", autoplay: bool = True) -> None:
        import ipywidgets as W
        if scenario not in SCENARIOS:
            from paged.errors import ConfigError
            raise ConfigError(f"unknown scenario {scenario!r}; choose one of {sorted(SCENARIOS)}")
        self.base, self.autoplay, self.dash = run, autoplay, None
        self.choice = W.Dropdown(options=list(SCENARIOS), value=scenario, description="scenario")
        self.about = W.HTML()
        self.button = W.Button(description="run this scenario", icon="play", button_style="primary")
        self.out = W.Output()
        self.choice.observe(lambda _: self._describe(), "value")
        self.button.on_click(lambda _: self.start())
        self._describe()
        self.widget = W.VBox([W.HBox([self.choice, self.button]), self.about, self.out])

    def _describe(self) -> None:
        self.about.value = f"<i>{html.escape(SCENARIOS[self.choice.value].description)}</i>"

    def start(self):
        """Build and show the chosen scenario's dashboard (and play it unless autoplay is off)."""
        from IPython.display import display

        from .live import Dashboard
        if self.dash is not None:
            self.dash.pause()
        name = self.choice.value
        self.dash = Dashboard(scenario_run(self.base, name), views=SCENARIOS[name].views, title=f"scenario: {name}")
        self.out.clear_output()
        with self.out:
            display(self.dash)
        if self.autoplay:
            self.dash.play()
        return self.dash

    def _ipython_display_(self) -> None:
        from IPython.display import display
        display(self.widget)


def scenario_panel(run, scenario: str = "chat", autoplay: bool = True):
    """A `ScenarioPanel` over `run`'s loaded model (a `paged.runs.Run`)."""
    from .buffers import widgets_available
    reason = widgets_available()
    if reason is not None:
        from IPython.display import HTML
        return HTML(f"<p>The scenario picker needs ipywidgets and anywidget ({html.escape(reason)}).</p>")
    return ScenarioPanel(run, scenario, autoplay)
