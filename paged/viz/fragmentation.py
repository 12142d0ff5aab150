"""Fragmentation: how much reserved KV memory holds tokens, contiguous allocators vs paging.

Runs (the simulator on one shared trace, and the real engine at small scale) return records;
figure builders turn records into ``go.Figure``. Column names are ``paged.telemetry.STEP_COLUMNS``.

Invariants:
- every allocator of ``run_allocators`` sees the same trace, scheduler settings and pool size
  (``num_blocks x block_size`` token slots; contiguous allocators count the same slots);
- "token share" = slots holding tokens / slots reserved by requests (``token_usage``), time-weighted
  over steps with memory in use: the vLLM paper's "share of KV memory holding token states";
- internal fragmentation of paging = 1 - token share; it lives only in each request's last block.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from paged.errors import ConfigError

ALLOCATORS = ("contiguous-max", "contiguous-pow2", "contiguous-oracle", "paged")
LABELS = {"contiguous-max": "contiguous, max_len each", "contiguous-pow2": "contiguous, prompt + pow2(output)",
          "contiguous-oracle": "contiguous, exact length (oracle)", "paged": "paged (blocks of 16)"}
# vLLM paper (Kwon et al., SOSP 2023), Fig. 2: share of KV memory holding token states.
PAPER_TOKEN_SHARE = {"contiguous-max": 0.204, "contiguous-pow2": 0.268, "contiguous-oracle": 0.382, "paged": 0.963}
COLOURS = {"contiguous-max": "#e76f51", "contiguous-pow2": "#f4a261", "contiguous-oracle": "#e9c46a",
           "paged": "#264653"}
HELD, RESERVED = "#2a9d8f", "#e76f51"


def _label(allocator: str, block_size: int = 16) -> str:
    return f"paged (blocks of {block_size})" if allocator == "paged" else LABELS.get(allocator, allocator)


def shared_trace(workload: str = "sharegpt", num_requests: int = 300, max_model_len: int = 2048, seed: int = 0,
                 rate: float = float("inf")) -> pd.DataFrame:
    """One seeded trace (all requests at t=0 by default, as in the vLLM paper's memory experiment)."""
    from paged.sim.workload import synthetic_trace

    return synthetic_trace(workload, num_requests, rate=rate, seed=seed, max_model_len=max_model_len)


def run_allocators(trace: pd.DataFrame, allocators: Sequence[str] = ALLOCATORS, *, model: str = "llama-13b",
                   gpu: str = "a100-40gb", block_size: int = 16, **config) -> dict:
    """Simulate ``trace`` once per allocator (same scheduler, same memory); ``{allocator: SimResult}``.

    Defaults are the vLLM paper's setting: LLaMA-13B on one A100-40GB, prefix caching off.
    ``config``: other ``SimConfig`` fields (``num_blocks``, ``max_num_seqs``, ...).
    """
    from paged.sim.simulator import SimConfig, Simulator

    bad = [a for a in allocators if a not in ALLOCATORS]
    if bad:
        raise ConfigError(f"unknown allocators {bad}; choose from {ALLOCATORS}")
    config.setdefault("enable_prefix_caching", False)
    return {a: Simulator(SimConfig(model=model, gpu=gpu, block_size=block_size, allocator=a, **config)).run(trace)
            for a in allocators}


def pool_share_under_load(steps: pd.DataFrame) -> float:
    """Slots holding tokens / all slots of the pool, time-weighted over steps with requests waiting.

    While requests wait, memory is what limits the batch: the regime of the vLLM paper's Fig. 2,
    whose bars are shares of the whole KV memory (tokens, reservations, internal and external
    fragmentation add up to 100%). NaN when no step had a queue.
    """
    m = np.asarray(steps["num_waiting"]) > 0
    w = np.asarray(steps["step_time_s"], float)[m]
    if not m.any() or w.sum() <= 0:
        return float("nan")
    held = np.asarray(steps["kv_cache_usage_perc"], float)[m] * np.asarray(steps["token_usage"], float)[m]
    return float(np.average(held, weights=w))


def token_share_table(results: Mapping[str, object]) -> pd.DataFrame:
    """One row per allocator: tokens as a share of the pool under load beside the paper's figure, tokens as
    a share of what requests reserved, batch size, throughput and the speed-up of paging."""
    rows = []
    for a, r in results.items():
        s = r.summary
        rows.append({"allocator": _label(a, s["block_size"]), "token_share_of_pool": pool_share_under_load(r.steps),
                     "paper_token_share": PAPER_TOKEN_SHARE.get(a, np.nan),
                     "token_share_of_reserved": s["kv_token_usage_mean"],
                     "mean_batch": s["mean_batch_size"], "throughput_req_s": s["throughput_req_s"],
                     "preemptions": s["num_preemptions"], "_key": a})
    df = pd.DataFrame(rows)
    df.insert(3, "difference_pts", 100 * (df["token_share_of_pool"] - df["paper_token_share"]))
    if "paged" in results:
        paged = float(df.loc[df["_key"] == "paged", "throughput_req_s"].iloc[0])
        df["paged_speedup"] = paged / df["throughput_req_s"]
    return df.drop(columns="_key")


def token_share_figure(table: pd.DataFrame) -> go.Figure:
    """Grouped bars: share of reserved KV memory holding tokens, this simulator vs the vLLM paper."""
    fig = go.Figure([
        go.Bar(x=table["allocator"], y=100 * table["token_share_of_pool"], name="this simulator (share of the pool)",
               marker_color="#264653", text=[f"{v:.1%}" for v in table["token_share_of_pool"]], textposition="outside"),
        go.Bar(x=table["allocator"], y=100 * table["paper_token_share"], name="vLLM paper (Fig. 2)",
               marker_color="#a8dadc", text=[f"{v:.1%}" for v in table["paper_token_share"]], textposition="outside"),
    ])
    fig.update_layout(barmode="group", title="Share of KV memory holding tokens while requests wait",
                      yaxis_title="% of the KV pool", yaxis_range=[0, 110], height=380,
                      margin=dict(l=60, r=20, t=50, b=60), legend=dict(orientation="h", y=-0.2))
    return fig


def held_and_reserved(steps: pd.DataFrame, capacity_tokens: int) -> pd.DataFrame:
    """Per step: ``time_s``, ``reserved`` slots (requests' reservations or blocks) and ``held`` (slots with tokens)."""
    reserved = np.asarray(steps["kv_cache_usage_perc"], float) * capacity_tokens
    held = reserved * np.asarray(steps["token_usage"], float)
    return pd.DataFrame({"time_s": np.asarray(steps["time_s"], float), "reserved": reserved, "held": held,
                         "num_running": np.asarray(steps["num_running"])})


def reserved_vs_held_figure(results: Mapping[str, object], max_points: int = 400) -> go.Figure:
    """One panel per allocator: slots reserved (orange) and slots holding tokens (green) over simulated time."""
    keys = list(results)
    fig = make_subplots(rows=len(keys), cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=[_label(k, results[k].summary["block_size"]) for k in keys])
    for i, k in enumerate(keys, start=1):
        r = results[k]
        d = held_and_reserved(r.steps, int(r.summary["kv_capacity_tokens"]))
        if len(d) > max_points:  # keep the figure light: every n-th step
            d = d.iloc[:: int(np.ceil(len(d) / max_points))]
        cap = r.summary["kv_capacity_tokens"] / 1e3
        fig.add_trace(go.Scatter(x=d["time_s"], y=d["reserved"] / 1e3, name="reserved", legendgroup="r",
                                 showlegend=i == 1, line=dict(color=RESERVED), fill="tozeroy"), row=i, col=1)
        fig.add_trace(go.Scatter(x=d["time_s"], y=d["held"] / 1e3, name="holding tokens", legendgroup="h",
                                 showlegend=i == 1, line=dict(color=HELD), fill="tozeroy"), row=i, col=1)
        fig.update_yaxes(title_text="k slots", range=[0, cap * 1.05], row=i, col=1)
    fig.update_xaxes(title_text="simulated time (s)", row=len(keys), col=1)
    fig.update_layout(title="Reserved KV slots vs slots holding tokens, same trace and memory",
                      height=170 * len(keys) + 110, margin=dict(l=60, r=20, t=80, b=50),
                      legend=dict(orientation="h", y=1.08, x=0.6))
    return fig


def block_size_sweep(block_sizes: Sequence[int] = (1, 8, 16, 32, 64, 128, 256), *, trace: pd.DataFrame,
                     model: str = "llama-13b", gpu: str = "a100-40gb", **config) -> pd.DataFrame:
    """Paged runs of ``trace`` per block size: token share, internal fragmentation, batch, throughput."""
    rows = []
    for b in block_sizes:
        r = run_allocators(trace, ("paged",), model=model, gpu=gpu, block_size=int(b), **config)["paged"]
        s = r.summary
        rows.append({"block_size": int(b), "token_share": s["kv_token_usage_mean"],
                     "internal_fragmentation": s["kv_internal_fragmentation_mean"],
                     "mean_batch": s["mean_batch_size"], "throughput_req_s": s["throughput_req_s"],
                     "num_kv_blocks": s["num_kv_blocks"]})
    return pd.DataFrame(rows)


def block_size_figure(sweep: pd.DataFrame) -> go.Figure:
    """Internal fragmentation (bars, left) and saturation throughput (line, right) against block size."""
    x = [str(b) for b in sweep["block_size"]]
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(go.Bar(x=x, y=100 * sweep["internal_fragmentation"], name="internal fragmentation (%)",
                         marker_color=RESERVED, text=[f"{v:.1%}" for v in sweep["internal_fragmentation"]],
                         textposition="outside"), secondary_y=False)
    fig.add_trace(go.Scatter(x=x, y=sweep["throughput_req_s"], name="throughput (req/s)", mode="lines+markers",
                             line=dict(color="#264653")), secondary_y=True)
    top = float(100 * sweep["internal_fragmentation"].max())
    fig.update_yaxes(title_text="% of reserved slots empty", range=[0, max(top * 1.3, 5)], secondary_y=False)
    fig.update_yaxes(title_text="requests / s (simulated)", rangemode="tozero", secondary_y=True)
    fig.update_layout(title="Block size: bigger blocks waste more of the last block", xaxis_title="block size (tokens)",
                      height=380, margin=dict(l=60, r=60, t=50, b=50), legend=dict(orientation="h", y=-0.25))
    return fig


# ----------------------------------------------------------------------------------------------
# The real engine, small scale
# ----------------------------------------------------------------------------------------------


def engine_workload(num_requests: int = 8, prompt_tokens: tuple[int, int] = (20, 120),
                    output_tokens: tuple[int, int] = (8, 48), seed: int = 0, vocab: tuple[int, int] = (17, 49152)):
    """Seeded requests of token-id prompts with varied lengths for ``paged.runs.EngineRun``.

    Outputs ignore EOS so every request produces exactly its drawn length (fixed memory footprint).
    """
    from paged.engine import SamplingParams

    rng = np.random.default_rng(seed)
    out = []
    for i in range(num_requests):
        n = int(rng.integers(prompt_tokens[0], prompt_tokens[1] + 1))
        m = int(rng.integers(output_tokens[0], output_tokens[1] + 1))
        out.append({"request_id": f"r{i}", "prompt": rng.integers(*vocab, n).tolist(),
                    "params": SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0)})
    return out


def engine_block_sizes(loaded_model, workload, block_sizes: Sequence[int] = (4, 16, 64), pool_tokens: int = 4096,
                       max_model_len: int = 1024) -> pd.DataFrame:
    """Run ``workload`` on the real engine once per block size, same pool of ``pool_tokens`` slots.

    Returns every step row (STEP_COLUMNS) plus ``block_size``, ``held`` (slots holding tokens),
    ``reserved`` (slots of blocks in use) and ``contiguous_reserved`` (the counterfactual: each
    running request reserving ``max_model_len`` slots, as a contiguous allocator would).
    """
    import paged
    from paged import runs

    frames = []
    for b in block_sizes:
        llm = paged.LLM(loaded_model, block_size=int(b), num_blocks=pool_tokens // int(b), max_model_len=max_model_len,
                        enable_prefix_caching=False, record_events=False)
        st = runs.EngineRun(llm, workload).run_to_completion().steps_frame()
        st["block_size"] = int(b)
        st["reserved"] = st["num_used_blocks"] * int(b)
        st["held"] = st["reserved"] * st["token_usage"]
        st["contiguous_reserved"] = st["num_running"] * max_model_len
        frames.append(st)
    return pd.concat(frames, ignore_index=True)


def engine_share_table(steps: pd.DataFrame) -> pd.DataFrame:
    """Per block size: token share of paged blocks and of the contiguous counterfactual (step-averaged)."""
    g = steps[steps["reserved"] > 0].groupby("block_size")
    return pd.DataFrame({
        "token_share_paged": g["held"].sum() / g["reserved"].sum(),
        "token_share_contiguous_max": g["held"].sum() / g["contiguous_reserved"].sum(),
        "peak_blocks": g["num_used_blocks"].max(), "steps": g.size(),
    }).reset_index()


def engine_usage_figure(steps: pd.DataFrame) -> go.Figure:
    """Per step of the real engine: % of reserved slots holding tokens, each block size vs contiguous max_len."""
    fig = go.Figure()
    palette = ["#264653", "#2a9d8f", "#8ab17d", "#e9c46a"]
    for i, (b, st) in enumerate(steps.groupby("block_size")):
        st = st[st["reserved"] > 0]
        fig.add_trace(go.Scatter(x=st["step"], y=100 * st["held"] / st["reserved"], name=f"paged, blocks of {b}",
                                 mode="lines", line=dict(color=palette[i % len(palette)])))
    st = steps[(steps["block_size"] == steps["block_size"].min()) & (steps["contiguous_reserved"] > 0)]
    fig.add_trace(go.Scatter(x=st["step"], y=100 * st["held"] / st["contiguous_reserved"], mode="lines",
                             name="contiguous, max_len each (same requests)", line=dict(color=RESERVED, dash="dash")))
    fig.update_layout(title="SmolLM2 on this machine: share of reserved KV slots holding tokens, per step",
                      xaxis_title="engine step", yaxis_title="% holding tokens", yaxis_range=[0, 105], height=360,
                      margin=dict(l=60, r=20, t=50, b=50), legend=dict(orientation="h", y=-0.25))
    return fig


__all__ = ["ALLOCATORS", "LABELS", "PAPER_TOKEN_SHARE", "shared_trace", "run_allocators", "token_share_table",
           "pool_share_under_load", "token_share_figure", "held_and_reserved", "reserved_vs_held_figure", "block_size_sweep",
           "block_size_figure", "engine_workload", "engine_block_sizes", "engine_share_table", "engine_usage_figure"]
