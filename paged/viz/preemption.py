"""Preemption under memory pressure: recompute vs swap, on the engine and in the simulator, and what each costs.

Invariants:
- ``compare_modes`` runs the same token-id prompts and greedy sampling first in a pool big enough
  for all of them (the reference, no preemption), then once per preemption mode in ``num_blocks``;
  ``outputs_identical`` compares every token with the reference;
- ``cost_table`` prices one preempted request of ``n`` tokens with the package's cost model:
  recompute = the prefill of its ``n`` tokens (compute parts only, no step overhead); swap = its
  KV bytes over PCIe out and back in; HBM = reading the same bytes once from GPU memory.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

MODE_COLOURS = {"reference": "#8d99ae", "recompute": "#e76f51", "swap": "#264653"}


def pressure_prompts(num_requests: int = 6, prompt_tokens: int = 48, seed: int = 0,
                     vocab: tuple[int, int] = (17, 49152)) -> list[list[int]]:
    """Distinct seeded token-id prompts (no shared prefix, so no prefix hit hides the pressure)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(*vocab, prompt_tokens).tolist() for _ in range(num_requests)]


def pressure_workload(prompts, max_tokens: int = 32, arrive_every: int = 1) -> list[dict]:
    """``paged.runs.EngineRun`` requests of ``prompts`` (greedy, EOS ignored: each grows to its full length)."""
    from paged.engine import SamplingParams

    return [{"request_id": f"p{i}", "prompt": list(p), "arrival_step": 1 + i * arrive_every,
             "params": SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)}
            for i, p in enumerate(prompts)]


def _generate(llm, prompts, max_tokens: int):
    from paged import telemetry
    from paged.engine import SamplingParams

    rows: list[dict] = []
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                        on_step=lambda s: rows.append(s.to_row()))
    return [list(o.outputs[0].token_ids) for o in outs], telemetry.steps_frame(rows), time.perf_counter() - t0


def compare_modes(loaded_model, prompts, max_tokens: int = 32, num_blocks: int = 12,
                  modes: Sequence[str] = ("recompute", "swap"), block_size: int = 16,
                  **engine) -> tuple[pd.DataFrame, dict[str, pd.DataFrame]]:
    """Reference run (pool for everything) then one run per preemption mode in ``num_blocks`` blocks.

    Table columns: preemptions, blocks swapped out / in, prefill tokens computed (recompute pays
    the evicted tokens again), extra prefill vs the reference, steps, wall seconds, outputs identical.
    """
    import paged

    need = sum(-(-(len(p) + max_tokens) // block_size) for p in prompts)
    runs = [("reference", need + 4, {})] + [(m, num_blocks, {"preemption_mode": m}) for m in modes]
    rows, frames, ref = [], {}, None
    for label, blocks, kw in runs:
        llm = paged.LLM(loaded_model, block_size=block_size, num_blocks=blocks, enable_prefix_caching=False,
                        **{**engine, **kw})
        toks, st, wall = _generate(llm, prompts, max_tokens)
        ref = toks if ref is None else ref
        rows.append({"run": label, "num_blocks": blocks, "preemptions": int(st["num_preempted"].sum()),
                     "swapped_out_blocks": int(st["num_swapped_out_blocks"].sum()),
                     "swapped_in_blocks": int(st["num_swapped_in_blocks"].sum()),
                     "prefill_tokens": int(st["num_prefill_tokens"].sum()), "steps": len(st), "wall_s": wall,
                     "outputs_identical": toks == ref})
        frames[label] = st
    df = pd.DataFrame(rows)
    df.insert(6, "extra_prefill_tokens", df["prefill_tokens"] - int(df["prefill_tokens"].iloc[0]))
    return df, frames


def modes_figure(frames: dict[str, pd.DataFrame]) -> go.Figure:
    """Blocks in use per step for each run, with a marker wherever a request was preempted."""
    fig = go.Figure()
    for label, st in frames.items():
        c = MODE_COLOURS.get(label, "#2a9d8f")
        fig.add_trace(go.Scatter(x=st["step"], y=st["num_used_blocks"], name=f"{label}: blocks in use",
                                 mode="lines", line=dict(color=c)))
        p = st[st["num_preempted"] > 0]
        if len(p):
            fig.add_trace(go.Scatter(x=p["step"], y=p["num_used_blocks"], mode="markers", name=f"{label}: preemption",
                                     marker=dict(symbol="x", size=10, color=c)))
    fig.update_layout(title="Blocks in use per step; x = a request preempted", xaxis_title="engine step",
                      yaxis_title="blocks", height=360, margin=dict(l=60, r=20, t=50, b=50),
                      legend=dict(orientation="h", y=-0.25))
    return fig


def cost_table(model: str = "llama-2-70b", gpu: str = "a100-80gb", tokens: Sequence[int] = (256, 1024, 4096),
               tensor_parallel: int = 4, kv_format: str = "fp16") -> pd.DataFrame:
    """What bringing back one preempted request of ``n`` tokens costs on each GPU of the deployment."""
    from paged.sim.cost_model import CostModel, StepShape
    from paged.sim.specs import get_gpu, get_model

    m, g = get_model(model), get_gpu(gpu)
    cm = CostModel(m, g, tensor_parallel=tensor_parallel, kv_format=kv_format)
    per_tok = m.kv_bytes_per_token(kv_format, tensor_parallel)
    rows = []
    for n in tokens:
        kv = per_tok * n
        pre = cm.breakdown(StepShape.make([n], [0], 1))
        swap = cm.breakdown(StepShape.make([0], [0], 0, swap_bytes=2 * kv)).swap
        rows.append({"tokens": int(n), "kv_bytes_per_gpu": kv, "recompute_s": pre.linear + pre.attention + pre.comm,
                     "swap_out_and_in_s": swap, "hbm_read_s": kv / g.hbm_bandwidth,
                     "pcie_GBps": g.pcie_bandwidth / 1e9, "hbm_GBps": g.hbm_bandwidth / 1e9})
    df = pd.DataFrame(rows)
    df["swap_vs_recompute"] = df["swap_out_and_in_s"] / df["recompute_s"]
    df.attrs.update(model=m.name, gpu=g.name, tensor_parallel=tensor_parallel)
    return df


def cost_figure(costs: pd.DataFrame) -> go.Figure:
    """Seconds to bring back one request: recompute (prefill) vs swap (PCIe out + in) vs reading it from HBM."""
    x = [f"{t:,} tokens" for t in costs["tokens"]]
    fig = go.Figure([
        go.Bar(x=x, y=1e3 * costs["recompute_s"], name="recompute (prefill again)", marker_color=MODE_COLOURS["recompute"]),
        go.Bar(x=x, y=1e3 * costs["swap_out_and_in_s"], name="swap out + in over PCIe", marker_color=MODE_COLOURS["swap"]),
        go.Bar(x=x, y=1e3 * costs["hbm_read_s"], name="one read from HBM", marker_color="#a8dadc"),
    ])
    a = costs.attrs
    fig.update_layout(barmode="group", yaxis_type="log", yaxis_title="milliseconds (log)",
                      title=f"{a.get('model', '')} on {a.get('tensor_parallel', 1)}× {a.get('gpu', '')}: "
                            "the cost of one preempted request", height=380, margin=dict(l=60, r=20, t=50, b=40),
                      legend=dict(orientation="h", y=-0.2))
    return fig


def simulate_modes(modes: Sequence[str] = ("recompute", "swap"), *, num_requests: int = 300, rate: float = 8.0,
                   model: str = "llama-2-13b", gpu: str = "a100-40gb", num_blocks: int = 600,
                   workload: str = "sharegpt", seed: int = 0, **config) -> pd.DataFrame:
    """The same pressured trace simulated once per preemption mode: throughput, latency, preemptions, swaps."""
    from paged.sim.simulator import SimConfig, Simulator
    from paged.sim.workload import synthetic_trace

    trace = synthetic_trace(workload, num_requests, rate=rate, seed=seed, max_model_len=4096)
    rows = []
    for mode in modes:
        s = Simulator(SimConfig(model=model, gpu=gpu, num_blocks=num_blocks, preemption_mode=mode,
                                enable_prefix_caching=False, seed=seed, **config)).run(trace).summary
        rows.append({"mode": mode, "throughput_tok_s": s["throughput_tok_s"], "ttft_p50_s": s["ttft_p50_s"],
                     "e2e_p99_s": s["e2e_p99_s"], "tbt_p99_s": s["tbt_p99_s"], "preemptions": s["num_preemptions"],
                     "swapped_blocks": s["num_swapped_blocks"], "finished": s["requests_finished"]})
    return pd.DataFrame(rows)


__all__ = ["pressure_prompts", "pressure_workload", "compare_modes", "modes_figure", "cost_table", "cost_figure", "simulate_modes"]
