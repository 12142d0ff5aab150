"""Paged attention vs contiguous attention, measured side by side. One command, one table.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/kernels.py            # CPU: torch paged path vs SDPA
    python benchmarks/kernels.py --gpu                                   # GPU (auto-detected when CUDA is there)

CPU (the workbench's CPU speed path, ``backend="torch"``): decode and prefill through block
tables vs ``torch.nn.functional.scaled_dot_product_attention`` on contiguous K/V holding the same
tokens (equal work: same batch, heads, context, float32). Ratio = paged / contiguous (> 1 is the
cost of paging: the block-table gather). Times are this thread's CPU time, best of ``--rounds``.

GPU (``backend="triton"``): the split-KV decode kernel over page sizes 1, 16, 128 and contexts
1k-32k, FP16 and FP8 (e4m3) KV, timed with ``triton.testing.do_bench`` (L2 flushed between runs).
Achieved bandwidth follows FlashInfer's definition: bytes read (K, V, their scales, q, block
table) / time / the GPU's peak HBM bandwidth (known GPUs below, or ``--peak-gbps``). The
paged-vs-contiguous ratio divides by the same kernel reading one block per sequence (the whole
context contiguous, block size = context), which isolates the cost of paging; the ``sdpa`` column
times torch's SDPA on contiguous fp16 K/V for reference.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's `kernels`

import torch
import torch.nn.functional as F

import kernels
from benchmarks.harness import best_of

# peak HBM bandwidth, GB/s (vendor figures; see ANCHORS.md)
PEAK_GBPS = {"A100-SXM4-80GB": 2039, "A100 80GB PCIe": 1935, "A100-SXM4-40GB": 1555, "A100-PCIE-40GB": 1555,
             "H100 80GB HBM3": 3352, "H100 SXM": 3352, "H100 PCIe": 2000, "H100 NVL": 3900, "H200": 4800,
             "L4": 300, "L40S": 864, "A10": 600, "RTX 4090": 1008}


def _peak(name: str, override: float | None) -> float | None:
    if override:
        return override
    hits = [v for k, v in PEAK_GBPS.items() if k.lower() in name.lower()]
    return max(hits, key=lambda v: v) if hits else None


def _paged_layer(num_seqs: int, ctx: int, block_size: int, heads: int, head_dim: int, fmt: str,
                 dtype: torch.dtype, device: str, shuffle: bool = True, seed: int = 0):
    """A layer holding ``num_seqs`` random contexts of ``ctx`` tokens, blocks in shuffled order."""
    g = torch.Generator(device=device).manual_seed(seed)  # random data made where it lives (GBs on a GPU)
    per_seq = math.ceil(ctx / block_size)
    layer = kernels.allocate_kv_cache(num_seqs * per_seq, block_size, heads, head_dim, fmt, dtype=dtype,
                                      device=device)
    for t in (layer.k, layer.v):
        if layer.kv_format.is_fp8:  # random finite fp8 codes of moderate size, either sign
            u = t.view(torch.uint8)
            u.random_(0x20, 0x48, generator=g)
            u.add_(torch.randint(0, 2, u.shape, generator=g, device=device, dtype=torch.uint8) * 0x80)
        else:
            t.normal_(generator=g)
    g = torch.Generator(device="cpu").manual_seed(seed)
    order = torch.randperm(num_seqs * per_seq, generator=g) if shuffle else torch.arange(num_seqs * per_seq)
    tables = order.reshape(num_seqs, per_seq).int().to(device)
    lens = torch.full((num_seqs,), ctx, dtype=torch.int32, device=device)
    return layer, tables, lens


def _contiguous(layer, tables, ctx):
    """The same tokens as contiguous float32 ``[num_seqs, heads, ctx, head_dim]`` K and V."""
    from kernels.reference import gather_kv
    bt = tables.long()
    s = bt.shape[0]
    k = gather_kv(layer, "k", bt).reshape(s, -1, layer.num_kv_heads, layer.head_dim)[:, :ctx]
    v = gather_kv(layer, "v", bt).reshape(s, -1, layer.num_kv_heads, layer.head_dim)[:, :ctx]
    return k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()


def _cpu_times(fns, rounds: int) -> list[float]:
    """Best-of-``rounds`` thread CPU time of one call of each fn, in ms.

    The fns alternate within every round (so drifting machine load hits them alike), after three
    warm-up calls each (allocator and thread-pool set-up).
    """
    return [b * 1e3 for b in best_of(fns, rounds, warmup=3)[0]]


def _cpu_row(args, ctx: int, bs: int) -> list[dict]:
    """Decode and prefill rows for one (context, block size): paged torch path vs contiguous SDPA."""
    hq, h, d, s = args.q_heads, args.kv_heads, args.head_dim, args.batch
    layer, tables, lens = _paged_layer(s, ctx, bs, h, d, "fp32", torch.float32, "cpu")
    k, v = _contiguous(layer, tables, ctx)
    q = torch.randn(s, hq, d)
    paged, contig = _cpu_times(
        [lambda: kernels.paged_decode_attention(q, layer, None, tables, lens, backend="torch"),
         lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)], args.rounds)
    rows = [dict(op="decode", ctx=ctx, block=bs, batch=s, paged_ms=paged, contig_ms=contig, ratio=paged / contig)]
    # prefill: a chunk of `chunk` new tokens at the end of each context
    chunk = min(args.chunk, ctx)
    qp = torch.randn(s * chunk, hq, d)
    qsl = torch.arange(0, s * chunk + 1, chunk, dtype=torch.int32)
    mask = torch.arange(ctx)[None] <= torch.arange(ctx - chunk, ctx)[:, None]
    qc = qp.view(s, chunk, hq, d).transpose(1, 2)
    paged, contig = _cpu_times(
        [lambda: kernels.paged_prefill_attention(qp, layer, None, tables, lens, qsl, backend="torch"),
         lambda: F.scaled_dot_product_attention(qc, k, v, attn_mask=mask, enable_gqa=True)], args.rounds)
    rows.append(dict(op=f"prefill[{chunk}]", ctx=ctx, block=bs, batch=s, paged_ms=paged, contig_ms=contig,
                     ratio=paged / contig))
    return rows


def run_cpu(args) -> list[dict]:
    torch.manual_seed(0)
    # A fresh process pays for growing its heap (page faults) in whatever it times first:
    # run the first configuration once untimed.
    _cpu_row(args, args.contexts[0], args.block_sizes[0])
    return [r for ctx in args.contexts for bs in args.block_sizes for r in _cpu_row(args, ctx, bs)]


def run_gpu(args) -> list[dict]:
    import triton.testing

    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    peak = _peak(name, args.peak_gbps)
    hq, h, d, s = args.q_heads, args.kv_heads, args.head_dim, args.batch
    rows = []
    for fmt in args.formats:
        for ctx in args.gpu_contexts:
            base = None
            for bs in [ctx] + list(args.page_sizes):  # block size = ctx: one contiguous block per sequence
                layer, tables, lens = _paged_layer(s, ctx, bs, h, d, fmt, torch.float16, "cuda", shuffle=bs != ctx)
                q = torch.randn(s, hq, d, device=dev, dtype=torch.float16)
                fn = lambda: kernels.paged_decode_attention(q, layer, None, tables, lens, backend="triton")  # noqa
                ms = triton.testing.do_bench(fn, warmup=25, rep=100)
                side = sum(t.numel() * t.element_size() for t in (layer.k_scale, layer.v_scale) if t is not None)
                nbytes = (s * ctx * h * d * 2 * layer.k.element_size() + side + 2 * q.numel() * q.element_size()
                          + tables.numel() * 4)
                gbps = nbytes / ms / 1e6
                row = dict(fmt=fmt, ctx=ctx, page=("contig" if bs == ctx else bs), batch=s, us=ms * 1e3,
                           gbps=gbps, util=(gbps / peak if peak else float("nan")))
                if bs == ctx:
                    base = ms
                    if fmt == "fp16":  # torch SDPA on the same contiguous fp16 tokens, for reference
                        kc = layer.k.view(s, ctx, h, d).transpose(1, 2)
                        vc = layer.v.view(s, ctx, h, d).transpose(1, 2)
                        try:
                            sd = triton.testing.do_bench(
                                lambda: F.scaled_dot_product_attention(q[:, :, None], kc, vc, enable_gqa=True),
                                warmup=25, rep=100)
                            row["sdpa_us"] = sd * 1e3
                        except RuntimeError as e:  # a torch build without a GQA-capable SDPA path
                            row["sdpa_us"] = float("nan")
                            print(f"# sdpa skipped: {e}", file=sys.stderr)
                row["vs_contig"] = ms / base
                rows.append(row)
                del layer
            torch.cuda.empty_cache()
    print(f"# {name}, peak {peak or 'unknown (pass --peak-gbps)'} GB/s; batch {s}, {hq} q heads, {h} kv heads, "
          f"head_dim {d}")
    return rows


def _print(rows: list[dict]) -> None:
    cols = list(dict.fromkeys(k for r in rows for k in r))
    fmt = lambda v: (f"{v:.3g}" if isinstance(v, float) else str(v))  # noqa: E731
    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for x in cells:
        print("  ".join(v.rjust(w) for v, w in zip(x, widths)))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu", action="store_true", help="GPU table (default when CUDA is available)")
    p.add_argument("--cpu", action="store_true", help="CPU table even when a GPU is present")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--block-sizes", type=int, nargs="+", default=[1, 16, 128])
    p.add_argument("--chunk", type=int, default=128, help="prefill chunk per sequence (CPU table)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--gpu-contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16, 128])
    p.add_argument("--formats", nargs="+", default=["fp16", "fp8_e4m3"])
    p.add_argument("--peak-gbps", type=float, default=None)
    p.add_argument("--quick", action="store_true", help="smaller grid (a smoke run)")
    args = p.parse_args(argv)
    gpu = (args.gpu or torch.cuda.is_available()) and not args.cpu
    if args.quick:
        args.contexts, args.gpu_contexts, args.rounds = args.contexts[:2], args.gpu_contexts[:2], 2
    if gpu:
        args.batch = args.batch or 16
        rows = run_gpu(args)
    else:
        args.batch = args.batch or 4
        print(f"# CPU, torch {torch.__version__}, {torch.get_num_threads()} thread(s); batch {args.batch}, "
              f"{args.q_heads} q heads, {args.kv_heads} kv heads, head_dim {args.head_dim}, float32")
        rows = run_cpu(args)
    _print(rows)


if __name__ == "__main__":
    main()
