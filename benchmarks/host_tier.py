"""Host tier for cached-free prefix blocks (issue 13): recompute vs host tier, LRU vs the seeds'
score policy, side by side on one workload each.

    python benchmarks/host_tier.py            # simulator: Llama-2-70B on 4x A100-80GB, 1000 requests;
                                              # engine: tiny random Llama on CPU
    python benchmarks/host_tier.py --model smollm2   # the engine part on SmolLM2-135M
    python benchmarks/host_tier.py --quick    # small sizes (seconds)

Prints per-variant prefix hit rate (GPU / host tier), prefill tokens saved, blocks and bytes
moved, swaps and throughput, with ratios to the first row, and the verdict on the seeds' "cuts
swaps by 40% on a 70B model" (``paged.studies.host_tier.swap_claim``).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

# run as a script, sys.path[0] is benchmarks/ (whose kernels.py would shadow the kernels package)
sys.path[0] = str(Path(__file__).resolve().parents[1])

COLS = ["variant", "prefix_hit_rate", "gpu_hit_rate", "host_hit_rate", "prefill_tokens_saved", "tier_out_blocks",
        "tier_in_blocks", "host_evicted_blocks", "swaps", "gib_moved", "swap_steps_share", "throughput_tok_s"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes")
    ap.add_argument("--model", default=None, help="engine model (default: tiny random Llama)")
    ap.add_argument("--no-engine", action="store_true")
    a = ap.parse_args(argv)
    import pandas as pd

    from paged.studies.host_tier import swap_claim, tier_study
    pd.set_option("display.width", 200)
    pd.set_option("display.max_columns", 30)
    n = 200 if a.quick else 1000
    sim = tier_study(num_requests=n)
    sim["throughput_vs_first"] = sim["throughput_tok_s"] / sim["throughput_tok_s"].iloc[0]
    print(f"simulator: Llama-2-70B, 4x A100-80GB, {n} requests, 64 prefixes x 1024 tokens (Zipf 1), "
          f"{sim['num_gpu_blocks'].iloc[0]} GPU / {sim['num_cpu_blocks'].iloc[1]} CPU blocks")
    print(sim[COLS + ["throughput_vs_first", "ttft_mean_s"]].to_string(index=False, float_format="%.3f"))
    print(swap_claim(sim))
    print(swap_claim(sim, "host tier, score (size_weight=+0.5)"))
    if not a.no_engine:
        from paged.studies.host_tier import engine_tier_study
        eng = engine_tier_study(a.model, num_requests=24 if a.quick else 48, num_blocks=32)
        eng["throughput_vs_first"] = eng["throughput_tok_s"] / eng["throughput_tok_s"].iloc[0]
        print(f"\nengine ({a.model or 'tiny random Llama'}, CPU): 8 prefixes x 6 blocks, 32 GPU blocks")
        print(eng[COLS + ["prefill_tokens_computed", "throughput_vs_first", "outputs_match_first"]]
              .to_string(index=False, float_format="%.3f"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
