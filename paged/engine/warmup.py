"""Warm-up: pay the first-call costs of a model before any request is timed.

The first forward pass of a process costs seconds that later ones do not (torch's lazy set-up of
its kernels and thread pools, the compiled CPU kernels' loading, Triton's compilation on a GPU).
Charged to the first request, they made its TTFT 2-4x its neighbours' (notebook 00: 5.1 s vs
1.2-1.9 s). ``warm_up(engine)`` runs one tiny request -- a short prefill, then a decode -- through
a scratch engine over the same loaded model, cache format and backend, with a pool of its own, so
the engine being warmed keeps every record, block and counter untouched. Done once per process
for each (model architecture, device, dtype, KV format, backend, block size).
"""
from __future__ import annotations

import dataclasses
import time

__all__ = ["warm_up"]

_warmed: set[tuple] = set()


def warm_up(engine) -> float:
    """Run the warm-up for ``engine`` if this process has not yet; returns the seconds it took."""
    key = (repr(engine.loaded.config), str(engine.device), str(engine.dtype), engine.sizing.kv_cache_dtype,
           engine.runner.backend, engine.config.block_size)
    if key in _warmed:
        return 0.0
    from .sampling import SamplingParams

    t0 = time.perf_counter()
    bs = engine.config.block_size
    prompt = max(2, min(2 * bs, engine.max_model_len - 2))
    cfg = dataclasses.replace(engine.config, warm_up=False, record_events=False, num_blocks=prompt // bs + 3,
                              kv_cache_memory_bytes=None, enable_prefix_caching=False, enable_host_tier=False,
                              host_tier_threshold=1.0, preemption_mode="recompute", num_cpu_blocks=0, swap_space_gib=None, max_model_len=None,
                              enable_block_compaction=False)
    scratch = type(engine)(engine.loaded, cfg)  # an engine of the same kind, its own pool
    vocab = engine.loaded.config.vocab_size
    scratch.add_request("warm-up", [17 + (i % max(1, vocab - 17)) for i in range(prompt)],
                        SamplingParams(max_tokens=2, ignore_eos=True))
    while scratch.has_unfinished_requests():
        scratch.step()
    _warmed.add(key)
    return time.perf_counter() - t0
