"""Command line: ``python -m paged {simulate,sweep,demo}``.

- ``simulate``: one simulated deployment; a readable summary (progress bar on long runs) or one
  JSON object with ``--json``.
- ``sweep``: a grid (``--grid key=v1,v2`` repeated; keys are ``SimConfig`` fields or trace keys)
  run in worker processes into a tidy CSV or Parquet file.
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
from typing import Any, Sequence

from paged.errors import PagedError

_SIM_FLAGS = ("model", "gpu", "tensor_parallel", "block_size", "num_blocks", "gpu_memory_utilization", "kv_format",
              "allocator", "enable_chunked_prefill", "max_num_batched_tokens", "max_num_seqs", "preemption_mode",
              "policy", "watermark", "enable_prefix_caching", "swap_space_gib", "max_model_len", "seed", "mfu", "mbu",
              "step_overhead_s", "paged_kernel_penalty", "calibration")


def _add_sim_args(p: argparse.ArgumentParser) -> None:
    from paged.sim.specs import GPU_PRESETS, KV_FORMATS, MODEL_PRESETS
    from paged.sim.simulator import ALLOCATORS
    from paged.sim.workload import WORKLOADS

    g = p.add_argument_group("deployment")
    g.add_argument("--model", default="llama-2-13b", help=f"preset ({', '.join(MODEL_PRESETS)}) or config.json path")
    g.add_argument("--gpu", default="a100-80gb", help=f"preset: {', '.join(GPU_PRESETS)}")
    g.add_argument("--tensor-parallel", "--tp", dest="tensor_parallel", type=int, default=1)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-blocks", type=int, default=None, help="KV blocks per GPU (default: what fits)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--kv-format", default="fp16", choices=sorted(KV_FORMATS))
    g.add_argument("--allocator", default="paged", choices=ALLOCATORS)
    g.add_argument("--max-model-len", type=int, default=None)
    s = p.add_argument_group("scheduler")
    s.add_argument("--chunked-prefill", dest="enable_chunked_prefill", action=argparse.BooleanOptionalAction,
                   default=True)
    s.add_argument("--max-num-batched-tokens", "--token-budget", dest="max_num_batched_tokens", type=int, default=2048)
    s.add_argument("--max-num-seqs", type=int, default=256)
    s.add_argument("--preemption-mode", choices=("recompute", "swap"), default="recompute")
    s.add_argument("--policy", choices=("fcfs", "priority"), default="fcfs")
    s.add_argument("--watermark", type=float, default=0.01)
    s.add_argument("--prefix-caching", dest="enable_prefix_caching", action=argparse.BooleanOptionalAction,
                   default=True)
    s.add_argument("--swap-space-gib", type=float, default=4.0)
    c = p.add_argument_group("cost model")
    c.add_argument("--mfu", type=float, default=None)
    c.add_argument("--mbu", type=float, default=None)
    c.add_argument("--step-overhead-s", type=float, default=None)
    c.add_argument("--paged-kernel-penalty", action=argparse.BooleanOptionalAction, default=True)
    c.add_argument("--calibration", default=None, metavar="STEPS.csv",
                   help="fit the cost model to engine steps saved with paged.sim.cost_model.calibration_frame")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", default="sharegpt", choices=sorted(WORKLOADS))
    w.add_argument("--trace", default=None, help="trace file (CSV paged/vidur/azure or JSONL); overrides --workload")
    w.add_argument("--num-requests", "-n", type=int, default=None,
                   help="requests to generate (default 1000), or the first N rows of --trace (default all)")
    w.add_argument("--rate", type=float, default=math.inf, help="requests/s (inf: all at t=0)")
    w.add_argument("--arrival", choices=("poisson", "gamma", "fixed"), default="poisson")
    w.add_argument("--cv", type=float, default=2.0, help="coefficient of variation of gamma gaps")
    w.add_argument("--num-prefixes", type=int, default=0)
    w.add_argument("--prefix-tokens", type=int, default=0)
    w.add_argument("--prefix-fraction", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)


def _sim_config(args: argparse.Namespace):
    from paged.sim.simulator import SimConfig

    return SimConfig(**{k: getattr(args, k) for k in _SIM_FLAGS})


def _trace(args: argparse.Namespace, max_model_len: int):
    from paged.sim.workload import load_trace, synthetic_trace

    if args.trace:
        tr = load_trace(args.trace)
        return tr.iloc[: args.num_requests] if args.num_requests and args.num_requests < len(tr) else tr
    return synthetic_trace(args.workload, args.num_requests or 1000, rate=args.rate, arrival=args.arrival, cv=args.cv,
                           seed=args.seed, max_model_len=max_model_len, num_prefixes=args.num_prefixes,
                           prefix_tokens=args.prefix_tokens, prefix_fraction=args.prefix_fraction)


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
    from paged.sim.simulator import Simulator

    sim = Simulator(_sim_config(args))
    tr = _trace(args, sim.max_model_len)
    show_bar = not args.json and not args.no_progress and len(tr) >= 500 and sys.stderr.isatty()
    res = sim.run(tr, progress=show_bar)
    if args.requests_out:
        res.requests.to_csv(args.requests_out, index=False)
    if args.steps_out:
        res.steps.to_csv(args.steps_out, index=False)
    if args.json:
        print(json.dumps(json_safe(res.summary), allow_nan=False))
    else:
        print(format_summary(res.summary))
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
    from paged.sim.simulator import SimConfig
    from paged.sim.studies import TRACE_KEYS

    fields = {f.name for f in dataclasses.fields(SimConfig)} | set(TRACE_KEYS)
    grid: dict[str, list[Any]] = {}
    for spec in specs:
        key, sep, vals = spec.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not vals:
            raise PagedError(f"--grid {spec!r}: write key=v1,v2,...")
        if key not in fields:
            raise PagedError(f"--grid {spec!r}: unknown key {key!r}; use one of {sorted(fields)}")
        grid[key] = [_parse_value(v.strip()) for v in vals.split(",")]
    return grid


def cmd_sweep(args: argparse.Namespace) -> int:
    from paged.sim.studies import run_grid

    base = {k: getattr(args, k) for k in _SIM_FLAGS}
    # -n: requests to generate (default 1000), or the first N rows of --trace (default all), as in simulate
    num_requests = args.num_requests if args.trace else (args.num_requests or 1000)
    base.update(workload=args.workload, num_requests=num_requests, rate=args.rate, arrival=args.arrival,
                cv=args.cv, num_prefixes=args.num_prefixes, prefix_tokens=args.prefix_tokens,
                prefix_fraction=args.prefix_fraction, trace=args.trace)
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
    df = run_grid(points, jobs=args.jobs, progress=not args.no_progress and sys.stderr.isatty())
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    if out.endswith(".parquet"):
        df.to_parquet(out, index=False)
    else:
        df.to_csv(out, index=False)
    cols = keys + [c for c in ("requests_finished", "throughput_req_s", "throughput_tok_s", "ttft_p99_s",
                               "tbt_p99_s", "kv_token_usage_mean", "num_preemptions") if c in df.columns]
    print(df[cols].to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    print(f"\n{len(df)} runs in {time.perf_counter() - t0:.1f} s -> {out}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """The embedded model through our paged cache on this machine, then the simulated studies."""
    from paged.sim.studies import interference_study, memory_story

    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    parts = ["# paged-KV workbench: demo report", ""]
    if args.engine_requests > 0:
        parts += _engine_section(args)
    mem = memory_story(args.num_requests, jobs=args.jobs)
    intf = interference_study(max(200, args.num_requests // 3), jobs=args.jobs)
    mem.to_csv(os.path.join(args.out, "memory_story.csv"), index=False)
    intf.to_csv(os.path.join(args.out, "interference.csv"), index=False)
    sim_md = render_demo_report(mem, intf, time.perf_counter() - t0)
    with open(os.path.join(args.out, "simulation.md"), "w", encoding="utf-8") as fh:
        fh.write(sim_md)
    parts += ["#" + line if line.startswith("#") else line for line in sim_md.splitlines()]
    md = "\n".join(parts) + "\n"
    path = os.path.join(args.out, "demo.md")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(md)
    print(md)
    print(f"wrote {path} and the CSV files beside it")
    return 0


def _engine_section(args: argparse.Namespace) -> list[str]:
    """Run SmolLM2-135M (embedded) through the engine; CSVs plus markdown lines."""
    import pandas as pd

    from paged.demo import engine_run, kv_format_comparison
    from paged.models import load_model

    loaded = load_model(args.model)
    summary, steps, texts = engine_run(loaded, num_requests=args.engine_requests, max_tokens=args.max_tokens,
                                       num_blocks=args.engine_blocks)
    steps.to_csv(os.path.join(args.out, "engine_steps.csv"), index=False)
    texts.to_csv(os.path.join(args.out, "engine_answers.csv"), index=False)
    formats = kv_format_comparison(loaded, max_tokens=args.max_tokens // 2)
    formats.to_csv(os.path.join(args.out, "kv_formats.csv"), index=False)
    cols = ["step", "num_seqs", "num_prefill_tokens", "num_decode_tokens", "num_preempted", "kv_cache_usage_perc",
            "token_usage", "num_running", "num_waiting", "step_time_s"]
    every = max(1, len(steps) // 12)
    return [
        f"## A real model through the paged cache on this machine ({loaded.config.name or args.model})",
        "",
        f"{summary['requests']} chat requests sharing one system prompt, greedy, at most {args.max_tokens} new tokens, "
        f"in a pool of {summary['kv_blocks']} blocks of {summary['block_size']} tokens (too small for all at once). "
        "SmolLM2-135M-Instruct is stored with 4-bit weights (Q4_1); K/V come from that model.", "",
        _md_table(pd.DataFrame([summary])), "",
        "Every step, sampled (full log in `engine_steps.csv`): block usage vs token usage is internal "
        "fragmentation; rows with both prefill and decode tokens are chunked prefill sharing a step with decodes.",
        "", _md_table(steps[cols].iloc[::every]), "",
        "First answers (all in `engine_answers.csv`):", "",
        *[f"- **{q}** " + " ".join(a.split())[:240] for q, a in texts.head(3).itertuples(index=False)], "",
        "## KV formats on the same prompts", "",
        "Greedy tokens equal to the model-dtype cache before the first difference (mean and min over prompts), "
        "and bytes per token per layer for K and V with their scales.", "",
        _md_table(formats), "",
    ]


def _md_table(df, floatfmt: str = ".3f") -> str:
    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in df.itertuples(index=False):  # keeps each column's type (iterrows upcasts ints)
        lines.append("| " + " | ".join(format(v, floatfmt) if isinstance(v, float) else str(v) for v in row) + " |")
    return "\n".join(lines)


def render_demo_report(mem, intf, seconds: float) -> str:
    """Markdown report of the memory story and interference tables."""
    cm, ci = mem.attrs.get("config", {}), intf.attrs.get("config", {})
    return "\n".join([
        "# Simulated: paged vs contiguous KV memory, and prefill/decode interference", "",
        "Same `Scheduler` and KV-cache manager as the real engine; step times from the roofline cost model "
        "(`paged.sim.cost_model`).", "",
        f"## Memory story ({cm.get('model')}, {cm.get('gpu')}, ShareGPT-like, {cm.get('num_requests')} requests "
        "at t=0, block size 16)", "",
        "`token_usage`: slots holding tokens / slots reserved by requests (time-weighted); `paper_token_usage`: "
        "vLLM paper (SOSP'23) Fig. 2, which also counts external fragmentation; `tokens_per_pool`: slots holding "
        "tokens / whole KV pool; `paged_speedup`: paged throughput / this allocator's, at saturation.", "",
        _md_table(mem), "",
        f"## Prefill/decode interference ({ci.get('model')}, {ci.get('gpu')}, {ci.get('workload')}-like, "
        f"{ci.get('rate')} req/s Poisson, {ci.get('num_requests')} requests)", "",
        "Sarathi-Serve (OSDI'24): full prefills in a decode batch stall decodes; chunking the prefill under a "
        "token budget bounds time-between-tokens at some cost in TTFT.", "",
        _md_table(intf), "",
        f"_Generated by `python -m paged demo` in {seconds:.1f} s of wall time._", "",
    ])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m paged", description="paged-KV workbench")
    sub = p.add_subparsers(dest="command", required=True)
    sim = sub.add_parser("simulate", help="simulate one deployment with the engine's scheduler")
    _add_sim_args(sim)
    sim.add_argument("--json", action="store_true", help="print one JSON object")
    sim.add_argument("--no-progress", action="store_true")
    sim.add_argument("--requests-out", default=None, help="write per-request metrics CSV")
    sim.add_argument("--steps-out", default=None, help="write per-step metrics CSV")
    sim.set_defaults(func=cmd_simulate)
    sw = sub.add_parser("sweep", help="run a grid of simulations in parallel into CSV/Parquet")
    _add_sim_args(sw)
    sw.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                    help="a swept setting (repeatable), e.g. --grid block_size=8,16,32 --grid rate=1,2,4")
    sw.add_argument("--out", default="sweep.csv", help=".csv or .parquet")
    sw.add_argument("--jobs", "-j", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    sw.add_argument("--no-progress", action="store_true")
    sw.set_defaults(func=cmd_sweep)
    demo = sub.add_parser("demo", help="write the headline report (markdown + CSV)")
    demo.add_argument("--out", default="reports")
    demo.add_argument("--num-requests", "-n", type=int, default=2000)
    demo.add_argument("--jobs", "-j", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    demo.add_argument("--model", default="smollm2", help="real-engine part: embedded default, GGUF or HF dir")
    demo.add_argument("--engine-requests", type=int, default=12, help="0 skips the real-engine part")
    demo.add_argument("--engine-blocks", type=int, default=24)
    demo.add_argument("--max-tokens", type=int, default=48)
    demo.set_defaults(func=cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except PagedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
