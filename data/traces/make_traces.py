"""Recipe for the sample traces in this folder (seeded; rerun to regenerate byte-identical files).

    python data/traces/make_traces.py

Every file is synthetic: lengths come from `paged.sim.workload` presets fitted to published means
(ShareGPT/Alpaca: vLLM paper; Azure conversation/code: Azure LLM inference trace 2023 summary
statistics), arrivals from a seeded Poisson or Gamma process. No real trace is redistributed.
"""
from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

import pandas as pd  # noqa: E402

from paged.sim.workload import save_trace, synthetic_trace  # noqa: E402


def main() -> None:
    # 1. ShareGPT-like, Poisson 2 req/s, our CSV format (arrival_time,prompt_tokens,output_tokens,prefix_id,prefix_tokens)
    save_trace(synthetic_trace("sharegpt", 1000, rate=2.0, trace_seed=1, max_model_len=2048),
               os.path.join(HERE, "sharegpt_like_1k.csv"))
    # 2. Alpaca-like, Poisson 20 req/s, vidur CSV format (arrived_at,num_prefill_tokens,num_decode_tokens)
    a = synthetic_trace("alpaca", 1000, rate=20.0, trace_seed=2)
    a.rename(columns={"arrival_time": "arrived_at", "prompt_tokens": "num_prefill_tokens",
                      "output_tokens": "num_decode_tokens"})[["arrived_at", "num_prefill_tokens", "num_decode_tokens"]] \
        .to_csv(os.path.join(HERE, "alpaca_like_1k_vidur.csv"), index=False, float_format="%.6f")
    # 3. Azure-conversation-like, bursty Gamma arrivals (cv 3) at 5.5 req/s, Azure CSV (TIMESTAMP,ContextTokens,GeneratedTokens)
    c = synthetic_trace("azure-conv", 500, rate=5.5, arrival="gamma", cv=3.0, trace_seed=3)
    ts = pd.Timestamp("2023-11-16 18:00:00") + pd.to_timedelta(c["arrival_time"], unit="s")
    pd.DataFrame({"TIMESTAMP": ts.dt.strftime("%Y-%m-%d %H:%M:%S.%f"), "ContextTokens": c["prompt_tokens"],
                  "GeneratedTokens": c["output_tokens"]}).to_csv(os.path.join(HERE, "azure_conv_like_500.csv"),
                                                                  index=False)
    # 4. Azure-code-like, Poisson 2 req/s, LLMServingSim JSONL (input_toks,output_toks,arrival_time_ns)
    k = synthetic_trace("azure-code", 500, rate=2.0, trace_seed=4)
    with open(os.path.join(HERE, "azure_code_like_500.jsonl"), "w", encoding="utf-8") as fh:
        for row in k.itertuples():
            fh.write(json.dumps({"input_toks": int(row.prompt_tokens), "output_toks": int(row.output_tokens),
                                 "arrival_time_ns": int(round(row.arrival_time * 1e9))}) + "\n")
    # 5. Shared system prompts: 8 prompts of 256 tokens on 80% of ShareGPT-like requests, 4 req/s
    save_trace(synthetic_trace("sharegpt", 1000, rate=4.0, trace_seed=5, max_model_len=2048, num_prefixes=8,
                               prefix_tokens=256, prefix_fraction=0.8),
               os.path.join(HERE, "sharegpt_like_shared_prefix_1k.csv"))


if __name__ == "__main__":
    main()
