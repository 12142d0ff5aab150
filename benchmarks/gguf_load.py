"""GGUF header + tensor map: FastGGUFReader against gguf.GGUFReader on the same file, side by side.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/gguf_load.py [--model smollm2] [--rounds 3]

Times ``paged.models.gguf_loader.open_gguf(path)`` (the fast reader) and ``open_gguf(path,
fast=False)`` (gguf's reader) in alternating rounds, this thread's CPU time, best of ``--rounds``,
and prints the ratio. Both must list the same tensors (checked).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's `kernels`, not benchmarks/kernels.py

from benchmarks.harness import best_of  # noqa: E402
from paged.models.gguf_loader import open_gguf  # noqa: E402
from paged.models.loader import resolve_model_path  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="a GGUF file or a known name (default: the embedded SmolLM2)")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    path = resolve_model_path(a.model)
    times, readers = best_of([lambda: open_gguf(path, fast=True), lambda: open_gguf(path, fast=False)], a.rounds)
    best = dict(zip((True, False), times))
    names = {fast: [t.name for t in r.tensors] for fast, r in zip((True, False), readers)}
    if names[True] != names[False]:
        print("the two readers list different tensors")
        return 1
    print(f"{path}: {len(names[True])} tensors, best of {a.rounds} rounds (thread CPU s)")
    print(f"FastGGUFReader   {best[True]:8.3f} s")
    print(f"gguf.GGUFReader  {best[False]:8.3f} s")
    print(f"fast / gguf      {best[True] / best[False]:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
