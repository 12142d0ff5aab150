"""What the bits cost: decode step time and KV memory of each served KV format beside fp32 and int8.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/quant_cost.py [--batch 8] [--prompt 512] [--steps 8] [--rounds 3]

CPU part: one engine per format (block_size 32, prefix caching off, the torch path), ``--batch``
prompts of ``--prompt`` seeded random tokens prefilled, then ``--rounds`` rounds of ``--steps``
decode steps each (``LLMEngine.step()``: scheduling, batch building, writes, attention, sampling);
the formats take turns within each round, so a busy neighbour slows them alike. Per format: the
median step time (thread CPU time), its ratio to fp32 and to int8, the cache's bytes
(``paged.memory_facts(...).cache_bytes``: blocks, scales, staging and sink pools as allocated) and the bytes
per token of the format table.

GPU part (no GPU needed: computed from the format table): the bytes the Triton decode kernel
reads per cached token and layer at a context of 512, 2048 and 8192 tokens: codes, scales and
zeros (per-block ones spread over the block), plus, per sequence, the exact rows of the sink and
of the window (fp16 K and V) that the kernel loads beside the codes; decode attention is
memory-bound, so this ratio to fp16 bounds its speed-up.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from paged.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from paged.engine.sampling import SamplingParams  # noqa: E402
from paged.memory import memory_facts  # noqa: E402
from paged.models import load_model  # noqa: E402

FORMATS = ["auto", "int8", "int4_kivi", "kvq4", "kvq34", "kvq3", "kvq32", "kvq2"]


def kernel_bytes_per_token(fmt: str, heads: int, head_dim: int, context: int, block: int = 32) -> float:
    """Bytes the decode kernel reads per cached token and layer (see the module docstring)."""
    from kernels import get_format
    from kernels.format_table import bytes_per_token
    f = get_format(fmt, torch.float16)
    per = float(bytes_per_token(f, heads, head_dim, dtype=torch.float16, block_size=block))
    if f.split and (f.window or f.sink):
        exact_rows = min(context, f.window + f.sink)
        per += exact_rows * heads * head_dim * 2 * 2 / context  # fp16 K and V rows of the window and sink
    return per


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--formats", default=",".join(FORMATS))
    args = ap.parse_args()
    formats = [f for f in args.formats.split(",") if f]
    loaded = load_model("smollm2", dtype=torch.float32)
    cfg = loaded.config
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (args.prompt,), generator=g).tolist() for _ in range(args.batch)]
    total = args.prompt + args.steps * args.rounds + 8
    engines = {}
    for fmt in formats:
        blocks = args.batch * (-(-total // 32)) + 8
        c = EngineConfig(kv_cache_dtype=fmt, block_size=32, num_blocks=blocks, enable_prefix_caching=False,
                         max_num_batched_tokens=args.batch * args.prompt, max_num_seqs=args.batch, record_events=False)
        e = LLMEngine(loaded, c)
        sp = SamplingParams(temperature=0.0, max_tokens=args.steps * args.rounds + 2, ignore_eos=True)
        for i, p in enumerate(prompts):
            e.add_request(f"r{i}", p, sp)
        e.step()  # the prefill
        engines[fmt] = e
    times: dict[str, list[float]] = {f: [] for f in formats}
    for _ in range(args.rounds):
        for fmt, e in engines.items():
            c0 = time.thread_time()
            for _ in range(args.steps):
                e.step()
            times[fmt].append((time.thread_time() - c0) / args.steps * 1e3)
    med = {f: statistics.median(t) for f, t in times.items()}
    base, i8 = med.get("auto"), med.get("int8")
    h, d = cfg.num_kv_heads, cfg.head_dim
    from kernels import bytes_per_token, get_format
    print(f"decode step, batch {args.batch} x {args.prompt}-token prompts, {args.rounds} rounds x {args.steps} steps, "
          f"torch path on this CPU (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '?')})")
    print("| format | step ms (median) | range | x fp32 | x int8 | cache bytes | bytes/token/layer |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for fmt in formats:
        t = times[fmt]
        bpt = bytes_per_token(get_format(fmt, torch.float32), h, d, dtype=torch.float32, block_size=32)
        print(f"| {fmt} | {med[fmt]:.1f} | {min(t):.1f}-{max(t):.1f} | {med[fmt] / base:.2f} | "
              f"{med[fmt] / i8:.2f} | {memory_facts(engines[fmt]).cache_bytes:,} | {bpt} |" if base and i8 else
              f"| {fmt} | {med[fmt]:.1f} | | | | {memory_facts(engines[fmt]).cache_bytes:,} | {bpt} |")
    print("\nTriton decode kernel, bytes read per cached token and layer (fp16 model; GPU case, from the table)")
    print("| format | ctx 512 | ctx 2048 | ctx 8192 | x fp16 at 2048 |")
    print("| --- | --- | --- | --- | --- |")
    fp16 = kernel_bytes_per_token("fp16", h, d, 2048)
    for fmt in ["fp16"] + [f for f in formats if f not in ("auto",)]:
        row = [kernel_bytes_per_token(fmt, h, d, c) for c in (512, 2048, 8192)]
        print(f"| {fmt} | {row[0]:.1f} | {row[1]:.1f} | {row[2]:.1f} | {row[1] / fp16:.3f} |")


if __name__ == "__main__":
    main()
