"""Sentences from numbers: what a notebook says about a run, generated from that run's results.

Every function takes the frames a study or a run returns and returns an ``IPython.display.Markdown``
(``.data`` is the text) whose numbers and directions ("falls", "rises", "n − 1 copies") are
computed from those frames, so the prose cannot contradict the outputs above it, at any
parameters. Nothing here runs an executor.

By subject (any notebook, study or report may use any of them):

- latency: ``latency_change(summary, "no chunking", "chunked")`` (TTFT/TBT p50/p99/max, before -> after)
- the pool: ``pool_usage(steps, num_blocks)``; ``copy_on_write(steps, n)`` (CoW copies of an
  n-sample request); ``shared_blocks(run)`` (blocks held by several requests at once)
- KV formats: ``format_memory(describe_formats(...))`` (tokens per GiB against fp16);
  ``format_errors(study_df)``, ``context_trend(study_df)``; ``front_goals(front, llamacpp)``
- fragmentation: ``paper_gap(token_share_table)``, ``engine_shares(table)``
- prefix caching: ``eviction(sweep)``, ``collision(table)``
- preemption and swap: ``preemption_modes(table)``, ``swap_cost(costs)``, ``swap_error_verdict(...)``
- host tier, sharing, compaction: ``tier_verdict(tiers)``, ``sharing_memory(sharing)``,
  ``compaction_verdict(verdict_dict)``
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import pandas as pd

__all__ = ["bullet", "change", "collision", "compaction_verdict", "engine_shares", "eviction", "context_trend", "copy_on_write", "format_errors", "format_memory", "front_goals",
           "latency_change", "md", "paper_gap", "pool_usage", "sharing_memory", "swap_error_verdict", "tier_verdict", "preemption_modes", "shared_blocks", "swap_cost", "times"]

SAME = 0.03  # a relative change below 3% reads as "about the same"


def md(text: str):
    """Text as an IPython Markdown object (a plain str where IPython is missing)."""
    try:
        from IPython.display import Markdown
    except ImportError:  # pragma: no cover - IPython ships with the notebook extras
        return text
    return Markdown(text)


def ms(v: float) -> str:
    """Milliseconds as a reader wants them: '722 ms', '3.3 s', '25.8 s', '0.41 ms'."""
    if not math.isfinite(v):
        return "–"
    if abs(v) >= 1000:
        return f"{v / 1000:,.1f} s"
    if abs(v) >= 10:
        return f"{v:,.0f} ms"
    return f"{v:.2g} ms" if abs(v) < 1 else f"{v:.1f} ms"


def times(ratio: float) -> str:
    """A ratio as '3.2×' (two significant digits; '1.02×' near 1)."""
    return f"{ratio:.2f}×" if 0.9 < ratio < 1.1 else f"{ratio:.2g}×" if ratio < 10 else f"{ratio:,.0f}×"


def change(before: float, after: float, fmt=ms, same: float = SAME) -> str:
    """'falls from A to B', 'rises from A to B' or 'stays at about A (B)' by the relative change."""
    if not (math.isfinite(before) and math.isfinite(after)):
        return f"goes from {fmt(before)} to {fmt(after)}"
    if abs(after - before) <= same * max(abs(before), abs(after), 1e-12):
        return f"stays at about {fmt(before)} ({fmt(after)})"
    return f"{'falls' if after < before else 'rises'} from {fmt(before)} to {fmt(after)}"


def latency_change(summary: pd.DataFrame, before: str, after: str, label: str | None = None):
    """One paragraph on how TTFT and TBT moved between two rows of `figures.latency_summary`."""
    a, b = summary.loc[before], summary.loc[after]
    lead = f"**{label or after}** against **{before}**"
    return md(f"{lead}: TTFT p50 {change(a['ttft_p50_ms'], b['ttft_p50_ms'])} and p99 "
              f"{change(a['ttft_p99_ms'], b['ttft_p99_ms'])}; TBT p50 {change(a['tbt_p50_ms'], b['tbt_p50_ms'])}, "
              f"p99 {change(a['tbt_p99_ms'], b['tbt_p99_ms'])}, and the longest gap between two tokens "
              f"{change(a['tbt_max_ms'], b['tbt_max_ms'])}.")


def pool_usage(steps: pd.DataFrame, num_blocks: int):
    """Peak and mean share of the block pool in use over a run (from its step rows)."""
    u = 100 * np.asarray(steps["kv_cache_usage_perc"], float)
    if not len(u):
        return md("(no steps yet)")
    i = int(np.argmax(u))
    busy = u[np.asarray(steps["num_running"]) > 0] if "num_running" in steps else u
    pre = int(np.asarray(steps["num_preempted"]).sum()) if "num_preempted" in steps else 0
    return md(f"The pool of {num_blocks:,} blocks peaked at **{u[i]:.0f}% in use** (step {int(steps['step'].iloc[i]):,} "
              f"of {len(u):,}) and averaged {busy.mean():.0f}% while requests ran"
              + (f"; {pre} preemption(s) when it ran out." if pre else "; it never ran out (no preemption)."))


# ---- KV quantization ------------------------------------------------------------------
def format_memory(formats: pd.DataFrame, base: str = "fp16"):
    """Tokens per GiB of each format against `base` (a `quant.describe_formats` table)."""
    t = formats.set_index("format")["tokens_per_gib"]
    if base not in t:
        return md(f"(no {base} row to compare with)")
    parts = [f"{f} {times(v / t[base])}" for f, v in t.items() if f != base and v > t[base] * 1.01]
    low = [f"{f} {times(v / t[base])}" for f, v in t.items() if f != base and v < t[base] * 0.99]
    text = (f"Against {base} ({t[base]:,.0f} tokens per GiB), a GiB holds " + ", ".join(parts) + " the tokens"
            if parts else f"No format here holds more tokens per GiB than {base}")
    if low:
        text += f" ({', '.join(low)} for the wider ones)"
    return md(text + ". Scales and zero points are included: that is why 8 bits give less than 2× and "
                     "4 bits less than 4×.")


def all_rows(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["source"] == "all"] if "source" in df and (df["source"] == "all").any() else df


def format_errors(df: pd.DataFrame, context_length: int | None = None, metric: str = "kld_mean"):
    """How the 4-bit formats' error compares with int8's and with plain int4 (a `quant.study` table)."""
    d = all_rows(df)
    ctx = context_length or int(d["context_length"].max())
    k = d[d["context_length"] == ctx].set_index("format")[metric]
    if "int8" not in k or "int4" not in k:
        return md(f"(int8 and int4 are needed to compare the 4-bit formats; measured: {', '.join(k.index)})")
    others = [f for f in k.index if ("int4" in f or "kivi" in f) and f != "int4" and f.split("/")[0] != "int8"]
    bits = []
    for f in others:
        r = k[f] / k["int4"]
        word = "lower" if r < 1 - SAME else "higher" if r > 1 + SAME else "about the same as"
        bits.append(f"{f} {k[f]:.3g} ({times(1 / r) + ' ' if word == 'lower' else ''}{word}"
                    f"{' than' if word != 'about the same as' else ''} int4)")
    text = f"At {ctx} tokens, int8 has a mean KL divergence of {k['int8']:.3g} and int4 {k['int4']:.3g}"
    text += ("; " + "; ".join(bits) if bits else "") + "."
    closer = [f for f in others if abs(math.log(k[f] / k["int8"])) < abs(math.log(k["int4"] / k["int8"]))]
    if others:
        text += (f" {', '.join(closer)} {'sit' if len(closer) > 1 else 'sits'} closer to int8's error than int4 does."
                 if closer else " None of them comes closer to int8's error than int4.")
    return md(text)


FRONT_GOALS = ((4.0, 0.0100), (3.0, 0.030))
"""(bits per value at most, KLD at most): the goals of the served front (issue 23)."""


def front_goals(front: pd.DataFrame, llama: pd.DataFrame, goals: Sequence[tuple[float, float]] = FRONT_GOALS,
                protocol: str = "lic19"):
    """Per goal (at most ``bits``, KLD at most ``kld``): the best served front format (``group``
    starting "served") within the bits on ``protocol``, its KLD on every protocol, met or not, and
    its ratio to llama.cpp's rotated cache types at 4.5 and 6 bits (q4_0, q5_1)."""
    served = front[front["group"].str.startswith("served")]
    on = llama[llama["rotation"] == "on"].set_index("format")["kld_mean"]
    lines = []
    for bits, kld in goals:
        d = served[(served["protocol"] == protocol) & (served["bits_per_value"] <= bits)]
        if d.empty:
            lines.append(f"No served format stores at most {bits:g} bits per value.")
            continue
        best = d.loc[d["kld_mean"].idxmin()]
        per = served[served["format"] == best["format"]].set_index("protocol")["kld_mean"]
        verdict = "**met**" if float(per.max()) <= kld else "**not met**"
        where = ", ".join(f"{v:.3g} ({p})" for p, v in per.items())
        vs = "; ".join(f"{times(best['kld_mean'] / on[f])} llama.cpp's {f.split('/')[0]} ({on[f]:.3g})"
                       for f in ("q4_0/q4_0", "q5_1/q5_1") if f in on)
        lines.append(f"Goal: at most {bits:g} bits per value with KLD ≤ {kld:g} — {verdict}. The best served format "
                     f"within {bits:g} bits is `{best['format']}` at {best['bits_per_value']:.3g} bits: KLD {where}"
                     + (f"; on the licence chunks that is {vs}" if vs else "") + ".")
    return bullet(lines)


def context_trend(df: pd.DataFrame, metric: str = "kld_mean"):
    """Whether each format's error rises or falls from the shortest to the longest context measured."""
    d = all_rows(df)
    d = d[d["role"] != "base"] if "role" in d else d
    ctxs = sorted(d["context_length"].unique())
    if len(ctxs) < 2:
        return md(f"Only one context length ({ctxs[0] if ctxs else '–'} tokens) was measured in this run, so "
                  "it says nothing about a trend: put two or more in `CONTEXTS`.")
    lo, hi = ctxs[0], ctxs[-1]
    p = d.pivot_table(index="format", columns="context_length", values=metric)
    r = (p[hi] / p[lo]).replace([np.inf, -np.inf], np.nan).dropna()
    up, down = r[r > 1 + 0.1], r[r < 1 - 0.1]
    flat = r[(r >= 1 - 0.1) & (r <= 1 + 0.1)]
    parts = []
    if len(down):
        parts.append(f"falls for {len(down)} ({', '.join(f'{f} {times(v)}' for f, v in down.items())})")
    if len(flat):
        parts.append(f"stays within 10% for {len(flat)}")
    if len(up):
        parts.append(f"rises for {len(up)} ({', '.join(f'{f} {times(v)}' for f, v in up.items())})")
    verdict = ("so on this model the error does not grow with context, as far as measured" if not len(up) else
               "so for those formats the error does grow with context")
    return md(f"From {lo:,} to {hi:,} tokens, {metric} " + "; ".join(parts) + f" of {len(r)} formats: {verdict}.")


# ---- block tables -----------------------------------------------------------------------
def copy_on_write(steps: pd.DataFrame, n: int):
    """The copy-on-write copies of a run with one n-sample request, against the n − 1 the mechanism predicts."""
    copies = int(np.asarray(steps["num_block_copies"]).sum())
    preempted = int(np.asarray(steps["num_preempted"]).sum())
    at = [int(s) for s in np.asarray(steps.loc[steps["num_block_copies"] > 0, "step"])]
    where = f" (at step{'s' if len(at) > 1 else ''} {', '.join(map(str, at))})" if at else ""
    if copies == n - 1:
        how = (f"exactly n − 1 = {n - 1}: the samples share the partly filled last prompt block, and each sample "
               "but the last one to write its first token copies it first; the last writer keeps the original.")
    elif copies == 0:
        how = ("none: the prompt filled its last block exactly, so no shared block was partly filled "
               "(full blocks stay shared and are never written again).")
    else:
        how = (f"not n − 1 = {n - 1}: {preempted} preemption(s) in this run freed and recomputed shared blocks, "
               "and each recomputed fork copies again." if preempted else f"against n − 1 = {n - 1} predicted.")
    return md(f"Request 0 asked for n = {n} samples; the run made **{copies} copy-on-write "
              f"cop{'y' if copies == 1 else 'ies'}**{where}, {how}")


# ---- prefix caching ---------------------------------------------------------------------
def shared_blocks(run):
    """How many blocks several requests held at once, from the snapshots a run kept (`keep_snapshots`)."""
    from paged.core.snapshot import STATE_SHARED
    snaps = getattr(run, "snapshots", None) or {}
    if not snaps:
        return md("(the run kept no snapshots: call `run.keep_snapshots(1)` before running it)")
    counts = {s: int((snap.state == STATE_SHARED).sum()) for s, snap in snaps.items()}
    refs = {s: int(snap.ref_count.max()) if len(snap.ref_count) else 0 for s, snap in snaps.items()}
    best = max(refs, key=lambda s: (refs[s], counts[s], -s))
    steps = sum(1 for c in counts.values() if c)
    if refs[best] < 2:
        return md("In this run no block was held by two requests at once (each request finished before the next "
                  "arrived): the later ones revived the cached-free prompt blocks instead (light blue → blue).")
    most = max(counts.values())
    return md(f"In this run, blocks were shared (orange, ref count > 1) in {steps} of {len(counts)} steps: "
              f"at most {most} block{'s' if most > 1 else ''} at once, and one block was held by up to "
              f"**{refs[best]} requests at once** (step {best}). Requests that overlap in time point at the same "
              "system-prompt blocks instead of computing them again.")


# ---- fragmentation ----------------------------------------------------------------------
def paper_gap(table: pd.DataFrame):
    """Each allocator's share of the pool holding tokens against the vLLM paper's Fig. 2."""
    t = table.reset_index(drop=True)
    parts = [f"{a}: {s:.1%} (paper {p:.1%}, {'+' if d >= 0 else '−'}{abs(d):.1f} points)" for a, s, p, d in
             zip(t["allocator"], t["token_share_of_pool"], t["paper_token_share"], t["difference_pts"])]
    ratios = float(t["token_share_of_pool"].iloc[-1]) / t["token_share_of_pool"].iloc[:-1].to_numpy()
    fast = ""
    if "paged_speedup" in t:
        sp = t["paged_speedup"].iloc[:-1].to_numpy(float)
        fast = (f" and finishes the trace {times(sp.min())}–{times(sp.max())} as fast (simulated throughput)"
                if sp.min() > 1 else "")
    return md("Share of the pool holding tokens while requests waited — " + "; ".join(parts) +
              f". Paging holds {times(ratios.min())}–{times(ratios.max())} the tokens of the contiguous "
              f"allocators in the same memory{fast}.")


def engine_shares(table: pd.DataFrame):
    """Engine token shares per block size against the contiguous counterfactual (`engine_share_table`)."""
    t = table.sort_values("block_size")
    paged = ", ".join(f"{v:.0%} with blocks of {int(b)}" for b, v in zip(t["block_size"], t["token_share_paged"]))
    worst, best = t["token_share_paged"].min(), t["token_share_paged"].max()
    trend = ("falls as the blocks grow" if t["token_share_paged"].is_monotonic_decreasing and worst < best
             else "does not fall steadily with block size here")
    cont = t["token_share_contiguous_max"].iloc[0]
    return md(f"On the engine, the share of reserved slots holding tokens is {paged}: it {trend}. Reserving "
              f"`max_len` per request instead would have held tokens in {cont:.0%} of its slots.")


def eviction(sweep: pd.DataFrame):
    """Hit rate and throughput across pool sizes (`prefix_caching.eviction_sweep`)."""
    t = sweep.sort_values("pool_tokens")
    total = int(t["prefix_tokens_total"].iloc[0])
    small, big = t.iloc[0], t.iloc[-1]
    below = t[t["pool_tokens"] < total]
    note = (f" Below {total:,} tokens (all system prompts together) the hit rate is at most "
            f"{below['hit_rate'].max():.0%}." if len(below) else f" Every pool here holds all {total:,} prompt tokens.")
    return md(f"From a pool of {int(small['pool_tokens']):,} to {int(big['pool_tokens']):,} tokens, the hit rate "
              f"{change(100 * small['hit_rate'], 100 * big['hit_rate'], fmt=lambda v: f'{v:.0f}%')} and throughput "
              f"{change(small['throughput_req_s'], big['throughput_req_s'], fmt=lambda v: f'{v:.2f} req/s')}." + note)


def collision(table: pd.DataFrame, first: str = "sha256", second: str = "constant hash"):
    """What a constant hash costs on the engine (`compare_caching` with two hash functions)."""
    t = table.set_index("setting")
    a, b = t.loc[first], t.loc[second]
    same = bool(t["outputs_identical"].all())
    return md(f"With a {second}, the number of prompt tokens served from the cache {change(a['hit_tokens'], b['hit_tokens'], fmt=lambda v: f'{v:,.0f}')} "
              f"(hit rate {a['hit_rate']:.0%} → {b['hit_rate']:.0%}); the greedy outputs are "
              + ("**identical** token for token: the collision cost hits, not correctness." if same else
                 "**different**: a colliding hash changed the output, which verification should prevent (a bug)."))


# ---- preemption ------------------------------------------------------------------------
def preemption_modes(table: pd.DataFrame):
    """Recompute vs swap on the engine (a `preemption.compare_modes` table)."""
    t = table.set_index("run")
    parts = []
    for mode in [m for m in ("recompute", "swap") if m in t.index]:
        r = t.loc[mode]
        extra = (f"{int(r['extra_prefill_tokens'])} tokens prefilled again" if mode == "recompute"
                 else f"{int(r['swapped_out_blocks'])} blocks out and {int(r['swapped_in_blocks'])} back in")
        parts.append(f"{mode}: {int(r['preemptions'])} preemption(s), {extra}, {int(r['steps'])} steps")
    same = bool(t["outputs_identical"].all())
    return md("; ".join(parts) + (". The outputs are identical to the reference's, token for token."
                                  if same else ". **The outputs differ from the reference's**: this is a bug."))


def swap_cost(costs: pd.DataFrame):
    """Swap against recompute for the largest request of a `preemption.cost_table`."""
    r = costs.iloc[-1]
    ratio = r["recompute_s"] / r["swap_out_and_in_s"]
    word = "cheaper" if ratio > 1 else "dearer"
    per = r["kv_bytes_per_gpu"] / r["tokens"] / 1024
    return md(f"Each token's KV is {per:,.0f} KiB per GPU here. At {int(r['tokens']):,} tokens, swapping a request "
              f"out and back takes {ms(1e3 * r['swap_out_and_in_s'])} and recomputing it "
              f"{ms(1e3 * r['recompute_s'])}: swap is {times(max(ratio, 1 / ratio))} {word}.")


# ---- tiers, swap, sharing, compaction ----------------------------------------------------
def tier_verdict(tiers: pd.DataFrame, base: str = "recompute (no host tier)", tier: str = "host tier, LRU"):
    """A host tier against none (a `host_tier.tier_study` table)."""
    t = tiers.set_index("variant")
    if base not in t.index or tier not in t.index:
        return md(f"(the table needs the variants {base!r} and {tier!r})")
    a, b = t.loc[base], t.loc[tier]
    tp = b["throughput_tok_s"] / a["throughput_tok_s"]
    pays = b["prefix_hit_rate"] > a["prefix_hit_rate"] and tp > 1
    return md(f"A host tier ({tier.split(', ')[-1]}) against none: prefix hit rate {a['prefix_hit_rate']:.2f} → "
              f"{b['prefix_hit_rate']:.2f}, throughput {times(tp)}, mean TTFT "
              f"{change(1e3 * a['ttft_mean_s'], 1e3 * b['ttft_mean_s'])}, {b['gib_moved']:,.0f} GiB moved between "
              f"tiers: {'it pays on this prefix-heavy traffic' if pays else 'it does not pay here'}.")


def swap_error_verdict(swap_err: pd.DataFrame, engine_swap: pd.DataFrame | None = None):
    """What compressing swapped blocks costs in quality (`swap_error_study`, rows of scope 'after_swap')."""
    d = swap_err[swap_err["scope"] == "after_swap"]
    parts = [f"{r['compression']} host blocks ({times(r['ratio_vs_fp16'])} smaller than fp16) add KLD "
             f"{r['kld_mean']:.2g} after a swap, same top-1 {r['same_top1_pct']:.1f}%, and "
             f"{r['swapped_identical_pct']:.0f}% of the {int(r['num_requests_swapped'])} swapped requests kept "
             f"identical greedy output (first divergence at token {r['swapped_first_div_mean']:.1f} of "
             f"{int(r['greedy_tokens'])} on average)" for _, r in d.iterrows() if r["compression"] != "none"]
    text = "; ".join(parts) + "." if parts else "No compressed swap was measured."
    if engine_swap is not None and "same_outputs" in engine_swap:
        plain = engine_swap[~engine_swap["variant"].str.contains("fp8|int4")]
        text += (" Uncompressed swap, sync or overlapped, left every greedy output identical."
                 if bool(plain["same_outputs"].all()) else " **Uncompressed swap changed an output** (a bug).")
    return md(text)


def sharing_memory(sharing: pd.DataFrame, target_pct: float = 30.0):
    """Memory saved by the k-pair config closest above `target_pct`, and the engine blocks it buys."""
    k = sharing[(sharing["kind"] == "k_pairs") & (sharing["memory_saved_pct"] >= target_pct - 1e-9)]
    if not len(k):
        return md(f"No measured configuration saves {target_pct:.0f}% of the KV memory.")
    r = k.sort_values("memory_saved_pct").iloc[0]
    base = sharing[sharing["kind"] == "base"]
    blocks = ""
    if "engine_num_blocks" in sharing and len(base) and np.isfinite(r.get("engine_num_blocks", np.nan)):
        blocks = (f"; the real engine fits {int(r['engine_num_blocks'])} instead of "
                  f"{int(base['engine_num_blocks'].iloc[0])} blocks in the same memory")
    return md(f"{int(r['k'])} layers reading a neighbour's KV ({int(r['k'])} disjoint pairs) save "
              f"{r['memory_saved_pct']:.0f}% of the KV memory{blocks}.")


# ---- compaction --------------------------------------------------------------------------
def compaction_verdict(v: dict):
    """`paged.studies.compaction.verdict` as a sentence."""
    pays = bool(v["pays"])
    saved = v["saved_per_pass_ms"]
    gain = (f"saves {saved:.3g} ms of reads before the next pass" if saved >= 0 else
            f"saves nothing (contiguous reads were slower here: {-saved:.3g} ms more before the next pass)")
    return md(f"At context {v['ctx']:,} (blocks of {v['block']}), contiguous tables read K/V "
              f"{times(v['slots_ratio'])} as fast as scattered ones; a pass removes {v['breaks_fixed']:.0%} of the "
              f"breaks, {gain} ({v['steps_per_pass']:.0f} steps) and costs {v['pass_ms']:.3g} ms: compaction "
              f"**{'pays' if pays else 'does not pay'}** here (payback {v['payback']:.2f}).")


def bullet(lines: Sequence):
    """Lines (str or Markdown objects) as a Markdown bullet list."""
    return md("\n".join(f"- {getattr(s, 'data', s)}" for s in lines))
