"""Simulator benchmarks: speed (simulated requests per wall second) and the must-show studies.

    python benchmarks/simulator.py                 # speed: 10,000 ShareGPT-like requests, Llama-2-13B, A100-80GB
    python benchmarks/simulator.py --studies       # + memory story, interference, block-size ablation tables
    python benchmarks/simulator.py -n 2000 --profile   # cProfile of the simulation loop (top functions)
    python benchmarks/simulator.py --calibrate     # fit the cost model to SmolLM2 steps on this CPU

Every number is measured here, in this process; nothing is copied from elsewhere.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from paged.sim.simulator import SimConfig, Simulator  # noqa: E402
from paged.sim.workload import synthetic_trace  # noqa: E402
from paged.studies.papers import block_size_ablation, interference_study, memory_story  # noqa: E402


def speed(n: int, profile: bool, model: str, gpu: str, rate: float) -> dict:
    trace = synthetic_trace("sharegpt", n, trace_seed=0, rate=rate)
    sim = Simulator(SimConfig(model=model, gpu=gpu))
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    res = sim.run(trace)
    if prof:
        prof.disable()
    wall = time.perf_counter() - t0
    s = res.summary
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    request_steps = int(res.steps["num_seqs"].sum())
    return {"requests": n, "model": model, "gpu": gpu, "rate": rate, "wall_s": wall, "sim_req_per_wall_s": n / wall,
            "steps": s["num_steps"], "request_steps": request_steps, "us_per_request_step": wall / request_steps * 1e6,
            "simulated_s": s["duration_s"], "sim_speedup_vs_real_time": s["duration_s"] / wall,
            "preemptions": s["num_preemptions"], "blocks_in_use_at_end": s["num_blocks_in_use_at_end"]}


def record_engine_steps(num_requests: int = 48, seed: int = 0, block_size: int = 16, budget: int = 512):
    """Run the real engine (SmolLM2-135M, fp32, CPU) on mixed requests and return its StepOutputs.

    Requests arrive in waves (a few per step) with prompts of 8-480 tokens and 4-48 output tokens,
    so steps cover pure decode batches of 1-30 sequences, chunked prefills and mixed steps.
    """
    import numpy as np
    import torch

    from paged.engine.llm_engine import EngineConfig, LLMEngine
    from paged.models.loader import load_model
    from paged.engine.sampling import SamplingParams

    torch.manual_seed(seed)
    loaded = load_model("smollm2", dtype=torch.float32, device=torch.device("cpu"))
    eng = LLMEngine(loaded, EngineConfig(block_size=block_size, num_blocks=1024, max_num_batched_tokens=budget,
                                         record_events=False, enable_prefix_caching=False))
    rng = np.random.default_rng(seed)
    vocab = loaded.config.vocab_size
    pending = [(rng.integers(20, vocab, int(rng.integers(8, 480))).tolist(), int(rng.integers(4, 48)))
               for _ in range(num_requests)]
    steps, k = [], 0
    for _ in range(3):  # warm-up (allocator, kernels) outside the record
        eng.add_request(f"w{_}", pending[0][0][:32], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    while pending or eng.has_unfinished_requests():
        for _ in range(int(rng.integers(0, 4))):
            if pending:
                ids, out = pending.pop()
                eng.add_request(f"r{k}", ids, SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True))
                k += 1
        if eng.has_unfinished_requests():
            steps.append(eng.step())
    return steps, loaded


def calibrate(num_requests: int, seed: int, steps_csv: str | None) -> None:
    from dataclasses import replace

    from paged.sim.specs import get_gpu, get_model
    from paged.sim.cost_model import CostModel, shapes_from_frame, calibration_frame

    t0 = time.perf_counter()
    if steps_csv and os.path.exists(steps_csv):
        frame = pd.read_csv(steps_csv)
    else:
        steps, _ = record_engine_steps(num_requests, seed)
        frame = calibration_frame(steps)
        if steps_csv:
            frame.to_csv(steps_csv, index=False)
    wall = time.perf_counter() - t0
    shapes, secs = shapes_from_frame(frame)
    model = replace(get_model("smollm2-135m"), dtype_bytes=4)  # the engine runs fp32 on CPU
    prior = CostModel(model, get_gpu("cpu"))
    rep = prior.fit(shapes, secs, holdout_fraction=0.25, seed=seed)
    prior_err = float(np.mean(np.abs(prior.predict(shapes) - secs) / secs))
    ntok = np.array([s.num_tokens for s in shapes])
    print(f"## calibration: SmolLM2-135M fp32 on this CPU, {len(shapes)} engine steps recorded in {wall:.1f} s "
          f"(tokens/step {ntok.min()}-{ntok.max()}, step time {secs.min() * 1e3:.1f}-{secs.max() * 1e3:.1f} ms)")
    row = rep.as_dict()
    row["uncalibrated_mape"] = prior_err
    print(pd.DataFrame([row]).to_string(index=False, float_format=lambda x: f"{x:.4g}"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-n", type=int, default=10_000)
    p.add_argument("--model", default="llama-2-13b")
    p.add_argument("--gpu", default="a100-80gb")
    p.add_argument("--rate", type=float, default=float("inf"))
    p.add_argument("--profile", action="store_true")
    p.add_argument("--studies", action="store_true")
    p.add_argument("-j", "--jobs", type=int, default=2)
    p.add_argument("--calibrate", action="store_true", help="only: fit the cost model to real engine steps")
    p.add_argument("--calibrate-requests", type=int, default=48)
    p.add_argument("--steps-csv", default=None, help="with --calibrate: reuse (or save) recorded engine steps")
    a = p.parse_args()
    if a.calibrate:
        calibrate(a.calibrate_requests, 0, a.steps_csv)
        return
    pd.set_option("display.width", 250)
    pd.set_option("display.max_columns", 30)
    row = speed(a.n, a.profile, a.model, a.gpu, a.rate)
    print("## speed\n" + pd.DataFrame([row]).to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    if a.studies:
        for title, df in (("memory story", memory_story(2000, jobs=a.jobs)),
                          ("interference", interference_study(600, jobs=a.jobs)),
                          ("block-size ablation", block_size_ablation(num_requests=1000, jobs=a.jobs))):
            print(f"\n## {title}\n" + df.to_string(index=False, float_format=lambda x: f"{x:.3f}"))


if __name__ == "__main__":
    main()
