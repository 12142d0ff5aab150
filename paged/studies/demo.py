"""The headline demo on the embedded model: SmolLM2-135M through our paged cache on this machine,
and its report.

Two measurements, each a function that returns DataFrames:
- `engine_run`: chat requests sharing one system prompt, in a KV pool too small for all of
  them at once, so the step log shows continuous batching, chunked prefill, prefix-cache
  hits, preemption, and block usage beside token usage (the gap: internal fragmentation);
- `kv_format_comparison`: the same greedy prompts under each KV format: bytes per token,
  tokens that fit in the same memory, and how long greedy output agrees with the baseline.

The report (``demo_report``): markdown + CSV files from these measurements and the simulated
paper studies (``paged.studies.papers``). ``python -m paged demo`` prints what ``demo_report``
returns; nothing here prints.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from paged.memory import step_times

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
    chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
             for i in range(n)]
    return [tokenizer.encode(tokenizer.apply_chat_template(c), add_special_tokens=False) for c in chats]


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
        "mixed_steps": int(step_times(frame).set_index("kind").loc["mixed", "steps"]),
        "blocks_in_use_at_end": llm.kv_manager.num_used_blocks,
    }
    texts = pd.DataFrame({"question": [QUESTIONS[i % len(QUESTIONS)] for i in range(num_requests)],
                          "answer": [o.outputs[0].text.strip() for o in outs]})
    return summary, frame, texts


def kv_format_comparison(loaded, formats: Sequence[str] = ("auto", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2",
                                                           "int8", "int4", "int4_kivi"),
                         *, num_prompts: int = 3, max_tokens: int = 24, block_size: int = 16) -> pd.DataFrame:
    """Greedy agreement with the model-dtype cache, and capacity, for each KV format."""
    from paged._kernels import kernels
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


# ---- the report ------------------------------------------------------------------------------
def md_table(df: pd.DataFrame, floatfmt: str = ".3f") -> str:
    """A DataFrame as a markdown table (floats as ``floatfmt``; each column keeps its type)."""
    cols = list(df.columns)
    rows = ["| " + " | ".join(format(v, floatfmt) if isinstance(v, float) else str(v) for v in row) + " |"
            for row in df.itertuples(index=False)]  # keeps each column's type (iterrows upcasts ints)
    return "\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols), *rows])


def simulation_report(mem: pd.DataFrame, intf: pd.DataFrame, seconds: float) -> str:
    """Markdown report of the memory story and interference tables."""
    cm, ci = mem.attrs.get("config", {}), intf.attrs.get("config", {})
    return "\n".join([
        "# Simulated: paged vs contiguous KV memory, and prefill/decode interference", "",
        "Same `Scheduler` and KV-cache manager as the real engine; step times from the roofline cost model "
        "(`paged.sim.cost_model`).", "",
        f"## Memory story ({cm.get('model')}, {cm.get('gpu')}, ShareGPT-like, {cm.get('num_requests')} requests "
        "at t=0, block size 16)", "",
        "`token_usage`: slots holding tokens / slots reserved by requests (time-weighted); `paper_token_usage`: "
        "vLLM paper (SOSP'23) Fig. 2, which also counts external fragmentation; `tokens_per_pool`: slots holding "
        "tokens / whole KV pool; `paged_speedup`: paged throughput / this allocator's, at saturation.", "",
        md_table(mem), "",
        f"## Prefill/decode interference ({ci.get('model')}, {ci.get('gpu')}, {ci.get('workload')}-like, "
        f"{ci.get('rate')} req/s Poisson, {ci.get('num_requests')} requests)", "",
        "Sarathi-Serve (OSDI'24): full prefills in a decode batch stall decodes; chunking the prefill under a "
        "token budget bounds time-between-tokens at some cost in TTFT.", "",
        md_table(intf), "",
        f"_Generated by `python -m paged demo` in {seconds:.1f} s of wall time._", "",
    ])


def engine_section(out: str, model: str, *, engine_requests: int, engine_blocks: int, max_tokens: int) -> list[str]:
    """Run the model (default: embedded SmolLM2-135M) through the engine; write its CSVs into
    ``out``; return the report's markdown lines."""
    from paged.errors import InvalidRequestError, PagedError
    from paged.models import load_model

    loaded = load_model(model)
    try:
        summary, steps, texts = engine_run(loaded, num_requests=engine_requests, max_tokens=max_tokens,
                                           num_blocks=engine_blocks)
    except InvalidRequestError as e:
        raise PagedError(f"the real-engine part does not fit --engine-blocks {engine_blocks} with --max-tokens "
                         f"{max_tokens}: raise --engine-blocks or lower --max-tokens ({e})") from None
    steps.to_csv(os.path.join(out, "engine_steps.csv"), index=False)
    texts.to_csv(os.path.join(out, "engine_answers.csv"), index=False)
    formats = kv_format_comparison(loaded, max_tokens=max_tokens // 2)
    formats.to_csv(os.path.join(out, "kv_formats.csv"), index=False)
    cols = ["step", "num_seqs", "num_prefill_tokens", "num_decode_tokens", "num_preempted", "kv_cache_usage_perc",
            "token_usage", "num_running", "num_waiting", "step_time_s"]
    return [
        f"## A real model through the paged cache on this machine ({loaded.config.name or model})", "",
        f"{summary['requests']} chat requests sharing one system prompt, greedy, at most {max_tokens} new tokens, "
        f"in a pool of {summary['kv_blocks']} blocks of {summary['block_size']} tokens (too small for all at once). "
        "SmolLM2-135M-Instruct is stored with 4-bit weights (Q4_1); K/V come from that model.", "",
        md_table(pd.DataFrame([summary])), "",
        "Every step, sampled (full log in `engine_steps.csv`): block usage vs token usage is internal "
        "fragmentation; rows with both prefill and decode tokens are chunked prefill sharing a step with decodes.",
        "", md_table(steps[cols].iloc[::max(1, len(steps) // 12)]), "",
        "First answers (all in `engine_answers.csv`):", "",
        *[f"- **{q}** " + " ".join(a.split())[:240] for q, a in texts.head(3).itertuples(index=False)], "",
        "## KV formats on the same prompts", "",
        "Greedy tokens equal to the model-dtype cache before the first difference (mean and min over prompts), "
        "and bytes per token per layer for K and V with their scales.", "",
        md_table(formats), "",
    ]


def demo_report(out: str = "reports", *, num_requests: int = 2000, jobs: int = 1, model: str = "smollm2",
                engine_requests: int = 12, engine_blocks: int = 24, max_tokens: int = 48) -> tuple[str, str]:
    """Measure and write the headline report into ``out`` (demo.md, simulation.md, CSVs);
    ``engine_requests=0`` skips the real-engine part. Returns (markdown, path of demo.md)."""
    from paged.studies.papers import interference_study, memory_story

    os.makedirs(out, exist_ok=True)
    t0 = time.perf_counter()
    parts: list[Any] = ["# paged-KV workbench: demo report", ""]
    if engine_requests > 0:
        parts += engine_section(out, model, engine_requests=engine_requests, engine_blocks=engine_blocks,
                                max_tokens=max_tokens)
    mem = memory_story(num_requests, jobs=jobs)
    intf = interference_study(max(200, num_requests // 3), jobs=jobs)
    mem.to_csv(os.path.join(out, "memory_story.csv"), index=False)
    intf.to_csv(os.path.join(out, "interference.csv"), index=False)
    sim_md = simulation_report(mem, intf, time.perf_counter() - t0)
    Path(out, "simulation.md").write_text(sim_md, encoding="utf-8")
    parts += ["#" + line if line.startswith("#") else line for line in sim_md.splitlines()]
    md = "\n".join(parts) + "\n"
    path = os.path.join(out, "demo.md")
    Path(path).write_text(md, encoding="utf-8")
    return md, path
