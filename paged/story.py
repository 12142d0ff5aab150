"""The story of a run, from its records: its key moments and a short summary.

    moments = key_moments(run.steps_frame())      # one row per moment: step, kind, label
    text = summary(run.steps_frame(), run.requests_frame(), label="engine")   # a few sentences

Both read only the record schema (``paged.telemetry`` STEP_COLUMNS / REQUEST_COLUMNS), so they
work the same for the engine, the simulator, a replayed recording or any other source of rows.
A moment's ``step`` is the 1-based index of the step row in the frame (= the number of steps
done when it happened = the key of the snapshot a run keeps after that step).

Kinds, in the order a lecturer meets them: ``prefix_hit`` (the first prompt tokens served from
the prefix cache), ``cow`` (copy-on-write copies), ``preempt`` (recompute) / ``swap_out`` (swap
preemption), ``swap_in``, ``tier_out`` / ``tier_in`` (host tier), ``compaction``, ``peak``
(the highest block usage, first reached). Runs of consecutive steps of one kind are one moment
(its label gives the count), and at most ``per_kind`` moments of a kind are kept (the first ones).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["MOMENTS", "MomentKind", "key_moments", "summary"]


class MomentKind(NamedTuple):
    """How one kind of key moment is found, told and drawn (``paged.viz.story`` draws it)."""
    legend: str               # its name in a figure's legend
    symbol: str               # its plotly marker symbol
    colour: str
    column: str | None = None  # the step column whose value > 0 marks it (None: prefix_hit and peak)
    one: str = ""             # the counted noun, singular and plural
    many: str = ""


MOMENTS = {
    "prefix_hit": MomentKind("first prefix hit", "star", "#2ca25f"),
    "cow": MomentKind("copy-on-write", "diamond", "#e6550d", "num_block_copies", "copy-on-write", "copy-on-writes"),
    "preempt": MomentKind("preemption (recompute)", "x", "#d62728", "num_preempted", "preemption", "preemptions"),
    "swap_out": MomentKind("preemption (swap out)", "triangle-down", "#9467bd", "num_swapped_out_blocks",
                           "block swapped out", "blocks swapped out"),
    "swap_in": MomentKind("swap in", "triangle-up", "#9467bd", "num_swapped_in_blocks", "block swapped in",
                          "blocks swapped in"),
    "tier_out": MomentKind("to host tier", "triangle-down", "#8c564b", "num_tier_out_blocks",
                           "block moved to the host tier", "blocks moved to the host tier"),
    "tier_in": MomentKind("from host tier", "triangle-up", "#8c564b", "num_tier_in_blocks",
                          "block back from the host tier", "blocks back from the host tier"),
    "compaction": MomentKind("compaction", "square", "#17becf", "num_compaction_copies", "compaction copy",
                             "compaction copies"),
    "peak": MomentKind("peak usage", "circle-open", "#111111"),
}
"""Every kind of key moment, in display order: the one list (views style them, runs keep their snapshots)."""


def _count(n: int, kind: str) -> str:
    m = MOMENTS[kind]
    return f"{n} {m.one if n == 1 else m.many}"


def key_moments(steps: "pd.DataFrame", per_kind: int = 6) -> "pd.DataFrame":
    """The moments that matter in ``steps`` (columns ``step``, ``kind``, ``label``, ``last_step``),
    ordered by step. Swap preemptions are ``swap_out`` moments, not also ``preempt`` ones."""
    import numpy as np
    import pandas as pd

    rows: list[dict] = []
    n = len(steps)
    if n == 0:
        return pd.DataFrame(columns=["step", "kind", "label", "last_step"])
    idx = np.arange(1, n + 1)
    hits = steps["prefix_cache_hits"].to_numpy(float)
    first_hit = np.flatnonzero(np.diff(np.concatenate([[0.0], hits])) > 0)
    if len(first_hit):
        i = int(first_hit[0])
        rows.append(dict(step=int(idx[i]), kind="prefix_hit", last_step=int(idx[i]),
                         label=f"first prefix-cache hit: {int(hits[i])} prompt tokens served from cached blocks"))
    swapped = steps["num_swapped_out_blocks"].to_numpy(float) > 0
    for kind, m in MOMENTS.items():
        if m.column is None:
            continue
        v = steps[m.column].to_numpy(float)
        mark = v > 0
        if kind == "preempt":
            mark &= ~swapped  # a swap preemption is told as its swap-out
        starts = np.flatnonzero(mark & ~np.concatenate([[False], mark[:-1]]))
        for s in starts[:per_kind]:
            e = s
            while e + 1 < n and mark[e + 1]:
                e += 1
            total = int(v[s:e + 1].sum())
            where = f"step {idx[s]}" if e == s else f"steps {idx[s]}–{idx[e]}"
            rows.append(dict(step=int(idx[s]), kind=kind, last_step=int(idx[e]), label=f"{_count(total, kind)} ({where})"))
    usage = steps["kv_cache_usage_perc"].to_numpy(float)
    p = int(np.argmax(usage))
    if usage[p] > 0:
        rows.append(dict(step=int(idx[p]), kind="peak", last_step=int(idx[p]),
                         label=f"peak usage: {100 * usage[p]:.0f}% of the blocks ({int(steps['num_used_blocks'].iloc[p])} "
                               f"used, step {idx[p]})"))
    out = pd.DataFrame(rows, columns=["step", "kind", "label", "last_step"])
    order = {k: i for i, k in enumerate(MOMENTS)}
    return out.sort_values(["step", "kind"], key=lambda c: c.map(order) if c.name == "kind" else c,
                           kind="stable").reset_index(drop=True)


def _ms(x: float) -> str:
    return f"{1e3 * x:,.0f} ms" if x < 10 else f"{x:,.1f} s"


def summary(steps: "pd.DataFrame", requests: "pd.DataFrame | None" = None, label: str = "run") -> list[str]:
    """A few plain sentences about a run, each computed from the records (no number is typed in)."""
    import numpy as np

    out: list[str] = []
    n = len(steps)
    if n == 0:
        return [f"The {label} has not run a step yet."]
    clock = float(steps["time_s"].iloc[-1] + steps["step_time_s"].iloc[-1] - steps["time_s"].iloc[0])
    busy = float(steps["step_time_s"].sum())
    done = int(steps["num_finished"].sum())
    out.append(f"{done} request{'s' if done != 1 else ''} finished in {n} steps, {_ms(busy)} of step time "
               f"({_ms(clock)} on the {label}'s clock).")
    usage = steps["kv_cache_usage_perc"].to_numpy(float)
    p = int(np.argmax(usage))
    total_blocks = int(steps["num_used_blocks"].iloc[p] + steps["num_free_blocks"].iloc[p]
                       + steps["num_cached_free_blocks"].iloc[p])
    tok = steps["token_usage"].to_numpy(float)
    used = usage > 0
    frag = f"; the used blocks held tokens in {100 * float(np.mean(tok[used])):.0f}% of their slots on average" if used.any() else ""
    out.append(f"Block usage peaked at {100 * usage[p]:.0f}% of {total_blocks} blocks at step {p + 1}{frag}.")
    q, h = float(steps["prefix_cache_queries"].iloc[-1]), float(steps["prefix_cache_hits"].iloc[-1])
    if q > 0:
        out.append(f"The prefix cache served {int(h):,} of {int(q):,} prompt tokens ({100 * h / q:.0f}%).")
    pre = int(steps["num_preempted"].sum())
    cow = int(steps["num_block_copies"].sum())
    parts = []
    if cow:
        parts.append(_count(cow, "cow"))
    if pre:
        sw = int(steps["num_swapped_out_blocks"].sum())
        parts.append(_count(pre, "preempt") + (f" ({_count(sw, 'swap_out')})" if sw else " (recompute)"))
    comp = int(steps["num_compaction_copies"].sum())
    if comp:
        parts.append(_count(comp, "compaction"))
    tier = int(steps["num_tier_out_blocks"].sum() + steps["num_tier_in_blocks"].sum())
    if tier:
        parts.append(f"{tier} host-tier block moves")
    if parts:
        out.append("Memory events: " + ", ".join(parts) + ".")
    if requests is not None and len(requests):
        ttft = requests["ttft_s"].to_numpy(float)
        ttft = ttft[~np.isnan(ttft)]
        if len(ttft):
            out.append(f"Time to first token: median {_ms(float(np.median(ttft)))}, worst {_ms(float(ttft.max()))} "
                       f"(executor time: pauses of the view are not counted).")
    return out
