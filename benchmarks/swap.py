"""Swap transport benchmark: does an overlapped swap hide behind the forward (max) or add to it (sum)?

One "step" = swap_out of ``--blocks`` blocks + swap_in of as many + a synthetic forward of
``--layers`` layers (a matmul each) that waits for each layer's swap-in (``wait_layer``), the
schedule the engine runs (paged.engine.swap). Printed side by side in one run: the forward
alone, the transfers alone (sync), and a whole step per mode and compression, with the ratio
step / (forward + transfers): ~1.0 = sum (no overlap), -> max/sum = hidden. On CPU the copies are
synchronous by design (same code path, no side streams), so overlap ~ sync there; the overlap
shows on CUDA (`--device cuda`), where the cost model's ``max(compute, transfer)`` is checked.

    python benchmarks/swap.py                      # CPU, small
    python benchmarks/swap.py --device cuda --blocks 256 --layers 32 --head-dim 128 --heads 8
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's kernels, not benchmarks/kernels.py

import torch  # noqa: E402

from benchmarks.harness import best_of, wall_s  # noqa: E402
from paged._kernels import kernels  # noqa: E402
from paged.engine.swap import SwapExecutor  # noqa: E402


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def run(device: str = "cpu", blocks: int = 32, layers: int = 4, heads: int = 2, head_dim: int = 64,
        block_size: int = 16, compute: int = 512, rounds: int = 3) -> list[dict]:
    dev = torch.device(device)
    dtype = torch.float16 if dev.type == "cuda" else torch.float32
    dl = [kernels.allocate_kv_cache(4 * blocks, block_size, heads, head_dim, dtype=dtype, device=dev)
          for _ in range(layers)]
    for layer in dl:
        layer.k.normal_()
        layer.v.normal_()
    w = torch.randn(compute, compute, device=dev, dtype=dtype)
    x = torch.randn(compute, compute, device=dev, dtype=dtype)
    out_pairs = [(i, i) for i in range(blocks)]
    in_pairs = [(blocks + i, 2 * blocks + i) for i in range(blocks)]

    def forward(sw: SwapExecutor | None) -> None:
        y = x
        for li in range(layers):
            if sw is not None:
                sw.wait_layer(li)
            y = torch.tanh(y @ w)

    def timed(fn) -> float:
        """Best wall seconds of one call over ``rounds``, the device synchronized around it."""
        return best_of([fn], rounds, clock=wall_s, sync=lambda: _sync(dev))[0][0]

    rows = []
    t_fwd = timed(lambda: forward(None))
    for comp in (None, "fp8", "int4"):
        hosts = None if comp else [kernels.allocate_kv_cache(2 * blocks, block_size, heads, head_dim, dtype=dtype)
                                   for _ in range(layers)]
        execs = {m: SwapExecutor.build(dl, 2 * blocks, mode=m, compression=comp, host_layers=hosts)
                 for m in ("sync", "overlap")}
        for sw in execs.values():
            sw.swap_out([(blocks + i, blocks + i) for i in range(blocks)])  # host blocks to swap in from
            sw.synchronize()

        def transfers(sw=execs["sync"]):
            sw.swap_out(out_pairs)
            sw.swap_in(in_pairs)
            sw.fence()
        t_x = timed(transfers)
        for mode, sw in execs.items():
            def step(sw=sw):
                sw.swap_out(out_pairs)
                sw.swap_in(in_pairs)
                forward(sw)
            t = timed(step)
            rows.append(dict(device=device, compression=comp or "none", mode=mode, forward_ms=t_fwd * 1e3,
                             transfers_ms=t_x * 1e3, step_ms=t * 1e3, step_vs_sum=t / (t_fwd + t_x),
                             step_vs_max=t / max(t_fwd, t_x), moved_mb=2 * blocks * sw.host_block_bytes() / 1e6))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--blocks", type=int, default=32)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--compute", type=int, default=512, help="matmul size of each synthetic layer")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    rows = run(a.device, a.blocks, a.layers, a.heads, a.head_dim, compute=a.compute, rounds=a.rounds)
    cols = ["compression", "mode", "forward_ms", "transfers_ms", "step_ms", "step_vs_sum", "step_vs_max", "moved_mb"]
    print(" | ".join(f"{c:>12}" for c in cols))
    for r in rows:
        print(" | ".join(f"{r[c]:>12.3f}" if isinstance(r[c], float) else f"{r[c]:>12}" for c in cols))


if __name__ == "__main__":
    main()
