"""Checks that need a CUDA device, kept out of the collected test suite (which runs on CPU with no
skipped tests). Each check asserts something that can fail; the script exits 1 if any does.

    python benchmarks/gpu_checks.py            # all checks; exits 2 when no CUDA device is present

- ``overlap_swap``: ``paged.engine.swap.SwapExecutor`` in overlap mode on CUDA: side streams,
  pinned host layers, a swap-out whose device blocks the main stream reuses at once and a swap-in
  read back after ``fence`` (bit-exact); then greedy outputs of a tiny random Llama under swap
  preemption are identical with sync and overlapped swap.
"""
from __future__ import annotations

import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's `kernels`, not benchmarks/kernels.py

import torch  # noqa: E402


def check_overlap_swap() -> None:
    from paged._kernels import kernels
    from paged.engine.llm import LLM
    from paged.engine.sampling import SamplingParams
    from paged.engine.swap import SwapExecutor
    from paged.models import load_model
    from paged.models.testing import make_tiny_checkpoint

    nb, bs, h, d = 12, 4, 2, 64
    dev = [kernels.allocate_kv_cache(nb, bs, h, d, dtype=torch.float16, device="cuda") for _ in range(2)]
    for layer in dev:
        layer.k.normal_()
        layer.v.normal_()
    ref = [(layer.k.clone(), layer.v.clone()) for layer in dev]
    host = [kernels.allocate_kv_cache(6, bs, h, d, dtype=torch.float16) for _ in dev]
    sw = SwapExecutor.build(dev, 6, mode="overlap", host_layers=host)
    assert sw.streams.kind == "cuda" and all(x.k.is_pinned() for x in sw.host_layers)
    sw.swap_out([(7, 2), (3, 0)])
    for layer in dev:  # the main stream reuses the blocks at once
        layer.k[[7, 3]] = 0
    sw.swap_in([(0, 10), (2, 11)])
    sw.fence()
    torch.cuda.synchronize()
    for layer, (k, _) in zip(dev, ref):
        assert torch.equal(layer.k[[10, 11]], k[[3, 7]])

    path = make_tiny_checkpoint(tempfile.mkdtemp(prefix="paged-gpu-"), "llama", num_heads=4, num_kv_heads=2)
    model = load_model(path, device="cuda", dtype=torch.float32)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (21, 17, 25, 19, 23, 15)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    pressure = dict(num_blocks=14, block_size=4, preemption_mode="swap", max_num_batched_tokens=24)
    outs = {}
    for mode in ("sync", "overlap"):
        llm = LLM(model=model, swap_mode=mode, **pressure)
        outs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        assert llm.engine.runner.swap.bytes_in > 0, f"{mode}: nothing was swapped in"
    assert outs["sync"] == outs["overlap"], "greedy outputs differ between sync and overlapped swap"


CHECKS = {"overlap_swap": check_overlap_swap}


def main(argv: list[str] | None = None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        print(f"unknown check(s) {unknown}; choose from {list(CHECKS)}")
        return 2
    if not torch.cuda.is_available():
        print("no CUDA device: these checks need one (nothing was checked)")
        return 2
    failed = 0
    for name in names:
        try:
            CHECKS[name]()
            print(f"ok    {name}")
        except Exception:  # noqa: BLE001 - report every check, then fail
            failed += 1
            print(f"FAIL  {name}\n{traceback.format_exc()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
