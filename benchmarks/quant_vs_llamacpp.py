"""Our KV formats beside llama.cpp's cache types on the same GGUF, text, chunks and tokens.

    python benchmarks/quant_vs_llamacpp.py [--chunks 19] [--ctx 512] [--csv out.csv]

Protocol (llama-perplexity's): the GPL-3 + Apache-2.0 text of ``data/text/licenses.txt`` as
token ids from our tokenizer, chunks of ``ctx`` tokens, the cache cleared per chunk, the second
half of each chunk scored; KLD against each tool's own base in the same process (ours: an fp32
cache; llama.cpp: its default f16 cache).

With ``llama_cpp`` importable (``pip install llama-cpp-python``: it builds llama.cpp from source,
~8 minutes, so it is an optional extra and never runs in CI) the llama.cpp rows are measured here,
one ``Llama`` per cache type with ``flash_attn=True`` (needed for a quantized V cache). Without
it, the llama.cpp rows are the numbers quoted in issue 10 (llama-cpp-python 0.3.36, same GGUF,
19 chunks), labelled ``quoted``.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

# `python benchmarks/quant_vs_llamacpp.py` puts benchmarks/ first on sys.path, where
# benchmarks/kernels.py would shadow the `kernels` package
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

import numpy as np
import pandas as pd

# llama.cpp cache type -> (our closest scheme, bits per value of the llama.cpp type)
PAIRS = [("q8_0/q8_0", "int8", 8.5), ("q8_0/f16", "int8/fp16", 12.25), ("f16/q8_0", "fp16/int8", 12.25),
         ("q5_1/q5_1", "int4_kivi", 6.0), ("q4_1/q4_1", "int4", 5.0), ("q4_0/q4_0", "int4_g64+rot", 4.5),
         ("q8_0/q4_0", "int8/int4_g64", 6.5), ("q4_1/q4_1", "kivi_g32/int4", 5.0),
         ("q4_0/q4_0", "kivi_g32/int4_g64", 4.5)]
EXTRA = ["int4+rot"]
QUOTED = {  # issue 10: llama.cpp on SmolLM2-135M Q4_1, ctx 512, 19 chunks, vs its f16 cache
    "q8_0/q8_0": (0.00471, 0.0218, 95.17, -0.0006), "q8_0/f16": (0.00455, 0.0221, 95.68, -0.0013),
    "f16/q8_0": (0.00407, 0.0189, 95.93, -0.0004), "q5_1/q5_1": (0.0213, 0.192, 91.57, 0.0135),
    "q4_1/q4_1": (0.0661, 0.525, 86.23, 0.0572), "q4_0/q4_0": (0.0738, 0.597, 85.67, 0.0602),
    "q8_0/q4_0": (0.0118, 0.0676, 93.52, 0.0050)}


def llamacpp_rows(ids: list[int], ctx: int, chunks: int) -> list[dict]:
    """Measure llama.cpp's cache types (needs llama_cpp); KLD against its f16 cache."""
    import llama_cpp
    from paged.models import embedded_gguf_path
    from paged.quant.metrics import TokenStats, summarize, token_stats
    import torch
    types = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q5_1": llama_cpp.GGML_TYPE_Q5_1,
             "q4_1": llama_cpp.GGML_TYPE_Q4_1, "q4_0": llama_cpp.GGML_TYPE_Q4_0}

    def logits(kv: str) -> list[np.ndarray]:
        k, v = kv.split("/")
        llm = llama_cpp.Llama(embedded_gguf_path(), n_ctx=ctx, n_batch=ctx, logits_all=True, flash_attn=True,
                              type_k=types[k], type_v=types[v], verbose=False)
        out = []
        for c in range(chunks):
            llm.reset()
            llm.eval(ids[c * ctx:(c + 1) * ctx])
            out.append(np.array(llm.scores[ctx // 2:ctx - 1], dtype=np.float32))
        return out
    base = logits("f16/f16")
    rows = []
    for kv, bits in dict((kv, bits) for kv, _, bits in PAIRS).items():
        st = TokenStats()
        for c, (b, q) in enumerate(zip(base, logits(kv))):
            tgt = torch.tensor(ids[c * ctx + ctx // 2 + 1:(c + 1) * ctx])
            st.add(token_stats(torch.from_numpy(b), torch.from_numpy(q), tgt))
        s = summarize(st)
        rows.append({"tool": "llama.cpp (measured)", "format": kv, "bits_per_value": bits, **s})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=19)
    ap.add_argument("--csv", default=None)
    args = ap.parse_args()
    from paged import quant
    from paged.quant.runs import load
    lm = load()
    ids = lm.tokenizer.encode(quant.load_texts(["licenses"])["licenses"], add_special_tokens=False)
    chunks = min(args.chunks, len(ids) // args.ctx)
    ours = quant.study(lm, formats=list(dict.fromkeys([p[1] for p in PAIRS] + EXTRA)), texts={"licenses": ids},
                       context_lengths=(args.ctx,), max_chunks=chunks, divergence_tokens=0)
    ours = ours[ours.source == "all"]
    rows = [{"tool": "ours", **r} for r in ours.to_dict(orient="records")]
    try:
        rows += llamacpp_rows(ids, args.ctx, chunks)
    except ImportError:
        rows += [{"tool": "llama.cpp (quoted, issue 10)", "format": kv, "bits_per_value": bits,
                  "kld_mean": QUOTED[kv][0], "kld_p99": QUOTED[kv][1], "same_top1_pct": QUOTED[kv][2],
                  "delta_nll": QUOTED[kv][3]} for kv, bits in dict((kv, b) for kv, _, b in PAIRS).items()]
    df = pd.DataFrame(rows)
    cols = ["tool", "format", "bits_per_value", "kld_mean", "kld_p99", "same_top1_pct", "delta_nll"]
    print(df[cols].to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    theirs = {r["format"]: r for r in rows if r["tool"] != "ours"}
    print("\nours / llama.cpp KLD at the closest format (goal <= 0.5 at equal or fewer bits):")
    for kv, mine, bits in PAIRS:
        o = ours.set_index("format").loc[mine]
        t = theirs[kv]
        ratio = o.kld_mean / t["kld_mean"] if t["kld_mean"] else math.nan
        print(f"  {mine:>14} ({o.bits_per_value:.3g} bits) vs {kv:<10} ({bits:.3g} bits): {ratio:.2f}")
    if args.csv:
        df.to_csv(args.csv, index=False)


if __name__ == "__main__":
    main()
