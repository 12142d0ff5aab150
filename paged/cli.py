"""Command line: ``python -m paged {simulate,sweep,demo}``.

- ``simulate``: one simulated deployment; a readable summary (progress bar on long runs) or one
  JSON object with ``--json``.
- ``sweep``: a grid (``--grid key=v1,v2`` repeated; keys are ``SimConfig`` fields or trace keys)
  through ``paged.sweep`` (worker processes, or Ray with ``--backend ray``; finished points kept
  in a store beside ``--out``, so a re-run resumes) into a tidy CSV or Parquet file.
- ``demo``: the headline report (markdown + CSV): the embedded SmolLM2 through our paged cache
  on this machine (step log, prefix hits, preemption, KV formats), then simulated runs: the vLLM
  paper's memory story and the prefill/decode interference table.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import sys
import time
import typing
from typing import Any, Sequence

from paged.errors import PagedError

# SimConfig knobs the CLI does not expose, and the spelling of the flags that differ from --knob-name
_SIM_HIDDEN = ("record_events", "kv_share_with")
_FLAG_NAMES = {"tensor_parallel": ("--tensor-parallel", "--tp"), "enable_chunked_prefill": ("--chunked-prefill",),
               "enable_prefix_caching": ("--prefix-caching",),
               "max_num_batched_tokens": ("--max-num-batched-tokens", "--token-budget")}
_GROUPS = {None: "deployment and cost model (SimConfig)", "cache": "KV cache (CacheConfig, shared with the engine)",
           "scheduler": "scheduler (SchedulerConfig, shared with the engine)"}


def _sim_knobs() -> dict[str, tuple[str | None, dataclasses.Field]]:
    """``SimConfig`` knob -> (its part, its field), deployment first, then cache and scheduler."""
    from paged.sim.simulator import SimConfig

    knobs = {n: (SimConfig.part_of(n), f) for n, f in SimConfig.knob_fields().items()}
    order = sorted(knobs, key=lambda n: (knobs[n][0] is not None, knobs[n][0] == "scheduler"))
    return {n: knobs[n] for n in order if n not in _SIM_HIDDEN}


def _sim_kinds() -> dict[str, type]:
    """``SimConfig`` knob -> the type its values take (``int | None`` -> int; object for callables)."""
    from paged.sim.simulator import SimConfig

    hints = typing.get_type_hints(SimConfig)
    kinds = {name: next(t for t in (typing.get_args(hints[name]) or (hints[name],)) if t is not type(None))
             for name in SimConfig.knob_fields()}
    return {name: (kind if isinstance(kind, type) else object) for name, kind in kinds.items()}


def _add_sim_args(p: argparse.ArgumentParser) -> None:
    """One flag per ``SimConfig`` knob (type and default from its config class), plus the workload."""
    from paged.core.config import KV_CACHE_DTYPES, SWAP_COMPRESSIONS, SWAP_MODES
    from paged.core.eviction import POLICIES
    from paged.core.prefix_cache import HASH_FUNCTIONS
    from paged.sim.config import LINEAR_MODELS
    from paged.sim.simulator import ALLOCATORS
    from paged.sim.specs import GPU_PRESETS, MODEL_PRESETS
    from paged.sim.workload import WORKLOADS

    extra: dict[str, dict[str, Any]] = {
        "model": dict(help=f"preset ({', '.join(MODEL_PRESETS)}) or config.json path"),
        "gpu": dict(help=f"preset: {', '.join(GPU_PRESETS)}"),
        "num_blocks": dict(help="KV blocks per GPU (default: what fits)"),
        "kv_cache_memory_bytes": dict(help="KV-cache bytes per GPU (used without --num-blocks)"),
        "eviction": dict(metavar="POLICY", help=f"GPU prefix-cache eviction: {', '.join(POLICIES)}, or "
                                                "'score:decay=..,size_weight=..'"),
        "host_eviction": dict(metavar="POLICY", help=f"host-tier eviction: {', '.join(POLICIES)}, or 'score:...'"),
        "kv_cache_dtype": dict(choices=KV_CACHE_DTYPES, help="'auto': the model's dtype"),
        "hash_fn": dict(choices=sorted(HASH_FUNCTIONS)), "allocator": dict(choices=ALLOCATORS),
        "swap_mode": dict(choices=SWAP_MODES), "swap_compression": dict(choices=[c for c in SWAP_COMPRESSIONS if c]),
        "swap_space_gib": dict(help="GiB of host memory per GPU for swap and the host tier (default 4)"),
        "preemption_mode": dict(choices=("recompute", "swap")), "policy": dict(choices=("fcfs", "priority")),
        "max_num_batched_tokens": dict(help="token budget per step (default: 2048 with chunked prefill, "
                                            "else max(2048, max_model_len))"),
        "linear": dict(choices=LINEAR_MODELS, help="weights part: per-kernel model fitted to vidur's measured "
                                                   "profiles (a100-80gb, h100-sxm, a40; default: closed form)"),
        "calibration": dict(metavar="STEPS.csv", help="fit the cost model to engine steps saved with "
                                                      "paged.sim.cost_model.calibration_frame"),
    }
    kinds = _sim_kinds()
    groups = {part: p.add_argument_group(title) for part, title in _GROUPS.items()}
    for name, (part, f) in _sim_knobs().items():
        kind = kinds[name]
        names = _FLAG_NAMES.get(name, ("--" + name.replace("_", "-"),))
        kw: dict[str, Any] = dict(dest=name, default=f.default, **extra.get(name, {}))
        if kind is bool:
            groups[part].add_argument(*names, action=argparse.BooleanOptionalAction, **kw)
        else:
            groups[part].add_argument(*names, type=str if kind is object else kind, **kw)
    w = p.add_argument_group("workload")
    w.add_argument("--workload", default="sharegpt", choices=sorted(WORKLOADS))
    w.add_argument("--trace", default=None, help="trace file, read by content (CSV paged/vidur/azure, JSONL LLMServingSim/Mooncake, gzipped or not); overrides --workload")
    w.add_argument("--num-requests", "-n", type=int, default=None,
                   help="requests to generate (default 1000), or the first N rows of --trace (default all)")
    w.add_argument("--rate", type=float, default=math.inf, help="requests/s (inf: all at t=0)")
    w.add_argument("--arrival", choices=("poisson", "gamma", "fixed"), default="poisson")
    w.add_argument("--cv", type=float, default=2.0, help="coefficient of variation of gamma gaps")
    w.add_argument("--num-prefixes", type=int, default=0)
    w.add_argument("--prefix-tokens", type=int, default=0)
    w.add_argument("--prefix-fraction", type=float, default=1.0, help="share of requests with a shared prefix")
    w.add_argument("--prefix-zipf", type=float, default=0.0,
                   help="tenant popularity: prefix i drawn ~ 1/(i+1)^s (0: uniform)")
    w.add_argument("--trace-seed", type=int, default=0, help="seed of the synthetic trace (lengths, arrivals)")


def _sim_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name in _sim_knobs()}


def _trace_keys(args: argparse.Namespace) -> dict[str, Any]:
    """The workload flags as ``paged.studies.grid.trace_for`` keys (``TRACE_KEYS``, one flag each)."""
    from paged.studies.grid import TRACE_KEYS

    return {key: getattr(args, key) for key in TRACE_KEYS}


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v != v:
            return "nan"
        if abs(v) >= 1000 or v == 0:
            return f"{v:,.1f}" if abs(v) < 1e9 else f"{v:.3g}"
        return f"{v:.4g}"
    return str(v)


def format_summary(summary: dict[str, Any]) -> str:
    """Key/value table of a run summary."""
    width = max(len(k) for k in summary)
    return "\n".join(f"{k:<{width}}  {_fmt(v)}" for k, v in summary.items())


def json_safe(summary: dict[str, Any]) -> dict[str, Any]:
    """Summary values as strict JSON: numpy scalars become Python numbers and NaN/inf become null
    (``json.dumps`` would print the bare tokens ``NaN``/``Infinity``, which JSON parsers reject)."""
    out: dict[str, Any] = {}
    for k, v in summary.items():
        if hasattr(v, "item") and not isinstance(v, (str, bytes)):
            v = v.item()
        if isinstance(v, float) and not math.isfinite(v):
            v = None
        out[k] = v
    return out


def cmd_simulate(args: argparse.Namespace) -> int:
    from paged.sim.simulator import SimConfig, Simulator
    from paged.studies.grid import trace_for

    sim = Simulator(SimConfig(**_sim_kwargs(args)))
    tr = trace_for(_trace_keys(args), sim.max_model_len)
    show_bar = not args.json and not args.no_progress and len(tr) >= 500 and sys.stderr.isatty()
    res = sim.run(tr, progress=show_bar)
    if args.requests_out:
        res.requests.to_csv(args.requests_out, index=False)
    if args.steps_out:
        res.steps.to_csv(args.steps_out, index=False)
    print(json.dumps(json_safe(res.summary), allow_nan=False) if args.json else format_summary(res.summary))
    return 0


def _parse_value(v: str) -> Any:
    low = v.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


def parse_grid(specs: Sequence[str]) -> dict[str, list[Any]]:
    """``["block_size=8,16", "allocator=paged"]`` -> ``{"block_size": [8, 16], "allocator": ["paged"]}``."""
    from paged.studies.grid import point_keys

    fields = set(point_keys())
    grid: dict[str, list[Any]] = {}
    for spec in specs:
        key, sep, vals = spec.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not vals:
            raise PagedError(f"--grid {spec!r}: write key=v1,v2,...")
        if key not in fields:
            raise PagedError(f"--grid {spec!r}: unknown key {key!r}; use one of {sorted(fields)}")
        grid[key] = [_parse_value(v.strip()) for v in vals.split(",")]
        kind = _GRID_KINDS.get(key) or _sim_kinds().get(key)
        for v in grid[key]:
            # a bool is an int to isinstance: true/false only where the knob takes booleans
            ok = kind is None or v is None or (kind in (bool, object) if isinstance(v, bool)
                                               else isinstance(v, kind) or (kind is float and isinstance(v, int)))
            if not ok:
                raise PagedError(f"--grid {spec!r}: {key} takes {kind.__name__} values, got {v!r}")
    return grid


_GRID_KINDS = {"num_requests": int, "rate": float, "cv": float, "trace_seed": int, "num_prefixes": int,
               "prefix_tokens": int, "prefix_fraction": float, "prefix_zipf": float, "workload": str, "arrival": str,
               "trace": str}


def cmd_sweep(args: argparse.Namespace) -> int:
    from paged.sweeps import sweep

    base = {**_sim_kwargs(args), **_trace_keys(args)}
    # -n: requests to generate (default 1000), or the first N rows of --trace (default all), as in simulate
    base["num_requests"] = args.num_requests if args.trace else (args.num_requests or 1000)
    grid = parse_grid(args.grid)
    keys = list(grid)
    points = [{**base, **dict(zip(keys, combo))} for combo in itertools.product(*grid.values())]
    out = args.out
    if out.endswith(".parquet"):
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            try:
                import fastparquet  # noqa: F401
            except ImportError:
                raise PagedError("writing Parquet needs pyarrow or fastparquet; pip install pyarrow, "
                                 "or give --out a .csv path") from None
    t0 = time.perf_counter()
    store = False if args.no_store else (args.store or os.path.splitext(out)[0] + ".points")
    df = sweep("simulate", points, backend=args.backend, jobs=args.jobs, address=args.address, store=store,
               force=args.force, progress=not args.no_progress and sys.stderr.isatty())
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    (df.to_parquet if out.endswith(".parquet") else df.to_csv)(out, index=False)
    cols = keys + [c for c in ("requests_finished", "throughput_req_s", "throughput_tok_s", "ttft_p99_s",
                               "tbt_p99_s", "kv_token_usage_mean", "num_preemptions") if c in df.columns]
    print(df[cols].to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    info = df.attrs["sweep"]
    for err in df.loc[df["status"] != "ok", "error"].drop_duplicates()[:3]:
        print(f"failed: {err}", file=sys.stderr)
    print(f"\n{len(df)} runs in {time.perf_counter() - t0:.1f} s ({info['cached']} from {info['store']}, "
          f"{info['errors'] + info['lost']} failed) -> {out}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """The embedded model through our paged cache on this machine, then the simulated studies."""
    from paged.studies.demo import demo_report

    md, path = demo_report(args.out, num_requests=args.num_requests, jobs=args.jobs, model=args.model,
                           engine_requests=args.engine_requests, engine_blocks=args.engine_blocks,
                           max_tokens=args.max_tokens)
    print(md)
    print(f"wrote {path} and the CSV files beside it")
    return 0


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: a flag has one spelling (argparse would take --swap-space for --swap-space-gib)
    p = argparse.ArgumentParser(prog="python -m paged", description="paged-KV workbench", allow_abbrev=False)
    sub = p.add_subparsers(dest="command", required=True)
    sim = sub.add_parser("simulate", allow_abbrev=False, help="simulate one deployment with the engine's scheduler")
    _add_sim_args(sim)
    sim.add_argument("--json", action="store_true", help="print one JSON object")
    sim.add_argument("--no-progress", action="store_true")
    sim.add_argument("--requests-out", default=None, help="write per-request metrics CSV")
    sim.add_argument("--steps-out", default=None, help="write per-step metrics CSV")
    sim.set_defaults(func=cmd_simulate)
    sw = sub.add_parser("sweep", allow_abbrev=False, help="run a grid of simulations in parallel into CSV/Parquet")
    _add_sim_args(sw)
    sw.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                    help="a swept setting (repeatable), e.g. --grid block_size=8,16,32 --grid rate=1,2,4")
    sw.add_argument("--out", default="sweep.csv", help=".csv or .parquet")
    sw.add_argument("--jobs", "-j", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    sw.add_argument("--no-progress", action="store_true")
    sw.add_argument("--backend", choices=("local", "ray"), default="local", help="ray: one Ray task per point")
    sw.add_argument("--address", default=None, help="Ray cluster: auto or ray://head:10001 (default: a local instance)")
    sw.add_argument("--store", default=None, help="point store folder (default: --out without suffix + .points)")
    sw.add_argument("--no-store", action="store_true", help="keep no per-point results (no resume)")
    sw.add_argument("--force", action="store_true", help="recompute points already stored")
    sw.set_defaults(func=cmd_sweep)
    demo = sub.add_parser("demo", allow_abbrev=False, help="write the headline report (markdown + CSV)")
    demo.add_argument("--out", default="reports")
    demo.add_argument("--num-requests", "-n", type=int, default=2000)
    demo.add_argument("--jobs", "-j", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    demo.add_argument("--model", default="smollm2", help="real-engine part: embedded default, GGUF or HF dir")
    demo.add_argument("--engine-requests", type=int, default=12, help="0 skips the real-engine part")
    demo.add_argument("--engine-blocks", type=int, default=24)
    demo.add_argument("--max-tokens", type=int, default=48)
    demo.set_defaults(func=cmd_demo)
    from paged.quant.cli import add_parser as add_quant_parser  # KV quantization study (issue 10)
    add_quant_parser(sub)
    return p


def _check_args(args: argparse.Namespace) -> None:
    """What argparse cannot check, before anything runs (one-line errors naming the flag)."""
    n = getattr(args, "num_requests", None)
    if n is not None and n < 1:
        raise PagedError(f"--num-requests (-n) must be >= 1, got {n}")
    rate = getattr(args, "rate", None)
    if rate is not None and not (rate > 0):  # nan fails too
        raise PagedError(f"--rate must be > 0 requests/s (inf: all at t=0), got {rate}")
    for flag in ("requests_out", "steps_out"):
        path = getattr(args, flag, None)
        if path and not os.path.isdir(folder := os.path.dirname(os.path.abspath(path))):
            raise PagedError(f"--{flag.replace('_', '-')} {path}: folder {folder} does not exist; create it first")
    if args.command == "demo" and os.path.exists(args.out) and not os.path.isdir(args.out):
        raise PagedError(f"--out {args.out} is a file; give a folder for the report (it is created if missing)")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _check_args(args)
        return args.func(args)
    except PagedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
