"""The host tier on the real engine at small scale: recompute evicted prefixes vs bring them
back from host memory, same requests, same greedy outputs (checked), measured side by side.

``engine_tier_study`` runs one workload (requests sharing one of ``num_prefixes`` prefixes of
``prefix_blocks`` blocks, Zipf popularity, submitted in waves of ``max_num_seqs``) under each
variant on one loaded model (default: a tiny random Llama; ``model="smollm2"`` for the real
one) and returns one row per variant: ``paged.telemetry.tier_metrics`` plus prefill tokens
computed, wall time and throughput, and whether the outputs equal the first variant's.
"""
from __future__ import annotations

import random
import tempfile
import time
from typing import Any

import pandas as pd

from paged import telemetry

__all__ = ["ENGINE_VARIANTS", "engine_tier_study"]

ENGINE_VARIANTS: dict[str, dict[str, Any]] = {
    "recompute (no host tier)": dict(enable_host_tier=False),
    "host tier, LRU": dict(enable_host_tier=True),
    "host tier, score": dict(enable_host_tier=True, eviction="score:decay=0.999,size_weight=-0.5",
                             host_eviction="score:decay=0.999,size_weight=-0.5"),
}


def _workload(num_requests: int, num_prefixes: int, prefix_len: int, vocab: int, zipf: float,
              seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    weights = [1.0 / (i + 1) ** zipf for i in range(num_prefixes)]
    return [rng.choices(prefixes, weights)[0] + [rng.randrange(vocab) for _ in range(rng.randrange(1, 24))]
            for _ in range(num_requests)]


def engine_tier_study(model: str | None = None, *, num_requests: int = 48, num_prefixes: int = 8,
                      prefix_blocks: int = 6, block_size: int = 16, num_blocks: int = 48, num_cpu_blocks: int = 96,
                      max_num_seqs: int = 4, max_tokens: int = 8, zipf: float = 1.0,
                      variants: dict[str, dict[str, Any]] | None = None, seed: int = 0,
                      device: str = "cpu") -> pd.DataFrame:
    """One row per variant (name -> ``EngineConfig`` overrides; default ``ENGINE_VARIANTS``).
    The GPU pool (``num_blocks``) is smaller than the prefixes' working set
    (``num_prefixes x prefix_blocks``), so shared prefixes are evicted between their uses."""
    from paged.engine import LLM, SamplingParams
    from paged.models import load_model

    if model is None:
        from paged.models.testing import make_tiny_checkpoint
        model = make_tiny_checkpoint(tempfile.mkdtemp(prefix="paged-tier-"), "llama")
    loaded = load_model(model, device=device) if isinstance(model, str) else model
    vocab = loaded.config.vocab_size
    prompts = _workload(num_requests, num_prefixes, prefix_blocks * block_size, min(vocab, 32000), zipf, seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rows, first = [], None
    for name, over in (variants or ENGINE_VARIANTS).items():
        kw = dict(block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs, seed=seed,
                  num_cpu_blocks=num_cpu_blocks if over.get("enable_host_tier") else 0, **over)
        llm = LLM(loaded, **kw)
        eng = llm.engine
        steps, outs = [], {}
        t0 = time.perf_counter()
        for w in range(0, len(prompts), max_num_seqs):
            for i in range(w, min(w + max_num_seqs, len(prompts))):
                eng.add_request(str(i), prompts[i], params)
            while eng.has_unfinished_requests():
                s = eng.step()
                steps.append(s.to_row())
                for o in s.finished:
                    outs[o.request_id] = tuple(o.outputs[0].token_ids)
        wall = time.perf_counter() - t0
        st = telemetry.steps_frame(steps)
        first = outs if first is None else first
        block_bytes = eng.runner.swap.device_block_bytes()
        gen = sum(len(v) for v in outs.values())
        rows.append({"variant": name, "num_gpu_blocks": num_blocks, "num_cpu_blocks": eng.kv_manager.num_cpu_blocks,
                     **telemetry.tier_metrics(st, block_bytes),
                     "prefill_tokens_computed": int(st["num_prefill_tokens"].sum()),
                     "wall_s": wall, "throughput_tok_s": gen / wall, "outputs_match_first": outs == first,
                     "blocks_in_use_at_end": eng.kv_manager.num_used_blocks})
    return pd.DataFrame(rows)
