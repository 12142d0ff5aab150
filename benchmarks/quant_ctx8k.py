"""The KV-quantization study at SmolLM2's full context (8,192 tokens): one kjv chunk, row by row.

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python benchmarks/quant_ctx8k.py [FORMAT ...]

Same protocol as ``paged.quant.study`` (fp32 base and every format in this process, the cache
cleared per chunk, the second half scored: 4,095 tokens, greedy divergence over 32 tokens from the
first half as a prompt), but the fp32 base is run once and each format's row is appended to
``reports/quant_t8192.csv`` as soon as it is measured: one 8k prefill costs ~10 min on one shared
CPU core, so a run cut short still leaves its finished rows. Token statistics are computed 512
rows at a time (full-vocab float64 softmaxes of 4,095 rows would take ~8 GB at once).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pandas as pd
import torch

# run as a script, sys.path[0] is benchmarks/ (whose kernels.py would shadow the kernels package)
sys.path[0] = str(Path(__file__).resolve().parents[1])

import paged.quant as pq  # noqa: E402
from paged.quant.attention import QuantKVAttention  # noqa: E402
from paged.quant.metrics import TokenStats, summarize, token_stats  # noqa: E402
from paged.quant.runs import chunk_logits, greedy_many, load  # noqa: E402
from paged.quant.text import make_chunks, scored_slice  # noqa: E402

CTX = int(os.environ.get("QUANT_CTX", 8192))  # smaller for a smoke run
FORMATS = ["int8", "int4_kivi", "int4", "kivi_g32/int4", "fp16"]
HORIZON = 32
OUT = os.environ.get("QUANT_OUT", f"reports/quant_t{CTX}.csv")


def stats_in_pieces(base: torch.Tensor, q: torch.Tensor, targets: torch.Tensor, step: int = 512) -> TokenStats:
    s = TokenStats()
    for i in range(0, len(targets), step):
        s.add(token_stats(base[i:i + step], q[i:i + step], targets[i:i + step]))
    return s


def main(formats: list[str]) -> None:
    lm = load()
    m, cfg = lm.model, lm.config
    text = {"kjv": pq.load_texts(["kjv"])["kjv"]}
    (chunk,) = make_chunks(text, lm.tokenizer, CTX, max_chunks=1, max_model_len=lm.max_model_len)
    rows_sl = scored_slice(CTX)
    ext = slice(rows_sl.start - 1, rows_sl.stop)
    targets = torch.tensor(chunk.ids[rows_sl.start + 1:rows_sl.stop + 1])
    t0 = time.time()
    base_cache = QuantKVAttention("fp32", cfg.num_layers, cfg.head_dim)
    base = chunk_logits(m, chunk.ids, base_cache, ext)
    base_cache.truncate(CTX // 2)
    (base_gen,) = greedy_many(m, [base_cache], [int(base[0].argmax())], CTX // 2, HORIZON)
    base = base[1:]
    os.makedirs("reports", exist_ok=True)
    done = set(pd.read_csv(OUT)["format"]) if os.path.exists(OUT) else set()
    print(f"base: {time.time() - t0:.0f} s", flush=True)
    for name in ["fp32", *formats]:
        if name in done:
            continue
        t = time.time()
        cache = QuantKVAttention(name, cfg.num_layers, cfg.head_dim)
        if name == "fp32":
            q, gen = base, base_gen
        else:
            logits = chunk_logits(m, chunk.ids, cache, ext)
            first, q = int(logits[0].argmax()), logits[1:]
            cache.truncate(CTX // 2)
            (gen,) = greedy_many(m, [cache], [first], CTX // 2, HORIZON)
        fd = next((i for i, (a, b) in enumerate(zip(base_gen, gen)) if a != b), HORIZON)
        info = pq.describe_formats([name], cfg, CTX).set_index("format").loc[cache.scheme.name].to_dict()
        row = {"context_length": CTX, "source": "kjv", "format": cache.scheme.name, **info, "n_chunks": 1,
               **summarize(stats_in_pieces(base, q, targets)), "divergence_tokens": HORIZON,
               "first_div_median": float(fd), "first_div_mean": float(fd), "first_div": [fd],
               "wall_s": time.time() - t}
        new = pd.DataFrame([row])
        if os.path.exists(OUT):  # one table: rewrite it when the columns changed since it was started
            new = pd.concat([pd.read_csv(OUT), new], ignore_index=True)
        new.to_csv(OUT, index=False)
        print(f"{name}: kld {row['kld_mean']:.3g} p99 {row['kld_p99']:.3g} dnll {row['delta_nll']:+.4f} "
              f"top1 {row['same_top1_pct']:.2f} div {fd} ({row['wall_s']:.0f} s)", flush=True)
        del cache


if __name__ == "__main__":
    main(sys.argv[1:] or FORMATS)
