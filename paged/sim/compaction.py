"""Block compaction in the simulator: the same scheduler and manager run the passes, and the cost
model charges each copied block like a copy-on-write copy (HBM read + write of the block's bytes);
it credits no speed-up for contiguous tables (none was measured on this engine: see
``paged.engine.compaction_bench``), so the simulated question is only what the copies cost at scale.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from .simulator import SimConfig, Simulator

__all__ = ["compaction_sim_table"]


def compaction_sim_table(requests: int = 400, *, model: str = "llama-2-7b", gpu: str = "a100-80gb",
                         num_blocks: int = 3000, threshold: float = 0.05, interval: int = 16,
                         seed: int = 0) -> pd.DataFrame:
    """One row per setting (off, on) of a Poisson workload (20 req/s, prompts 32-1023, outputs
    32-511 tokens): steps, passes, copies, GiB copied, simulated seconds and output throughput."""
    rng = np.random.default_rng(seed)
    trace = pd.DataFrame(dict(arrival_time=np.cumsum(rng.exponential(0.05, requests)),
                              prompt_tokens=rng.integers(32, 1024, requests),
                              output_tokens=rng.integers(32, 512, requests)))
    rows = []
    for on in (False, True):
        cfg = SimConfig(model=model, gpu=gpu, num_blocks=num_blocks, enable_block_compaction=on,
                        compaction_threshold=threshold, compaction_interval=interval, seed=seed)
        sim = Simulator(cfg)
        r = sim.run(trace)
        s = r.steps
        copies = int(s["num_compaction_copies"].sum())
        rows.append(dict(compaction=on, model=model, gpu=gpu, steps=len(s),
                         passes=int((s["num_compaction_copies"] > 0).sum()), copies=copies,
                         gib_copied=copies * sim.block_bytes / 2**30,
                         sim_seconds=float(s["step_time_s"].sum()), throughput_tok_s=r.summary["throughput_tok_s"]))
    return pd.DataFrame(rows)
