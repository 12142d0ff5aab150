"""The scenarios of notebook 00's tour: one workload and engine setting per mechanism to watch.

A scenario is data: `settings` are EngineConfig fields (applied with `Run.fresh`), `builder`
names a workload function of `paged.runs` called as ``builder(tokenizer, **kwargs)``; each shows its
mechanism within a few dozen steps on a laptop CPU. ``scenario_run(run, name)`` builds one (a fresh
Run over the same loaded model); ``sim_burst`` is the simulated 70B trace that fills its pool.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from paged.errors import ConfigError

__all__ = ["SCENARIOS", "Scenario", "scenario_run", "sim_burst"]


@dataclass(frozen=True)
class Scenario:
    description: str
    settings: dict[str, Any]
    builder: str                      # name of a workload function in paged.runs
    kwargs: dict[str, Any] = field(default_factory=dict)
    views: tuple[str, ...] = ("grid", "timeline")


SCENARIOS: dict[str, Scenario] = {
    "chat": Scenario(
        "Eight chats share one system prompt; request 0 asks for two samples. Watch prefix-cache hits "
        "(the prompt's first block is computed once) and one copy-on-write.",
        dict(num_blocks=32), "chat_workload", dict(num_requests=8, n=2, max_tokens=40)),
    "parallel sampling": Scenario(
        "One prompt, six samples: the samples share every prompt block (orange) and each but the last "
        "copies the partly filled last block before writing its first token (n − 1 = 5 copies).",
        dict(num_blocks=32), "chat_workload", dict(num_requests=1, n=6, max_tokens=40), ("grid", "tables")),
    "memory pressure": Scenario(
        "Ten chats arrive one step apart into 16 blocks: the pool runs out, the newest request is "
        "preempted (red x on the timeline) and recomputed when there is room again.",
        dict(num_blocks=16), "chat_workload", dict(num_requests=10, max_tokens=48, arrive_every=1)),
    "long prompts": Scenario(
        "Four chats decode while two 384-token prompts arrive; chunked prefill with a 64-token budget "
        "spreads each prompt over several steps (orange bars) so the decodes (blue) keep going.",
        dict(num_blocks=96, enable_chunked_prefill=True, max_num_batched_tokens=64), "interference_workload",
        dict(num_decoders=4, decode_tokens=48, num_long=2, long_prompt_tokens=384, long_every=6)),
}


def scenario_run(run, name: str):
    """A fresh `Run` over `run`'s loaded model with scenario `name`'s settings and workload."""
    if name not in SCENARIOS:
        raise ConfigError(f"unknown scenario {name!r}; choose one of {sorted(SCENARIOS)}")
    from paged import runs

    s = SCENARIOS[name]
    return run.fresh(workload=getattr(runs, s.builder)(run.tokenizer, **s.kwargs), **s.settings)


def sim_burst(num_requests: int = 1500, workload: str = "sharegpt", rate: float = math.inf, seed: int = 0,
              context: int = 4096):
    """A trace that fills a 70B deployment's pool: `num_requests` chats arriving at `rate` per second
    (inf: all at once), cut to `context` tokens. Pair it with ``SimConfig(max_num_seqs=1024)``: at 256
    sequences a 70B on four 80 GB GPUs uses about a sixth of its pool on ShareGPT-like chats."""
    from paged.sim.workload import fit_to_context, synthetic_trace
    return fit_to_context(synthetic_trace(workload, num_requests, rate=rate, trace_seed=seed), context)
