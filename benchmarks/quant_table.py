"""The measurements behind docs/quant.md: the KV-quantization study on SmolLM2 at ctx 512 and 2048.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/quant_table.py t512   # or t2048, x512, x2048

Each job writes reports/quant_<job>.csv and prints the table (tens of minutes on 2 CPU cores).
ctx 512 scores 2 chunks of kjv and python and 4 of licenses; ctx 2048 one chunk of kjv and python.
"""
from __future__ import annotations

import os
import sys
import time

import paged.quant as pq
from paged.quant.runs import load

JOBS = {
    "t512": (["fp16", "bf16", "fp8_e4m3", "fp8_e4m3_cal", "fp8_e5m2", "int8", "int8/fp16", "fp16/int8",
              "int8/int4", "int4_kivi", "int4", "int4+rot", "int4_g64", "int4_g64+rot"], 512),
    "t2048": (["fp16", "bf16", "fp8_e4m3", "fp8_e4m3_cal", "int8", "int8/int4", "int4_kivi", "int4", "int4+rot",
               "int4_g64+rot"], 2048),
    "x512": (["kivi_g32/int4", "kivi_g32/int4_g64", "kivi/int4_g64"], 512),
    "x2048": (["kivi_g32/int4", "kivi_g32/int4_g64", "kivi/int4_g64"], 2048),
}


def main(job: str) -> None:
    formats, ctx = JOBS[job]
    lm = load()
    texts = pq.load_texts()

    def ids(src: str, n: int) -> list[int]:
        return lm.tokenizer.encode(texts[src], add_special_tokens=False)[:n]

    if ctx == 512:
        tx = {"kjv": ids("kjv", 2 * 512), "python": ids("python", 2 * 512), "licenses": ids("licenses", 4 * 512)}
    else:
        tx = {"kjv": ids("kjv", ctx), "python": ids("python", ctx)}
    t = time.time()
    df = pq.study(lm, formats=formats, texts=tx, context_lengths=(ctx,), max_chunks=None)
    df["wall_s"] = time.time() - t
    os.makedirs("reports", exist_ok=True)
    df.to_csv(f"reports/quant_{job}.csv", index=False)
    print(df.to_string())


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "t512")
