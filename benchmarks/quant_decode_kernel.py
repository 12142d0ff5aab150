"""The fused CPU decode kernel alone: one layer's decode attention over each served KV format,
compiled (``kernels/native/quant_decode.c``) beside the torch reference and the fp32 kernel.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/quant_decode_kernel.py [--batch 8] [--ctx 512] [--reps 20]

SmolLM2's geometry (3 KV heads, 9 query heads, head_dim 64), block 32, random K/V written through
the torch write path (KIVI +alloc keys get a non-uniform width table with the format's mean),
formats timed in turn (thread CPU time, ms per layer call); ratios to the fp32 kernel.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import kernels  # noqa: E402
from kernels import native  # noqa: E402
from kernels.native import quant as nq  # noqa: E402
from benchmarks.harness import spread_widths  # noqa: E402
from kernels.split import window_out_blocks  # noqa: E402

FORMATS = ["int8", "int4", "fp8_e4m3", "int4_kivi", "kvq4", "kvq3", "kvq2"]


def timed(f, reps: int) -> float:
    f()
    t = time.thread_time()
    for _ in range(reps):
        f()
    return (time.thread_time() - t) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    torch.manual_seed(0)
    s, length, bs, h, d = a.batch, a.ctx, 32, 3, 64
    nb = s * (length // bs + 2)
    tabs = torch.arange(nb).view(s, -1)[:, :length // bs + 1].int()
    lens = torch.full((s,), length, dtype=torch.int32)
    q = torch.randn(s, 9, d)
    kv = [(torch.randn(length, h, d), torch.randn(length, h, d)) for _ in range(s)]

    def layer(name):
        fmt = kernels.get_format(name)
        extra = {}
        if fmt.split:
            extra["tables"] = kernels.default_tables(fmt, h, d, k_width=spread_widths(fmt.k_side.bits, h, d))
        lay = kernels.allocate_kv_cache(nb, bs, h, d, name, dtype=torch.float32, **extra)
        for i, (k, v) in enumerate(kv):
            slots = tabs[i].long()[torch.arange(length) // bs] * bs + torch.arange(length) % bs
            kernels.write_kv(k, v, lay, slots.int(), positions=torch.arange(length), backend="torch")
            # as the engine does after each step: free the staging of blocks past the window
            kernels.release_window(lay, window_out_blocks(tabs[i:i + 1], lens[i:i + 1], fmt, bs))
        return lay

    f32 = layer("fp32")
    plan = native.DecodePlan(tabs, lens, nb, bs, 0.125)
    base = timed(lambda: plan(q, f32.k, f32.v), a.reps)
    print(f"decode attention, one layer, batch {s} x ctx {length}, thread CPU ms per call "
          f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '?')})")
    print("| format | native ms | x fp32 kernel | torch reference ms | reference / native |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| fp32 | {base:.3f} | 1.00 | | |")
    for name in FORMATS:
        lay = layer(name)
        t = timed(lambda: nq.decode(q, lay, tabs, lens, 0.125), a.reps)
        ref = timed(lambda: kernels.paged_decode_attention(q, lay, None, tabs, lens, scale=0.125, backend="torch"),
                    max(1, a.reps // 4))
        print(f"| {name} | {t:.3f} | {t / base:.2f} | {ref:.3f} | {ref / t:.1f} |")


if __name__ == "__main__":
    main()
