"""Output tokens per second of our paged engine vs transformers, same model, same workload.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/engine.py                # 64 requests, SmolLM2
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/engine.py --quick        # 16 short requests

Workload (seeded): ``--num-requests`` prompts of uniform length in ``[--min-prompt, --max-prompt]``
(random token ids from the common part of the vocabulary), each with its own output length
uniform in ``[--min-output, --max-output]``; greedy decoding, EOS ignored, so every system
must produce exactly the requested tokens. Measured side by side in one run:

1. ours: ``LLM.generate`` (paged KV cache, continuous batching, chunked prefill, torch
   reference kernels on CPU / Triton on GPU);
2. transformers static batched ``generate``: batches of ``--static-batch`` prompts in arrival
   order, left-padded, each batch decoding to its longest requested output (the padded
   static baseline); only the requested tokens count as output;
3. transformers ``generate_batch``-style continuous batching (its manager with a per-request
   ``max_new_tokens``).

Output tok/s = requested output tokens / wall time. The ratio columns divide our tok/s by each
baseline's. "same outputs" is the share of requests whose greedy tokens equal ours exactly
(padding and batch shape can flip near-ties in float arithmetic; the first divergence is shown).

Measured here (2 shared cores, OMP_NUM_THREADS=1, float32) on the anchor workload
``--num-requests 32 --max-prompt 256 --max-output 128``: README, Speed (the numbers move with
the machine; this script prints them). ``--bf16`` adds ours in bfloat16 and where its greedy
outputs leave the float32 ones. The "cpu" columns are the CPU seconds of all threads
(transformers' continuous batching runs its own thread): trust them over wall time when other
jobs share the cores.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.harness import process_s, timed  # noqa: E402
from paged.engine.llm import LLM  # noqa: E402
from paged.models import embedded_gguf_path, load_model  # noqa: E402
from paged.engine.sampling import SamplingParams  # noqa: E402


def make_workload(n: int, pmin: int, pmax: int, omin: int, omax: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lo, hi = 100, min(vocab, 10000)
    prompts = [torch.randint(lo, hi, (int(torch.randint(pmin, pmax + 1, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(n)]
    outs = [int(torch.randint(omin, omax + 1, (1,), generator=g)) for _ in range(n)]
    return prompts, outs


def load_hf(model: str):
    import transformers
    if model in (None, "smollm2"):
        p = embedded_gguf_path()
        return transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(p), gguf_file=os.path.basename(p), dtype=torch.float32).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


@contextlib.contextmanager
def packed_linears(on: bool):
    """``paged.models.packed.ENABLED = on`` for the block (process-wide), restored after it."""
    from paged.models import packed
    before, packed.ENABLED = packed.ENABLED, on
    try:
        yield
    finally:
        packed.ENABLED = before


def run_ours(loaded, prompts, outs, block_size: int, budget: int):
    llm = LLM(loaded, block_size=block_size, max_num_batched_tokens=budget, record_events=False)
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in outs]
    t = time.perf_counter()
    res = llm.generate(prompts, params)
    return time.perf_counter() - t, [r.outputs[0].token_ids for r in res]


def top2_gaps(loaded, prompts, outs, block_size: int, budget: int) -> list[list[float]]:
    """Per request and output position, our fp32 model's log-prob gap between its top two tokens
    (how close greedy decoding was to a tie there)."""
    llm = LLM(loaded, block_size=block_size, max_num_batched_tokens=budget, record_events=False)
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True, logprobs=2) for o in outs]
    gaps = []
    for r in llm.generate(prompts, params):
        top = [sorted(d.values(), reverse=True) for d in r.outputs[0].logprobs]
        gaps.append([t[0] - t[1] for t in top])
    return gaps


def bf16_report(loaded, prompts, outs, ours, a, rows, cpu, t_ours) -> None:
    """Ours with bfloat16 weights and KV: its speed, its share of greedy outputs equal to our
    float32 ones, and how near a tie the float32 model was where they first differ."""
    b16 = load_model(a.model, dtype=torch.bfloat16)
    name = "ours, bfloat16 (vs ours fp32)"
    cpu[name], (t, got) = timed(lambda: run_ours(b16, prompts, outs, a.block_size, a.max_num_batched_tokens),
                                process_s)
    same, first = agreement(ours, got)
    rows.append((name, t, t / t_ours, same, first))
    print(f"  ours bf16 done in {t:.1f}s", flush=True)
    gaps = top2_gaps(loaded, prompts, outs, a.block_size, a.max_num_batched_tokens)
    at_div = [g[next(k for k, (u, v) in enumerate(zip(x, y)) if u != v)]
              for x, y, g in zip(ours, got, gaps) if x != y]
    every = sorted(v for g in gaps for v in g)
    if at_div:
        below = sum(v <= max(at_div) for v in every) / len(every)
        print(f"  bf16 vs fp32: {len(at_div)}/{len(ours)} requests differ; fp32 top-1 minus top-2 log-prob at each "
              f"first difference: median {statistics.median(at_div):.3f}, max {max(at_div):.3f} (all positions: "
              f"median {statistics.median(every):.3f}; {below:.1%} of positions are that close)", flush=True)
    else:
        print(f"  bf16 vs fp32: all {len(ours)} requests identical", flush=True)


def run_static(hf, prompts, outs, batch: int, pad_id: int):
    got: list[list[int]] = []
    t = time.perf_counter()
    for i in range(0, len(prompts), batch):
        ps, os_ = prompts[i:i + batch], outs[i:i + batch]
        width = max(len(p) for p in ps)
        ids = torch.full((len(ps), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(ps), width), dtype=torch.long)
        for j, p in enumerate(ps):
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        with torch.no_grad():
            res = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(os_),
                              min_new_tokens=max(os_), do_sample=False, eos_token_id=None,
                              pad_token_id=pad_id)
        got += [res[j, width:width + o].tolist() for j, o in enumerate(os_)]
    return time.perf_counter() - t, got


def run_hf_continuous(hf, prompts, outs):
    from transformers import GenerationConfig
    cfg = GenerationConfig(do_sample=False, max_new_tokens=max(outs), eos_token_id=None, pad_token_id=0)
    t = time.perf_counter()
    results: dict[str, list[int]] = {}
    with hf.continuous_batching_context_manager(generation_config=cfg, block=True, timeout=5) as mgr:
        ids = [mgr.add_request(p, request_id=f"r{i}", max_new_tokens=o) for i, (p, o) in enumerate(zip(prompts, outs))]
        while len(results) < len(ids):
            r = mgr.get_result(timeout=5)
            if r is None:
                if not mgr.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped")
                continue
            if r.is_finished():
                results[r.request_id] = list(r.generated_tokens)
    return time.perf_counter() - t, [results[f"r{i}"][:o] for i, o in enumerate(outs)]


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, int]:
    same = sum(x == y for x, y in zip(a, b))
    first = min((next(k for k, (u, v) in enumerate(zip(x, y)) if u != v) for x, y in zip(a, b)
                 if x != y and any(u != v for u, v in zip(x, y))), default=-1)
    return same / len(a), first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--min-output", type=int, default=8)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--static-batch", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="16 requests, prompts 16-128, outputs 8-64")
    ap.add_argument("--skip", default="", help="comma list of baselines to skip: static,continuous")
    ap.add_argument("--ab", type=int, default=0, metavar="N",
                    help="only ours: N alternating pairs with packed linears on/off, CPU seconds")
    ap.add_argument("--unpacked", action="store_true",
                    help="also run ours with plain F.linear (paged.models.packed.ENABLED = False)")
    ap.add_argument("--bf16", action="store_true",
                    help="also run ours in bfloat16: speed, outputs equal to fp32, fp32 top-2 gap where they differ")
    a = ap.parse_args()
    if a.quick:
        a.num_requests, a.max_prompt, a.max_output = 16, 128, 64
    torch.manual_seed(a.seed)
    loaded = load_model(a.model)
    prompts, outs = make_workload(a.num_requests, a.min_prompt, a.max_prompt, a.min_output, a.max_output,
                                  loaded.config.vocab_size, a.seed)
    n_out = sum(outs)
    print(f"model {a.model} ({loaded.weight_format}), {a.num_requests} requests, prompts "
          f"{a.min_prompt}-{a.max_prompt} (total {sum(map(len, prompts))}), outputs {a.min_output}-"
          f"{a.max_output} (total {n_out}), torch threads {torch.get_num_threads()}", flush=True)
    rows = []
    # CPU time of every thread (HF's continuous batching runs its own)
    c_ours, (t_ours, ours) = timed(lambda: run_ours(loaded, prompts, outs, a.block_size, a.max_num_batched_tokens),
                                   process_s)
    cpu = {"ours (paged engine)": c_ours}
    rows.append(("ours (paged engine)", t_ours, 1.0, 1.0, -1))
    print(f"  ours done in {t_ours:.1f}s", flush=True)
    if a.ab:  # ours with packed linears vs plain F.linear, alternating, then stop
        got = {True: [], False: []}
        for r in range(2 * a.ab):
            on = (r % 2 == 0) == (r // 2 % 2 == 0)
            with packed_linears(on):
                got[on].append(timed(lambda: run_ours(loaded, prompts, outs, a.block_size,
                                                      a.max_num_batched_tokens), process_s)[0])
        print("CPU s, packed:", " ".join(f"{x:.1f}" for x in got[True]),
              "| plain F.linear:", " ".join(f"{x:.1f}" for x in got[False]),
              f"| ratio of sums {sum(got[True]) / sum(got[False]):.3f}")
        return
    if a.unpacked:  # the engine before the packed linears, in the same run
        with packed_linears(False):
            cpu["ours, plain F.linear (packed off)"], (t, got) = timed(
                lambda: run_ours(loaded, prompts, outs, a.block_size, a.max_num_batched_tokens), process_s)
        same, first = agreement(ours, got)
        rows.append(("ours, plain F.linear (packed off)", t, t / t_ours, same, first))
        print(f"  ours unpacked done in {t:.1f}s", flush=True)
    if a.bf16:
        bf16_report(loaded, prompts, outs, ours, a, rows, cpu, t_ours)
    skip = set(filter(None, a.skip.split(",")))
    hf = load_hf(a.model) if skip != {"static", "continuous"} else None
    if "static" not in skip:
        cpu[f"transformers generate, static batch {a.static_batch}"], (t, got) = timed(
            lambda: run_static(hf, prompts, outs, a.static_batch, pad_id=0), process_s)
        same, first = agreement(ours, got)
        rows.append((f"transformers generate, static batch {a.static_batch}", t, t / t_ours, same, first))
        print(f"  static done in {t:.1f}s", flush=True)
    if "continuous" not in skip:
        try:
            cpu["transformers continuous batching"], (t, got) = timed(lambda: run_hf_continuous(hf, prompts, outs),
                                                                      process_s)
            same, first = agreement(ours, got)
            rows.append(("transformers continuous batching", t, t / t_ours, same, first))
        except Exception as e:  # noqa: BLE001 - report and go on
            rows.append((f"transformers continuous batching FAILED: {e}"[:70], float("nan"), float("nan"), 0, -1))
        print("  continuous done", flush=True)
    print(f"\n{'system':<44} {'wall s':>8} {'out tok/s':>10} {'ours x':>7} {'cpu s':>8} {'ours x cpu':>10} "
          f"{'same outputs':>13} {'1st diff at':>11}")
    for name, t, ratio, same, first in rows:
        c = cpu.get(name, float("nan"))
        print(f"{name:<44} {t:8.1f} {n_out / t:10.1f} {ratio:7.2f} {c:8.1f} {c / c_ours:10.2f} {same:13.0%} "
              f"{'' if first < 0 else first:>11}")
    print("(cpu = CPU seconds of all threads: robust where other processes share the cores; wall is not)")


if __name__ == "__main__":
    main()
