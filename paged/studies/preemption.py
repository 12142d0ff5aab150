"""Preemption under memory pressure: recompute vs swap, on the engine and in the simulator, and what each costs.

Invariants:
- ``compare_modes`` runs the same prompts greedily in a pool big enough for all (the reference, no
  preemption), then once per mode in ``num_blocks``; ``outputs_identical`` compares every token;
- ``cost_table`` prices one preempted request of ``n`` tokens with the cost model: recompute = its
  prefill (compute parts only), swap = its KV bytes over PCIe out and in, HBM = one read of them.

``engine_swap_study``: one pressured workload per variant on one loaded model (default a tiny
random Llama): preemptions, blocks and bytes swapped, thread CPU seconds (robust to neighbours;
``OMP_NUM_THREADS=1``), output tokens per CPU second vs recompute, decode-only step times (TBT),
and whether outputs equal recompute's (they must for lossless variants). On CPU every copy is
synchronous (``paged.engine.swap``): overlap can only tie; the GPU case is simulated
(``paged.studies.offload``). Figures: ``paged.viz.preemption``.
"""

from __future__ import annotations

import random
import time
from typing import Any, Sequence

import numpy as np
import pandas as pd

from paged.studies.engine_setup import generate_greedy, study_model


def pressure_prompts(num_requests: int = 6, prompt_tokens: int = 48, seed: int = 0,
                     vocab: tuple[int, int] = (17, 49152)) -> list[list[int]]:
    """Distinct seeded token-id prompts (no shared prefix, so no prefix hit hides the pressure)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(*vocab, prompt_tokens).tolist() for _ in range(num_requests)]


def pressure_workload(prompts, max_tokens: int = 32, arrive_every: int = 1) -> list[dict]:
    """``paged.runs.Run`` requests of ``prompts`` (greedy, EOS ignored: each grows to its full length)."""
    from paged.engine import SamplingParams

    return [{"request_id": f"p{i}", "prompt": list(p), "arrival_step": 1 + i * arrive_every,
             "params": SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)}
            for i, p in enumerate(prompts)]


def compare_modes(loaded_model, prompts, max_tokens: int = 32, num_blocks: int = 12,
                  modes: Sequence[str] = ("recompute", "swap"), block_size: int = 16,
                  **engine) -> tuple[pd.DataFrame, dict[str, pd.DataFrame]]:
    """Reference run (pool for everything) then one run per preemption mode in ``num_blocks`` blocks. Table
    columns: preemptions, blocks swapped out / in, prefill tokens computed (recompute pays the evicted tokens
    again), extra prefill vs the reference, steps, wall seconds, outputs identical."""
    import paged

    need = sum(-(-(len(p) + max_tokens) // block_size) for p in prompts)
    runs = [("reference", need + 4, {})] + [(m, num_blocks, {"preemption_mode": m}) for m in modes]
    rows, frames, ref = [], {}, None
    for label, blocks, kw in runs:
        llm = paged.LLM(loaded_model, block_size=block_size, num_blocks=blocks, enable_prefix_caching=False,
                        **{**engine, **kw})
        toks, st, wall = generate_greedy(llm, prompts, max_tokens)
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


def simulate_modes(modes: Sequence[str] = ("recompute", "swap"), *, num_requests: int = 300, rate: float = 8.0,
                   model: str = "llama-2-13b", gpu: str = "a100-40gb", num_blocks: int = 600,
                   workload: str = "sharegpt", seed: int = 0, **config) -> pd.DataFrame:
    """The same pressured trace simulated once per preemption mode: throughput, latency, preemptions, swaps."""
    from paged.sim.simulator import SimConfig, Simulator
    from paged.sim.workload import synthetic_trace

    trace = synthetic_trace(workload, num_requests, rate=rate, trace_seed=seed, max_model_len=4096)
    rows = []
    for mode in modes:
        s = Simulator(SimConfig(model=model, gpu=gpu, num_blocks=num_blocks, preemption_mode=mode,
                                enable_prefix_caching=False, prompt_seed=seed, **config)).run(trace).summary
        rows.append({"mode": mode, "throughput_tok_s": s["throughput_tok_s"], "ttft_p50_s": s["ttft_p50_s"],
                     "e2e_p99_s": s["e2e_p99_s"], "tbt_p99_s": s["tbt_p99_s"], "preemptions": s["num_preemptions"],
                     "swapped_blocks": s["num_swapped_blocks"], "finished": s["requests_finished"]})
    return pd.DataFrame(rows)


# ---- Swap transports on the real engine, small scale ---------------------------------------------------------------

ENGINE_VARIANTS: dict[str, dict[str, Any]] = {
    "recompute": dict(preemption_mode="recompute"),
    "swap sync": dict(preemption_mode="swap"),
    "swap overlap": dict(preemption_mode="swap", swap_mode="overlap"),
    "swap overlap fp8": dict(preemption_mode="swap", swap_mode="overlap", swap_compression="fp8"),
    "swap overlap int4": dict(preemption_mode="swap", swap_mode="overlap", swap_compression="int4"),
}


def engine_swap_study(model: str | None = None, *, num_requests: int = 12, prompt_len: int = 96,
                      max_tokens: int = 48, block_size: int = 16, num_blocks: int | None = None,
                      max_num_seqs: int = 8, variants: dict[str, dict[str, Any]] | None = None, seed: int = 0,
                      device: str = "cpu") -> pd.DataFrame:
    """One row per variant (name -> ``EngineConfig`` overrides; default ``ENGINE_VARIANTS``).
    ``num_blocks`` defaults to 40% of what the requests need at once (pressure)."""
    from paged.engine import LLM, SamplingParams

    loaded = study_model(model, device=device, prefix="paged-swap-")
    rng = random.Random(seed)
    vocab = min(loaded.config.vocab_size, 32000)
    prompts = [[rng.randrange(17, vocab) for _ in range(prompt_len + rng.randrange(0, block_size))]
               for _ in range(num_requests)]
    per_req = -(-(prompt_len + block_size + max_tokens) // block_size)
    pool = num_blocks or max(per_req + 1, int(0.4 * per_req * min(num_requests, max_num_seqs)))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rows, ref = [], None
    for name, over in (variants or ENGINE_VARIANTS).items():
        eng = LLM(loaded, block_size=block_size, num_blocks=pool, max_num_seqs=max_num_seqs, sampling_seed=seed,
                  enable_prefix_caching=False, **over).engine
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, params)
        outs, tbt, preempt, blocks = {}, [], 0, 0
        c0, w0 = time.thread_time(), time.perf_counter()
        while eng.has_unfinished_requests():
            st = eng.step()
            preempt += len(st.preempted)
            blocks += st.num_swapped_out_blocks + st.num_swapped_in_blocks
            if st.scheduled and all(c.is_decode for c in st.scheduled):
                tbt.append(st.step_time_s * 1e3)
            for o in st.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
        cpu, wall = time.thread_time() - c0, time.perf_counter() - w0
        toks = [outs[str(i)] for i in range(len(prompts))]
        ref = toks if ref is None else ref
        sw = eng.runner.swap
        rows.append(dict(variant=name, num_blocks=pool, num_preemptions=preempt, swapped_blocks=blocks,
                         link_mb=(sw.bytes_out + sw.bytes_in) / 1e6, host_block_bytes=sw.host_block_bytes(),
                         cpu_s=cpu, wall_s=wall, out_tok_per_cpu_s=len(prompts) * max_tokens / cpu,
                         tbt_p50_ms=float(np.percentile(tbt, 50)) if tbt else float("nan"),
                         tbt_p99_ms=float(np.percentile(tbt, 99)) if tbt else float("nan"),
                         same_outputs=toks == ref, prefetch_hits=sw.num_prefetch_hits))
    df = pd.DataFrame(rows)
    df["throughput_vs_recompute"] = df["out_tok_per_cpu_s"] / df["out_tok_per_cpu_s"].iloc[0]
    df.attrs["config"] = dict(model=loaded.config.name, num_requests=num_requests, prompt_len=prompt_len,
                              max_tokens=max_tokens, num_blocks=pool, device=device)
    return df


__all__ = ["ENGINE_VARIANTS", "compare_modes", "cost_table", "engine_swap_study", "pressure_prompts",
           "pressure_workload", "simulate_modes"]
