"""The error compressed swap adds, measured on the real engine with :mod:`paged.quant.metrics`.

Workload: ``num_requests`` chunks of held-out text, each generating ``greedy_tokens`` greedy tokens
(``ignore_eos``), on a pool too small for all (default 2.5 requests' worth), ``preemption_mode="swap"``
and a budget of ``block_size`` tokens per step: the newest (mid-prefill) request is swapped out and
back, so its later positions attend over K/V that went through the host codec. One engine per
compression (None, "fp8", "int4") steps in lockstep: with ``ignore_eos`` the schedule depends only on
lengths (checked each step), so prompt logits compare position by position with the uncompressed run.
Teacher-forced: llama.cpp's KLD, ΔNLL, same-top-1, Δp (:func:`summarize`) after each request's first
swap-out (``scope="after_swap"``) and over all positions (``"all"``); greedy: first divergence.

Invariant checked (``check_lossless``): the uncompressed run under pressure generates exactly what
a run that never swaps does (the transport is lossless), so every difference is the codec's.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import pandas as pd
import torch

from paged.errors import PagedError

from paged.quant.metrics import TokenStats, summarize, token_stats
from paged.quant.runs import load
from paged.quant.text import load_texts, make_chunks

__all__ = ["swap_error_study"]


def _capture(llm) -> dict:
    """Wrap the runner's forward so that each step's prompt logits land in the returned dict."""
    got: dict = {}
    runner = llm.engine.runner
    forward = runner.forward

    def fwd(chunks, prompt_limits=None):
        r = forward(chunks, prompt_limits=prompt_limits)
        if r.prompt_logits:
            got.update(r.prompt_logits)
        return r
    runner.forward = fwd
    return got


@torch.inference_mode()
def _lockstep(loaded, prompts, sp, comps, cfg, max_steps: int):
    from paged.engine.llm import LLM
    engines = {c: LLM(model=loaded, swap_compression=c, **cfg) for c in comps}
    caps = {c: _capture(e) for c, e in engines.items()}
    for llm in engines.values():
        for i, p in enumerate(prompts):
            llm.engine.add_request(str(i), p, sp)
    stats = {(c, s): TokenStats() for c in comps if c is not None for s in ("after_swap", "all")}
    swapped_at: dict[str, int] = {}
    toks: dict = {c: {} for c in comps}
    preempt = 0
    base = engines[None]
    for _ in range(max_steps):
        if not base.engine.has_unfinished_requests():
            break
        outs = {c: e.engine.step() for c, e in engines.items()}
        sched = {c: [(x.request_id, x.start, x.num_tokens) for x in o.scheduled] for c, o in outs.items()}
        if any(v != sched[None] for v in sched.values()):
            raise PagedError("compressed and uncompressed runs were scheduled differently; the comparison "
                               "needs identical schedules (ignore_eos, fixed lengths)")
        for c, o in outs.items():
            for f in o.finished:
                toks[c][f.request_id] = list(f.outputs[0].token_ids)
        for rid, mode in outs[None].preempted:
            preempt += 1
            req = base.engine.scheduler.requests.get(rid)
            if mode == "swap" and rid not in swapped_at and req is not None:
                swapped_at[rid] = req.num_computed_tokens
        for rid, (start, rows) in caps[None].items():
            ids = prompts[int(rid)]
            pos = torch.arange(start, start + rows.shape[0])
            targets = torch.tensor(ids[start + 1:start + 1 + rows.shape[0]])
            after = pos >= swapped_at.get(rid, len(ids))
            for c in comps:
                if c is None:
                    continue
                q = caps[c][rid][1]
                stats[(c, "all")].add(token_stats(rows, q, targets))
                if after.any():
                    stats[(c, "after_swap")].add(token_stats(rows[after], q[after], targets[after]))
        for cap in caps.values():
            cap.clear()
    swaps = {c: e.engine.runner.swap for c, e in engines.items()}
    order = [str(i) for i in range(len(prompts))]
    return stats, swaps, preempt, swapped_at, {c: [t.get(r, []) for r in order] for c, t in toks.items()}


def _first_div(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def swap_error_study(model=None, compressions: Sequence[str] = ("fp8", "int4"), *, num_requests: int = 6,
                     context_length: int = 256, num_blocks: int | None = None, block_size: int = 16,
                     max_num_batched_tokens: int | None = None, greedy_tokens: int = 64,
                     texts: Mapping[str, str | Sequence[int]] | None = None, check_lossless: bool = True,
                     max_steps: int = 100_000) -> pd.DataFrame:
    """One row per (compression, scope): bytes per block (device, host, fp16), bytes moved, swap
    counts, llama.cpp's error columns, and the greedy first divergence (mean, % identical over
    the swapped requests and over all). See the module docstring for the workload."""
    from paged.engine.sampling import SamplingParams
    loaded = load(model)
    chunks = make_chunks(texts if texts is not None else load_texts(["kjv", "python"]), loaded.tokenizer,
                         context_length, max_chunks=-(-num_requests // 2) if texts is None else None)
    prompts = [list(c.ids) for c in chunks[:num_requests]]
    per_req = -(-(context_length + greedy_tokens) // block_size)
    cfg = dict(num_blocks=num_blocks or max(per_req + 1, int(2.5 * per_req)), block_size=block_size,
               preemption_mode="swap", max_num_batched_tokens=max_num_batched_tokens or block_size,
               enable_prefix_caching=False, swap_mode="overlap")
    sp = SamplingParams(temperature=0.0, max_tokens=greedy_tokens, prompt_logprobs=0, ignore_eos=True)
    comps = [None, *compressions]
    stats, swaps, preempts, swapped_at, toks = _lockstep(loaded, prompts, sp, comps, cfg, max_steps)
    if check_lossless:
        from paged.engine.llm import LLM
        roomy = LLM(model=loaded, **dict(cfg, num_blocks=2 * per_req * len(prompts), preemption_mode="recompute"))
        exact = [o.outputs[0].token_ids for o in roomy.generate(prompts, SamplingParams(
            temperature=0.0, max_tokens=greedy_tokens, ignore_eos=True))]
        if [list(t) for t in exact] != toks[None]:
            raise PagedError("the uncompressed swap run differs from a run without pressure: the transport "
                               "is not lossless")
    mcfg = loaded.config
    fp16_block = mcfg.num_layers * 2 * block_size * mcfg.num_kv_heads * mcfg.head_dim * 2
    was_swapped = np.array([str(i) in swapped_at for i in range(len(prompts))])
    rows = []
    for c in comps:
        sw = swaps[c]
        div = np.array([_first_div(a, b) for a, b in zip(toks[None], toks[c])])
        sdiv = div[was_swapped]
        base = {"compression": c or "none", "device_block_bytes": sw.device_block_bytes(),
                "host_block_bytes": sw.host_block_bytes(), "fp16_block_bytes": fp16_block,
                "bytes_saved_per_block": sw.device_block_bytes() - sw.host_block_bytes(),
                "ratio_vs_fp16": fp16_block / sw.host_block_bytes(),
                "swapped_out_bytes": sw.bytes_out, "swapped_in_bytes": sw.bytes_in,
                "num_preemptions": preempts, "num_requests_swapped": int(was_swapped.sum()),
                "num_requests": len(prompts), "num_blocks": cfg["num_blocks"], "context_length": context_length,
                "greedy_tokens": greedy_tokens,
                "greedy_first_div_mean": float(div.mean()) if len(div) else float("nan"),
                "greedy_identical_pct": float(100 * (div >= greedy_tokens).mean()) if len(div) else float("nan"),
                "swapped_first_div_mean": float(sdiv.mean()) if len(sdiv) else float("nan"),
                "swapped_identical_pct": float(100 * (sdiv >= greedy_tokens).mean()) if len(sdiv) else float("nan")}
        for scope in ("after_swap", "all"):
            s = summarize(stats[(c, scope)]) if c is not None else {"n_tokens": 0, "kld_mean": 0.0,
                                                                     "delta_nll": 0.0, "same_top1_pct": 100.0}
            rows.append({**base, "scope": scope, **s})
    return pd.DataFrame(rows)
