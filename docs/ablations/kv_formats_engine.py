"""Ablation 2: KV formats on the real engine (embedded SmolLM2-135M), public API only.

    python docs/ablations/kv_formats_engine.py [--max-tokens 24] [--formats auto,int8,int4_kivi,kvq3]

For each format: the pool's memory facts at one byte budget (``paged.memory_facts``: bytes per
token, pool tokens, what the staging rows cost), the decode-step time (``paged.step_times``, from
the engine's own step records) and whether greedy output equals the first format's. Ratios are
against the first format, measured side by side in this run.
"""
from __future__ import annotations

import argparse

import pandas as pd

import paged
from paged import telemetry

PROMPTS = ["The capital of France is", "A block table maps", "def fibonacci(n):"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--formats", default="auto,int8,int4_kivi,kvq3")
    ap.add_argument("--budget-mib", type=int, default=256, help="KV-cache bytes, in MiB, for every format")
    a = ap.parse_args(argv)
    greedy = paged.SamplingParams(max_tokens=a.max_tokens, temperature=0.0)
    rows, first = [], None
    for fmt in a.formats.split(","):
        front = fmt.startswith("kvq")  # the served front: measured at block 32, sink/window need prefix caching off
        llm = paged.LLM(kv_cache_dtype=fmt, kv_cache_memory_bytes=a.budget_mib << 20, max_num_seqs=8,
                        block_size=32 if front else 16, enable_prefix_caching=not front)
        records = []
        outs = llm.generate(PROMPTS, greedy, on_step=records.append)  # the engine's step records
        texts = [o.outputs[0].token_ids for o in outs]
        first = texts if first is None else first
        facts = paged.memory_facts(llm)
        steps = telemetry.steps_frame(records)
        decode = paged.step_times(steps).set_index("kind").loc["decode"]
        rows.append({"format": fmt, "bytes_per_token": facts.bytes_per_token, "pool_tokens": facts.pool_tokens,
                     "staging_mib": facts.staging_bytes / 2**20, "decode_steps": int(decode["steps"]),
                     "decode_ms": 1e3 * decode["mean_s"], "greedy_equal": texts == first})
    df = pd.DataFrame(rows)
    df["tokens_vs_first"] = df["pool_tokens"] / df["pool_tokens"].iloc[0]
    df["decode_vs_first"] = df["decode_ms"] / df["decode_ms"].iloc[0]
    print(df.to_string(index=False, float_format=lambda x: f"{x:.4g}"))


if __name__ == "__main__":
    main()
