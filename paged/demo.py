"""The headline demo on the embedded model: SmolLM2-135M through our paged cache on this machine.

Two measurements, each a function that returns DataFrames (the CLI renders them):
- `engine_run`: chat requests sharing one system prompt, in a KV pool too small for all of
  them at once, so the step log shows continuous batching, chunked prefill, prefix-cache
  hits, preemption, and block usage beside token usage (the gap: internal fragmentation);
- `kv_format_comparison`: the same greedy prompts under each KV format: bytes per token,
  tokens that fit in the same memory, and how long greedy output agrees with the baseline.
"""
from __future__ import annotations

import time
from typing import Sequence

import pandas as pd

QUESTIONS = [
    "What is a KV cache in a transformer?",
    "Give three tips for writing clear code.",
    "Why is the sky blue?",
    "Explain paging in operating systems in two sentences.",
    "What does a compiler do?",
    "Name a few uses of hash tables.",
    "How do plants make food?",
    "What is the difference between a list and a tuple in Python?",
    "Why do we batch requests on a GPU?",
    "Describe a binary search.",
    "What causes tides?",
    "Summarize what a scheduler does.",
]
SYSTEM = ("You are a concise assistant for a workshop on memory management in language model "
          "inference. Answer in plain words, in at most three sentences.")


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    """`n` chat prompts (token ids) that share the system prompt."""
    out = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)]
        text = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                              {"role": "user", "content": q}])
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def engine_run(loaded, *, num_requests: int = 12, max_tokens: int = 48, num_blocks: int = 40,
               block_size: int = 16, max_num_batched_tokens: int = 256):
    """Run chat requests through a deliberately small pool; returns (summary, steps, texts)."""
    from paged.engine.llm import LLM
    from paged.engine.sampling import SamplingParams
    from paged import telemetry

    llm = LLM(model=loaded, block_size=block_size, num_blocks=num_blocks,
              max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=8)
    prompts = chat_prompts(loaded.tokenizer, num_requests)
    steps = []
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), on_step=steps.append)
    wall = time.perf_counter() - t0
    frame = telemetry.steps_frame(steps)
    m = telemetry.metrics(llm.kv_manager, llm.engine.scheduler)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    summary = {
        "requests": num_requests, "prompt_tokens": sum(map(len, prompts)), "output_tokens": n_out,
        "steps": len(steps), "wall_s": wall, "output_tok_per_s": n_out / wall,
        "kv_blocks": num_blocks, "block_size": block_size,
        "prefix_cache_hit_rate": m["prefix_cache_hit_rate"],
        "num_preemptions": m["num_preemptions"],
        "kv_cache_usage_mean": float(frame["kv_cache_usage_perc"].mean()),
        "token_usage_mean": float(frame["token_usage"].mean()),
        "mixed_steps": int(((frame["num_prefill_tokens"] > 0) & (frame["num_decode_tokens"] > 0)).sum()),
        "blocks_in_use_at_end": llm.kv_manager.num_used_blocks,
    }
    texts = pd.DataFrame({"question": [QUESTIONS[i % len(QUESTIONS)] for i in range(num_requests)],
                          "answer": [o.outputs[0].text.strip() for o in outs]})
    return summary, frame, texts


def kv_format_comparison(loaded, formats: Sequence[str] = ("auto", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2",
                                                           "int8", "int4", "int4_kivi"),
                         *, num_prompts: int = 3, max_tokens: int = 24, block_size: int = 16) -> pd.DataFrame:
    """Greedy agreement with the model-dtype cache, and capacity, for each KV format."""
    from ._kernels import kernels
    from paged.engine.llm import LLM
    from paged.engine.sampling import SamplingParams

    cfg = loaded.config
    dtype = next(loaded.model.parameters()).dtype
    prompts = chat_prompts(loaded.tokenizer, num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    base_bytes = kernels.bytes_per_token("auto", cfg.num_kv_heads, cfg.head_dim, dtype=dtype, block_size=block_size)
    rows, baseline = [], None
    for fmt in formats:
        llm = LLM(model=loaded, kv_cache_dtype=fmt, block_size=block_size, num_blocks=64)
        toks = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        baseline = toks if baseline is None else baseline
        agree = [next((i for i, (a, b) in enumerate(zip(t, r)) if a != b), len(t)) for t, r in zip(toks, baseline)]
        per_tok = kernels.bytes_per_token(fmt, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, block_size=block_size)
        rows.append({"kv_format": fmt, "bytes_per_token_layer": per_tok,
                     "tokens_per_gib_all_layers": int((1 << 30) // (per_tok * cfg.num_layers)),
                     "capacity_vs_model_dtype": base_bytes / per_tok,
                     "greedy_tokens_equal_to_baseline_mean": sum(agree) / len(agree),
                     "greedy_tokens_equal_to_baseline_min": min(agree),
                     "outputs_identical": all(a == max_tokens for a in agree)})
    return pd.DataFrame(rows)
