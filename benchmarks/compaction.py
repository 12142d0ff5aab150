"""Does block compaction pay on this engine? One command, side-by-side tables of ratios.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/compaction.py           # CPU (+ the Triton kernel with CUDA)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/compaction.py --quick   # smoke run

The measurements are ``paged.studies.compaction`` (see there for what each column means):
1. read: scattered vs contiguous block tables over the same K/V (ratio > 1: contiguity is faster);
2. copies: compaction on a synthetic workload under the scheduler (same schedule as without),
   copies per pass and what planning and applying a pass cost;
3. the verdict: read time a pass saves vs what it costs;
4. end to end: the real engine (random model of SmolLM2-135M's layer shape, 2 layers) off vs on,
   3 alternating runs each (median off/on ratio of the pairs): forward wall time, whole-run thread
   CPU time (``cpu_ratio``, robust to neighbours on shared cores), cache-op time, copies, identical
   greedy outputs.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from paged.studies.compaction import copy_table, engine_table, read_table, verdict  # noqa: E402


def _print(df) -> None:
    print(df.dropna(axis=1, how="all").to_string(index=False, float_format=lambda v: f"{v:.3g}"))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--block-sizes", type=int, nargs="+", default=[16, 128])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--num-blocks", type=int, default=1200)
    p.add_argument("--threshold", type=float, default=0.25)
    p.add_argument("--interval", type=int, default=16)
    p.add_argument("--no-engine", action="store_true", help="skip the end-to-end engine table")
    p.add_argument("--quick", action="store_true", help="smaller grid (a smoke run)")
    args = p.parse_args(argv)
    if args.quick:
        args.contexts, args.block_sizes, args.rounds, args.requests = [256, 1024], [16], 3, 40
    torch.manual_seed(0)
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} thread(s); SmolLM2-135M shapes (9 q heads, "
          f"3 kv heads, head_dim 64, 30 layers), float32 on CPU; {args.rounds} alternating rounds (ratios: median "
          "of per-round pairs)")
    reads = read_table(args.contexts, args.block_sizes, rounds=args.rounds)
    print("\n## 1. read: scattered vs contiguous block tables (ratio > 1: contiguous is faster)")
    _print(reads)
    copies = copy_table(args.requests, args.num_blocks, threshold=args.threshold, interval=args.interval)
    print(f"\n## 2. copies: {args.requests} requests, {args.num_blocks} blocks of 16, a pass every >= "
          f"{args.interval} steps above fragmentation {args.threshold}")
    _print(copies)
    v = verdict(reads, copies)
    print("\n## 3. verdict")
    print(f"read at ctx {v['ctx']} (block {v['block']}): scattered/contiguous = {v['slots_ratio']:.3f} (engine "
          f"slots path), {v['decode_ratio']:.3f} (decode reference)")
    print(f"saved ~ {v['per_decode_layer_us']:.2f} us per decode-layer at full scatter x {v['breaks_fixed']:.2f} of "
          f"the breaks fixed x {copies['layers'][0]} layers x {copies['decodes_per_step'][0]:.1f} decodes = "
          f"{v['saved_per_step_ms']:.3f} ms per step, x {v['steps_per_pass']:.0f} steps per pass = "
          f"{v['saved_per_pass_ms']:.2f} ms, vs a pass: {v['pass_ms']:.2f} ms")
    print(f"verdict: compaction {'pays' if v['pays'] else 'does not pay'} on this engine's CPU path "
          f"(saved / spent = {v['payback']:.2f})")
    if not args.no_engine:
        e = engine_table(**(dict(requests=6, max_tokens=40, repeats=1) if args.quick else {}))
        print("\n## 4. end to end: the engine with compaction off vs on (ratio = off / on: > 1 means on is faster)")
        _print(e)


if __name__ == "__main__":
    main()
