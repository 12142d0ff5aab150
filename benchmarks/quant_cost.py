"""What the bits cost: decode step time and KV memory of each served KV format beside fp32 and int8,
and llama.cpp's own quantized-cache step ratio on the same CPU, GGUF and prompt lengths.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/quant_cost.py [--batch 8] [--prompt 512,2048] [--steps 8]
        [--rounds 3] [--llama-site /tmp/venv-llamacpp/lib/python3.11/site-packages] [--csv reports/quant_cost.csv]

CPU part: one engine per format and prompt length (block_size 32, prefix caching off, the
engine's CPU path: the compiled fused decode, ``--backend torch`` for the torch references), ``--batch``
prompts of ``--prompt`` seeded random tokens prefilled, then ``--rounds`` rounds of ``--steps``
decode steps each (``LLMEngine.step()``: scheduling, batch building, writes, attention, sampling);
the formats take turns within each round, so a busy neighbour slows them alike. Per format: the
median step time (thread CPU time), its ratio to fp32 and to int8, the cache's bytes
(``paged.memory_facts(...).cache_bytes``: blocks, scales, staging and sink pools as allocated) and the bytes
per token of the format table.

llama.cpp part (with ``--llama-site``: llama-cpp-python built from source, ``CMAKE_ARGS=-DGGML_NATIVE=ON
pip install llama-cpp-python==0.3.36`` in a scratch venv): a worker process without torch loads
the embedded GGUF once per cache type (f16, q8_0, q4_0 for K and V, flash attention on, one
thread), prefills ``--batch`` sequences of the same random prompts through the low-level batch
API and times ``--rounds`` x ``--steps`` batched decode steps (one token per sequence), the types
taking turns per round; the ratio to its f16 step is llama.cpp's cost of its quantized cache.

GPU part (no GPU needed: computed from the format table): the bytes the Triton decode kernel
reads per cached token and layer at a context of 512, 2048 and 8192 tokens: codes, scales and
zeros (per-block ones spread over the block), plus, per sequence, the exact rows of the sink and
of the window (fp16 K and V, or ``@krows``/``@vrows`` codes and scales) that the kernel loads beside the
codes; decode attention is memory-bound, so this ratio to fp16 bounds its speed-up.
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

LLAMA_BITS = {"f16": 16.0, "q8_0": 8.5, "q4_0": 4.5}  # ggml blocks of 32: fp16 scale + 32 codes
FORMATS = ["auto", "int8", "int4_kivi", "kvq4", "kvq34", "kvq3", "kvq32", "kvq2", "kvq25"]


def kernel_bytes_per_token(fmt: str, heads: int, head_dim: int, context: int, block: int = 32) -> float:
    """Bytes the decode kernel reads per cached token and layer (see the module docstring)."""
    from kernels import get_format
    from kernels.format_table import bytes_per_token
    f = get_format(fmt, torch.float16)
    per = float(bytes_per_token(f, heads, head_dim, dtype=torch.float16, block_size=block))
    if f.split and (f.window or f.sink):
        exact_rows = min(context, f.window + f.sink)
        row = lambda bits: heads * (head_dim * 2 if bits == 16 else bits * head_dim // 8 + 2)  # noqa: E731
        per += exact_rows * (row(f.k_rows) + row(f.v_rows)) / context  # K and V rows of the window and sink
    return per


def llama_steps(site: str, batch: int, prompt: int, steps: int, rounds: int) -> tuple[str, dict[str, list[float]]]:
    import json
    import subprocess
    import tempfile
    from paged.models import embedded_gguf_path
    with tempfile.TemporaryDirectory(prefix="llamacpp-cost-") as tmp:
        out = os.path.join(tmp, "times.json")
        worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "quant_cost_llama.py")
        subprocess.run([sys.executable, worker, embedded_gguf_path(), "--batch",
                        str(batch), "--prompt", str(prompt), "--steps", str(steps), "--rounds", str(rounds),
                        "--out", out, "--llama-site", site], check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        with open(out) as f:
            r = json.load(f)
    return r["version"], r["times"]


def our_steps(loaded, formats: list[str], batch: int, prompt: int, steps: int, rounds: int, backend: str | None
              ) -> tuple[dict[str, list[float]], dict[str, int]]:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (prompt,), generator=g).tolist() for _ in range(batch)]
    total = prompt + steps * rounds + 8
    engines = {}
    for fmt in formats:
        blocks = batch * (-(-total // 32)) + 8
        c = EngineConfig(kv_cache_dtype=fmt, block_size=32, num_blocks=blocks, enable_prefix_caching=False,
                         max_num_batched_tokens=batch * prompt, max_num_seqs=batch, record_events=False,
                         attention_backend=backend)
        e = LLMEngine(loaded, c)
        sp = SamplingParams(temperature=0.0, max_tokens=steps * rounds + 2 * batch, ignore_eos=True)
        for i, p in enumerate(prompts):
            e.add_request(f"r{i}", p, sp)
        e.step()  # the prefills
        engines[fmt] = e
    times: dict[str, list[float]] = {f: [] for f in formats}
    for _ in range(rounds):
        for fmt, e in engines.items():
            c0 = time.thread_time()
            for _ in range(steps):
                e.step()
            times[fmt].append((time.thread_time() - c0) / steps * 1e3)
    return times, {f: memory_facts(e).cache_bytes for f, e in engines.items()}


def machine() -> str:
    """The CPU this ran on, in words: model name and core count (from /proc/cpuinfo where there is one)."""
    import platform
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), name)
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores"


def _publish(rows: list[dict], args, load0) -> None:
    import json
    import pandas as pd
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "precomputed")
    df = pd.DataFrame(rows)[["tool", "prompt", "format", "bits_per_value", "step_ms", "lo", "hi", "x_base"]]
    df.to_csv(os.path.join(root, "05_cost.csv"), index=False)
    cmd = " ".join(["OMP_NUM_THREADS=1 python benchmarks/quant_cost.py", *sys.argv[1:]])
    meta = {"made_by": cmd, "date": time.strftime("%Y-%m-%d"), "batch": args.batch,
            "base": "ours: fp32 cache; llama.cpp: its f16 cache", "backend": args.backend or "native", "machine": machine(),
            "load_average": [round(x, 1) for x in (*load0, *os.getloadavg())]}
    with open(os.path.join(root, "05_cost.attrs.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(f"wrote {os.path.normpath(os.path.join(root, '05_cost.csv'))}")


def _default_site() -> str | None:
    import glob
    found = sorted(glob.glob("/tmp/venv-llamacpp/lib/python3*/site-packages"))
    return found[0] if found and os.path.exists("/tmp/venv-llamacpp/bin/python") else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", default="512,2048", help="prompt lengths, comma-separated")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--backend", default=None, help="attention backend of our engines (default: the engine's)")
    ap.add_argument("--llama-site", default=_default_site(), help="site-packages of a llama-cpp-python build "
                    "(default: the one in /tmp/venv-llamacpp when it exists; 'none' skips llama.cpp)")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--publish", action="store_true",
                    help="write notebook 05's data/precomputed/05_cost.csv (step ratios of both tools, bits)")
    args = ap.parse_args()
    formats = [f for f in args.formats.split(",") if f]
    if args.llama_site == "none":
        args.llama_site = None
    load0 = os.getloadavg()
    loaded = load_model("smollm2", dtype=torch.float32)
    cfg = loaded.config
    h, d = cfg.num_kv_heads, cfg.head_dim
    from kernels import bytes_per_token, get_format
    rows = []
    for prompt in [int(x) for x in args.prompt.split(",")]:
        times, cache = our_steps(loaded, formats, args.batch, prompt, args.steps, args.rounds, args.backend)
        med = {f: statistics.median(t) for f, t in times.items()}
        base, i8 = med.get("auto"), med.get("int8")
        for fmt in formats:
            bpt = bytes_per_token(get_format(fmt, torch.float32), h, d, dtype=torch.float32, block_size=32)
            rows.append({"tool": "ours", "prompt": prompt, "format": fmt, "step_ms": med[fmt],
                         "bits_per_value": bpt * 8 / (2 * h * d),
                         "lo": min(times[fmt]), "hi": max(times[fmt]), "x_base": med[fmt] / base if base else None,
                         "x_int8": med[fmt] / i8 if i8 else None, "cache_bytes": cache[fmt], "bytes_per_token": bpt})
        if args.llama_site:
            version, lt = llama_steps(args.llama_site, args.batch, prompt, args.steps, args.rounds)
            lm = {k: statistics.median(v) for k, v in lt.items()}
            for k, v in lt.items():
                rows.append({"tool": f"llama.cpp {version}", "prompt": prompt, "format": f"{k}/{k}",
                             "bits_per_value": LLAMA_BITS[k],
                             "step_ms": lm[k], "lo": min(v), "hi": max(v), "x_base": lm[k] / lm["f16"]})
    backend = args.backend or "the engine's CPU default (native)"
    print(f"decode step, batch {args.batch}, {args.rounds} rounds x {args.steps} steps, thread CPU time on this CPU "
          f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '?')}); ours: {backend}, base fp32 ('auto'); "
          "llama.cpp: base its f16 cache")
    print(f"load average (1/5/15 min) at the start {load0[0]:.1f}/{load0[1]:.1f}/{load0[2]:.1f}, at the end "
          + "/".join(f"{x:.1f}" for x in os.getloadavg()))
    print("| tool | prompt | format | step ms (median) | range | x base | x int8 | cache bytes | bytes/token/layer |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    cell = lambda x, f: "" if x is None else f.format(x)  # noqa: E731
    for r in rows:
        print(f"| {r['tool']} | {r['prompt']} | {r['format']} | {r['step_ms']:.1f} | {r['lo']:.1f}-{r['hi']:.1f} | "
              f"{cell(r.get('x_base'), '{:.2f}')} | {cell(r.get('x_int8'), '{:.2f}')} | "
              f"{cell(r.get('cache_bytes'), '{:,}')} | {cell(r.get('bytes_per_token'), '{}')} |")
    if args.csv:
        import pandas as pd
        pd.DataFrame(rows).to_csv(args.csv, index=False)
        print(f"wrote {args.csv}")
    if args.publish:
        _publish(rows, args, load0)
    print("\nTriton decode kernel, bytes read per cached token and layer (fp16 model; GPU case, from the table)")
    print("| format | ctx 512 | ctx 2048 | ctx 8192 | x fp16 at 2048 |")
    print("| --- | --- | --- | --- | --- |")
    fp16 = kernel_bytes_per_token("fp16", h, d, 2048)
    for fmt in ["fp16"] + [f for f in formats if f not in ("auto",)]:
        row = [kernel_bytes_per_token(fmt, h, d, c) for c in (512, 2048, 8192)]
        print(f"| {fmt} | {row[0]:.1f} | {row[1]:.1f} | {row[2]:.1f} | {row[1] / fp16:.3f} |")


if __name__ == "__main__":
    main()
