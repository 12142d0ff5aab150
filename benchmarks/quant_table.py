"""The measurements behind docs/quant.md: the KV-quantization study on SmolLM2 at ctx 512 and 2048.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/quant_table.py t512   # or t2048, x512, x2048, x45, x45b, x45c

Each job writes reports/quant_<job>.csv and prints the table (tens of minutes on 2 CPU cores).
ctx 512 (t512, x512, x45) scores 2 chunks of kjv and python and 4 of licenses; ctx 2048 one chunk of kjv and python.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

# run as a script, sys.path[0] is benchmarks/ (whose kernels.py would shadow the kernels package)
sys.path[0] = str(Path(__file__).resolve().parents[1])

import paged.quant as pq  # noqa: E402
from paged.quant.runs import load  # noqa: E402

JOBS = {
    "t512": (["fp16", "bf16", "fp8_e4m3", "fp8_e4m3_cal", "fp8_e5m2", "int8", "int8/fp16", "fp16/int8",
              "int8/int4", "int4_kivi", "int4", "int4+rot", "int4_g64", "int4_g64+rot"], 512),
    "t2048": (["fp16", "bf16", "fp8_e4m3", "fp8_e4m3_cal", "int8", "int8/int4", "int4_kivi", "int4", "int4+rot",
               "int4_g64+rot"], 2048),
    "x512": (["kivi_g32/int4", "kivi_g32/int4_g64", "kivi/int4_g64"], 512),
    "x2048": (["kivi_g32/int4", "kivi_g32/int4_g64", "kivi/int4_g64"], 2048),
    # 4.5-bit candidates: KIVI keys over 64 tokens (4 + 32/64) with 4.5-bit values, V-only or Q/K/V rotation
    "x45": (["kivi_g64/int4_g64", "kivi_g64/int4_g64+vrot", "kivi_g64/int4sym", "kivi_g64/int4sym+vrot",
             "int4sym", "kivi_g64/int4_g64+rot"], 512),
    # V-only rotation at 4.75 bits; K alone at 4.5 bits (V fp16) splits the 4.5-bit error between K and V
    "x45b": (["kivi_g32/int4_g64+vrot", "kivi_g64/fp16", "fp16/int4_g64+vrot"], 512),
    # KIVI over 32 tokens with 8-bit scale / 7-bit zero codes (4.49 bits with int4_g64 values)
    "x45c": (["kiviq_g32/int4_g64", "kiviq_g32/int4_g64+vrot"], 512),
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
