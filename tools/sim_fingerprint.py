"""Fingerprint the simulator: run fixed configurations on one fixed trace, pickle every result,
and compare two fingerprints exactly (bit for bit: frames with ``check_exact``, summaries with ``==``).

Used to show that a refactor leaves every simulated number unchanged:

    # the baseline, from a detached checkout of the base commit
    git worktree add --detach /tmp/base57 57974d7
    PYTHONPATH=/tmp/base57 .venv/bin/python tools/sim_fingerprint.py write /tmp/fp_base.pkl
    # this checkout, compared with it (exit status 1 and a diff on any difference)
    PYTHONPATH=$PWD .venv/bin/python tools/sim_fingerprint.py compare /tmp/fp_base.pkl

``compare`` reruns every configuration on the trace stored in the baseline file (so a change in
the trace generator cannot hide or fake a difference). ``--only NAME`` runs a subset;
``--hash-fn NAME`` forces a block-hash function in every configuration (prefix hits are verified
on tokens, so the hash must not change a number: compare a builtin run with an xxh3_128 run).
``--spelling`` picks the configuration names: ``old`` (``kv_format``, ``swap_overlap``,
``swap_space_gib``: what the base commit understands), ``new`` (``kv_cache_dtype``, ``swap_mode``,
``swap_space`` or, where the checkout names its unit, ``swap_space_gib``), ``auto`` (new when the
checkout has them). The trace's seed goes by the name ``synthetic_trace`` takes (``seed`` or ``trace_seed``). Wall-clock summary keys are dropped;
summary keys renamed since the base (``RENAMED_KEYS``) are compared under their new name, and
the KV format by its canonical name (``canonical``).
"""
from __future__ import annotations

import argparse
import math
import pickle
import sys
import time
import warnings
from typing import Any

import numpy as np
import pandas as pd

SMALL = dict(model="llama-2-7b", gpu="a100-40gb", num_blocks=600)

# name -> SimConfig keywords, in the base commit's spelling (translated by `spelled`)
CONFIGS: dict[str, dict[str, Any]] = {
    "fcfs": dict(SMALL),
    "priority": dict(SMALL, policy="priority"),
    "swap": dict(SMALL, preemption_mode="swap", swap_space_gib=1.0),
    "swap_overlap_int4": dict(SMALL, preemption_mode="swap", swap_space_gib=1.0, swap_overlap=True,
                              swap_compression="int4"),
    "block_size_1": dict(SMALL, block_size=1, num_blocks=9600),
    "no_chunking": dict(SMALL, enable_chunked_prefill=False),
    "chunked_512": dict(SMALL, max_num_batched_tokens=512),
    "small_budget": dict(SMALL, max_num_batched_tokens=256, max_num_seqs=16, watermark=0.05),
    "host_tier": dict(SMALL, enable_host_tier=True, host_eviction="score", swap_space_gib=0.5),
    "eviction_lfu": dict(SMALL, eviction="lfu"),
    "compaction": dict(SMALL, enable_block_compaction=True, compaction_threshold=0.05, compaction_interval=4),
    "contiguous_max": dict(SMALL, allocator="contiguous-max"),
    "contiguous_oracle": dict(SMALL, allocator="contiguous-oracle"),
    "no_prefix_caching": dict(SMALL, enable_prefix_caching=False),
    "sized_int8": dict(model="llama-2-13b", gpu="a100-40gb", kv_format="int8"),
    "tp2_fp8_bs32": dict(model="llama-2-13b", gpu="h100-sxm", tensor_parallel=2, kv_format="fp8", block_size=32),
}

WALL_KEYS = ("wall_s", "sim_requests_per_wall_s")
RENAMED_KEYS = {"kv_format": "kv_cache_dtype"}  # summary keys of the base commit -> today's name


def canonical(key: str, value: Any) -> Any:
    """A summary value as compared: the KV format by its canonical name (the base commit reported
    the spelling given, e.g. 'fp8'; today's config stores the canonical 'fp8_e4m3')."""
    if key == "kv_cache_dtype" and isinstance(value, str):
        from kernels.format_table import lookup
        return lookup(value).name
    return value


def make_trace(num_requests: int = 300, seed: int = 7) -> pd.DataFrame:
    """A ShareGPT-like Poisson trace with shared prefixes on half the requests and priorities 0-2."""
    import inspect

    from paged.sim.workload import synthetic_trace

    seed_name = "trace_seed" if "trace_seed" in inspect.signature(synthetic_trace).parameters else "seed"
    tr = synthetic_trace("sharegpt", num_requests, rate=25.0, max_model_len=4096, num_prefixes=4,
                         prefix_tokens=256, prefix_fraction=0.5, **{seed_name: seed})
    tr["priority"] = np.random.default_rng(seed).integers(0, 3, len(tr))
    return tr


def _fields() -> set[str]:
    import dataclasses

    from paged.sim.simulator import SimConfig
    return {f.name for f in dataclasses.fields(SimConfig)}


def has_new_names() -> bool:
    from paged.sim.simulator import SimConfig
    return hasattr(SimConfig, "knobs") or "kv_cache_dtype" in _fields()


def spelled(kw: dict[str, Any], spelling: str) -> dict[str, Any]:
    """``kw`` in the base spelling, or translated to today's names."""
    if spelling == "auto":
        spelling = "new" if has_new_names() else "old"
    if spelling == "old":
        return dict(kw)
    out = {}
    for k, v in kw.items():
        if k == "kv_format":
            out["kv_cache_dtype"] = v
        elif k == "swap_space_gib":
            out["swap_space_gib" if "swap_space_gib" in _fields() else "swap_space"] = v
        elif k == "swap_overlap":
            out["swap_mode"] = "overlap" if v else "sync"
        else:
            out[k] = v
    return out


def run_all(trace: pd.DataFrame, names: list[str], spelling: str, hash_fn: str | None) -> dict[str, Any]:
    from paged.sim.simulator import SimConfig, Simulator

    runs = {}
    for name in names:
        kw = spelled(CONFIGS[name], spelling)
        if hash_fn is not None:
            kw["hash_fn"] = hash_fn
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # old spellings on purpose
            res = Simulator(SimConfig(**kw)).run(trace)
        summary = {RENAMED_KEYS.get(k, k): v for k, v in res.summary.items() if k not in WALL_KEYS}
        runs[name] = dict(requests=res.requests, steps=res.steps, summary=summary)
        print(f"{name:<20} {len(res.steps):>6} steps {time.perf_counter() - t0:6.2f} s", file=sys.stderr)
    return runs


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def compare(base: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Every difference between two fingerprints' runs, as readable lines (empty: identical)."""
    diffs = []
    for name, b in base.items():
        n = new[name]
        for frame in ("requests", "steps"):
            try:
                pd.testing.assert_frame_equal(b[frame], n[frame], check_exact=True)
            except AssertionError as e:
                diffs.append(f"{name}.{frame}: {str(e).splitlines()[:6]}")
        bs, ns = b["summary"], n["summary"]
        if list(bs) != list(ns):
            diffs.append(f"{name}.summary keys: {sorted(set(bs) ^ set(ns))} (order {list(bs) == list(ns)})")
        for k in bs:
            if k in ns and not _same(canonical(k, bs[k]), canonical(k, ns[k])):
                diffs.append(f"{name}.summary[{k!r}]: {bs[k]!r} != {ns[k]!r}")
    return diffs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=("write", "compare"))
    p.add_argument("path", help="fingerprint pickle: written by 'write', read by 'compare'")
    p.add_argument("--only", nargs="*", default=None, choices=sorted(CONFIGS))
    p.add_argument("--spelling", choices=("auto", "old", "new"), default="auto")
    p.add_argument("--hash-fn", default=None)
    p.add_argument("--save", default=None, help="compare: also write this run's fingerprint here")
    args = p.parse_args(argv)
    names = args.only or list(CONFIGS)
    if args.action == "write":
        trace = make_trace()
        runs = run_all(trace, names, args.spelling, args.hash_fn)
        with open(args.path, "wb") as f:
            pickle.dump(dict(trace=trace, runs=runs), f)
        print(f"wrote {len(runs)} runs to {args.path}")
        return 0
    with open(args.path, "rb") as f:
        base = pickle.load(f)
    runs = run_all(base["trace"], names, args.spelling, args.hash_fn)
    if args.save:
        with open(args.save, "wb") as f:
            pickle.dump(dict(trace=base["trace"], runs=runs), f)
    diffs = compare({k: base["runs"][k] for k in names}, runs)
    for d in diffs:
        print(d)
    print(f"{len(names)} configurations: " + ("BIT-IDENTICAL" if not diffs else f"{len(diffs)} differences"))
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
