"""Greedy continuations of each served KV format against fp32: where they first differ.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/quant_greedy.py [--prompts 4] [--tokens 32] [--formats A,B]

Prompts: ``--prompts`` windows of 128 tokens from each evaluation text (kjv, python, licences),
the engine (block_size 32, prefix caching off) generating ``--tokens`` greedy tokens per prompt
in fp32 and in each format; the table gives per format the median and mean first divergence
(``--tokens`` = identical throughout) and the share of prompts identical to the end.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from paged.engine.llm import LLM  # noqa: E402
from paged.engine.sampling import SamplingParams  # noqa: E402
from paged.models import load_model  # noqa: E402
from paged.quant import engine_settings  # noqa: E402
from paged.quant.runs import greedy_prompts  # noqa: E402

FORMATS = ["int8", "kivi_g32/int4", "kvq4", "kvq34", "kvq3", "kvq32", "kvq2", "kvq25"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--formats", default=",".join(FORMATS), help="served formats, comma-separated")
    args = ap.parse_args()
    lm = load_model("smollm2")
    prompts = greedy_prompts(lm.tokenizer, args.prompts)
    sp = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)

    def run(**kw):
        kw = {"block_size": 32, "enable_prefix_caching": False, "num_blocks": 256, **kw}
        return [o.outputs[0].token_ids for o in LLM(lm, **kw).generate(prompts, sp)]
    ref = run()
    print(f"{len(prompts)} prompts of 128 tokens (kjv, python, licences), {args.tokens} greedy tokens vs fp32")
    print("| format | median first divergence | mean | identical to the end |")
    print("| --- | --- | --- | --- |")
    for fmt in [f for f in args.formats.split(",") if f.strip()]:
        out = run(**engine_settings(fmt))
        d = [next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), args.tokens) for r, o in zip(ref, out)]
        same = sum(x == args.tokens for x in d) / len(d)
        print(f"| {fmt} | {statistics.median(d):.0f} | {statistics.mean(d):.1f} | {100 * same:.0f}% |", flush=True)


if __name__ == "__main__":
    main()
