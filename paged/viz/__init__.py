"""paged.viz: the only place plotly and ipywidgets appear. Views read records and snapshots.

Three layers (each usable alone):

1. Runs (`paged.runs`) step the real engine or the simulator with one interface::

       from paged import runs
       llm = paged.LLM(num_blocks=48)                            # SmolLM2-135M, real kernels
       run = runs.Run(llm, runs.chat_workload(llm.tokenizer, 8, n=3))
       run = runs.Run(SimConfig(model="llama-2-70b", tensor_parallel=4), trace)
       row = run.step()        # dict of paged.telemetry STEP_COLUMNS (seconds)
       run.done, run.rows, run.events, run.snapshot(), run.request_rows(), run.tbt_samples()
       run.steps_frame(), run.requests_frame(), run.events_frame(), run.fresh(**changes)

2. Pure figures (`paged.viz.figures`, plotly `go.Figure`, unit-tested on data)::

       figures.block_grid(snap, cols=None, page=0, tokenizer=None, highlight=None)
       figures.block_tables(snap, max_requests=16, highlight=None)
       figures.contiguous_grid(contiguous_snap, cell_tokens=16)
       figures.usage_over_time(steps_df, contiguous=None)      # blocks vs tokens (+ counterfactual)
       figures.step_timeline(steps_df)                         # prefill/decode, step time, preempt/swap
       figures.latency_distributions({"label": (requests_df, tbt_samples)}), figures.latency_summary(...)
       figures.prefix_cache(steps_df, events_df), figures.block_lifetimes(events_df)

   `snap` is a `paged.core.snapshot.KVSnapshot` (`run.snapshot()` / `KVCacheManager.snapshot()`).

3. Live dashboards (`paged.viz.live`, `liveplot.LivePlot`s + an ipywidgets panel from `paged.viz.panels`)::

       dash = live.Dashboard(run, views=("grid", "tables", "usage", "timeline"), fps=15)
       dash                      # displays: panel (play/pause/step/reset/speed/settings) + figures
       dash.play()               # background asyncio task: controls respond while it runs
       dash.run_to_completion()  # blocking; draws frames at <= fps (for headless execution)
       dash.frames, dash.figures # frames drawn so far; {name: LivePlot}
       dash.select_block(b)      # what a click on block b does (highlight its table, show tokens)
       live.ReplayView(run)      # slider + Play over run.keep_snapshots(1) snapshots (ticks in the browser)

   Views: "grid", "tables", "usage", "timeline", "latency", "prefix". Frames are coalesced to at
   most `fps` per second whatever the step rate, and drawing is held to ~`draw_share` (10%) of the
   wall time; each frame is one `fig.batch_update()`; series come from ring buffers (arrays
   replaced, never appended). A grid-only dashboard reads just the page it draws
   (`snapshot(block_range=...)`), so pools of 100k+ blocks stay cheap.
   Clicking a block in the grid highlights its request's table and shows its tokens.
   Without ipywidgets/anywidget, `Dashboard` shows static figures and says so.

Study figures beside the three layers: `paged.viz.quant` (the KV-quantization study: pareto,
error_vs_context, survival_curves, layer_heatmap, key_outlier_heatmap, live_side_by_side) and one
module per study of `paged.studies` (budget, compaction, fragmentation, preemption, prefix, tiers):
each takes the frames a study returns and draws them; nothing here runs an executor (the studies
do; `tests/test_imports.py` checks it).

Readable by construction: `paged.viz.sizing` (px per heatmap row, integer ticks on counts,
label placement), `paged.viz.check` (`figure_problems(fig)`, `table_problems(df)`,
`output_problems(text)`: what tests and notebooks verify), `paged.viz.tables.fit_table(df)` (a
table that wraps instead of running off a laptop screen). Sentences from numbers:
`paged.viz.prose` (each notebook's run-dependent sentences, generated from its results as
Markdown). Controls beside the dashboards: `paged.viz.quant_panel.study_panel` (05: formats,
contexts, texts, run) and `paged.viz.scenarios.scenario_panel` (00: pick a scenario, watch it).

Replay (`paged.replay`): `save(run, path)`, `load(path)` -> `Recording` (same `rows`, `events`,
`snapshot(i)` as a run, deterministic), `to_chrome_trace(run_or_recording, path)` for ui.perfetto.dev.
"""
from __future__ import annotations

import importlib

__all__ = ["figures", "live", "panels"]


def __getattr__(name: str):
    if name in ("figures", "live", "panels"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
