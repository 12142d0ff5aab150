"""Fingerprint today's behaviour, bit for bit: simulator summaries, the real engine's outputs, and
the records of one engine run. Record it before a refactor, compare after (exit status 1 and a
readable diff on any difference):

    # the baseline, from a detached checkout of the base commit
    git worktree add --detach /tmp/fpbase 3f03698
    PYTHONPATH=/tmp/fpbase OMP_NUM_THREADS=1 .venv/bin/python tools/fingerprint.py write /tmp/fp_base.pkl
    # this checkout, compared with it
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python tools/fingerprint.py compare /tmp/fp_base.pkl

Three parts (``--parts``, default all):

- ``sim``: every configuration of ``tools/sim_fingerprint.py`` on its stored trace (frames with
  ``check_exact``, summaries with ``==``; see that file for the spelling and renamed keys).
- ``outputs``: greedy (and seeded) outputs of ``paged.LLM`` on the embedded SmolLM2 for the prompts
  below under every setting of ``ENGINE_SETTINGS``: token ids, text, finish reason, cumulative
  log-probability, cached tokens and preemptions of every completion, and the count of each event
  kind per setting, compared with ``==`` (``MUST_SEE``: the paths a setting must still exercise).
- ``records``: one ``paged.runs.EngineRun`` over a fixed chat workload: its step rows, request rows
  and events with the wall-clock columns (``CLOCK_STEP_COLUMNS``, ``CLOCK_REQUEST_COLUMNS``, the
  value of ``ALLOC_LATENCY`` events) dropped; every other column compared exactly.

The whole run is about two minutes on two busy CPU cores (OMP_NUM_THREADS=1). Everything runs on
CPU in float32: the same code on the same machine gives the same bits, so any difference is a change
in behaviour (batch composition, block choice, order of work), not noise.
"""
from __future__ import annotations

import argparse
import math
import os
import pickle
import sys
import time
from collections import Counter
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sim_fingerprint as simfp  # noqa: E402

PARTS = ("sim", "outputs", "records")

# name -> LLM keywords (EngineConfig fields), on top of BASE_ENGINE
BASE_ENGINE: dict[str, Any] = dict(device="cpu", num_blocks=64, block_size=16, warm_up=False)
ENGINE_SETTINGS: dict[str, dict[str, Any]] = {
    "fp32_default": {},
    "no_prefix_caching": dict(enable_prefix_caching=False),
    "recompute_small_pool": dict(num_blocks=6, max_num_seqs=4),           # forces recompute preemption
    "swap_small_pool": dict(num_blocks=6, max_num_seqs=4, preemption_mode="swap", num_cpu_blocks=32),
    "int8": dict(kv_cache_dtype="int8"),
    "kvq3": dict(kv_cache_dtype="kvq3", block_size=32, num_blocks=32, enable_prefix_caching=False),
    "chunked_budget_8": dict(max_num_batched_tokens=8),
    "no_chunking": dict(enable_chunked_prefill=False),
}
MAX_TOKENS = 12
RECORDS_ENGINE: dict[str, Any] = dict(num_blocks=12, max_num_batched_tokens=32)  # the records run: 2 preemptions
# extra sampling set-ups, each on the fp32 default engine: name -> SamplingParams keywords
SAMPLING: dict[str, dict[str, Any]] = {
    "greedy": dict(temperature=0.0),
    "n3_seeded": dict(n=3, temperature=0.8, seed=11),
    "beam3": dict(n=3, use_beam_search=True),
}

# event kinds a setting must produce (checked on write and compare: a fingerprint that no longer
# preempts, swaps, hits the prefix cache or forks proves nothing about those paths)
MUST_SEE: dict[str, tuple[str, ...]] = {
    "fp32_default": ("prefix_hit", "fork", "cow"),
    "recompute_small_pool": ("preempt",),
    "swap_small_pool": ("swap_out", "swap_in"),
}

# wall-clock columns: dropped from the records before comparing (everything else is compared)
CLOCK_STEP_COLUMNS = ("time_s", "step_time_s")
CLOCK_REQUEST_COLUMNS = ("arrival_time_s", "first_scheduled_s", "first_token_s", "finish_s", "ttft_s",
                         "tbt_mean_s", "e2e_s", "queueing_s")
CLOCK_EVENT_KINDS = ("alloc_latency",)  # their value is nanoseconds measured


def prompts(tok) -> list[list[int]]:
    """Four chats sharing a system prompt (prefix hits at block 16) and one unrelated prompt."""
    system = "You are a helpful assistant for a class on operating systems. Answer plainly and briefly."
    qs = ["What is a page table?", "Explain copy-on-write.", "Why do caches help?", "What is swapping?"]
    chats = [tok.encode(f"{system}\nUser: {q}\nAssistant:") for q in qs]
    return chats + [tok.encode("The history of the printing press begins")]


def _load_model():
    from paged.models import load_model
    return load_model("smollm2")


def _completions(outs) -> list[dict[str, Any]]:
    return [dict(request=i, prompt_token_ids=list(o.prompt_token_ids), num_cached_tokens=o.num_cached_tokens,
                 num_preemptions=o.num_preemptions,
                 outputs=[dict(index=c.index, token_ids=list(c.token_ids), text=c.text, finish_reason=c.finish_reason,
                               cumulative_logprob=c.cumulative_logprob) for c in o.outputs])
            for i, o in enumerate(outs)]


def run_outputs(model) -> dict[str, Any]:
    """setting/sampling name -> the completions of every prompt."""
    from paged.engine import LLM, SamplingParams

    ps = prompts(model.tokenizer)
    out = {}
    for name, kw in ENGINE_SETTINGS.items():
        t0 = time.perf_counter()
        llm = LLM(model, **{**BASE_ENGINE, **kw})
        runs = [("greedy", SAMPLING["greedy"])] + ([(k, v) for k, v in SAMPLING.items() if k != "greedy"]
                                                   if name == "fp32_default" else [])
        kinds: Counter[str] = Counter()
        for sname, skw in runs:
            sp = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **skw)
            outs = llm.generate(ps, sp, on_step=lambda o: kinds.update(e[1] for e in o.events))
            out[f"{name}/{sname}"] = _completions(outs)
        missing = [k for k in MUST_SEE.get(name, ()) if not kinds[k]]
        if missing:
            raise SystemExit(f"setting {name} produced no {missing} events: it no longer exercises that path")
        out[f"{name}/event_counts"] = dict(sorted(kinds.items()))
        print(f"outputs {name:<22} {time.perf_counter() - t0:6.2f} s", file=sys.stderr)
    return out


def run_records(model) -> dict[str, Any]:
    """The step rows, request rows and events of one engine run (clock columns dropped)."""
    from paged.engine import LLM
    from paged import runs
    from paged.runs import chat_workload
    EngineRun = getattr(runs, "Run", None) or runs.EngineRun  # one Run since the step loop

    t0 = time.perf_counter()
    llm = LLM(model, **{**BASE_ENGINE, **RECORDS_ENGINE})
    run = EngineRun(llm, chat_workload(model.tokenizer, 6, max_tokens=10, n=2, arrive_every=2))
    run.run_to_completion()
    steps = run.steps_frame().drop(columns=list(CLOCK_STEP_COLUMNS))
    requests = run.requests_frame().drop(columns=list(CLOCK_REQUEST_COLUMNS))
    events = [tuple(e[:4]) + ((None,) if e[1] in CLOCK_EVENT_KINDS else (e[4],)) for e in run.events]
    print(f"records: {len(steps)} steps, {len(events)} events {time.perf_counter() - t0:6.2f} s", file=sys.stderr)
    return dict(steps=steps, requests=requests, events=events)


def record(parts: tuple[str, ...], trace=None) -> dict[str, Any]:
    """A fingerprint of ``parts`` (the simulator on ``trace``, or on a fresh ``make_trace()``)."""
    fp: dict[str, Any] = {}
    if "sim" in parts:
        fp["trace"] = simfp.make_trace() if trace is None else trace
        fp["sim"] = simfp.run_all(fp["trace"], list(simfp.CONFIGS), "auto", None)
    if "outputs" in parts or "records" in parts:
        model = _load_model()
        if "outputs" in parts:
            fp["outputs"] = run_outputs(model)
        if "records" in parts:
            fp["records"] = run_records(model)
    return fp


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _first_diff(a: list | dict, b: list | dict) -> str:
    if isinstance(a, dict) or isinstance(b, dict):
        return f"{a!r:.600} != {b!r:.600}"
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if not _same(x, y)), min(len(a), len(b)))
    x, y = (repr(v[i]) if i < len(v) else "<end>" for v in (a, b))
    return f"first at [{i}]: {x[:300]} != {y[:300]}"


def compare(base: dict[str, Any], new: dict[str, Any], parts: tuple[str, ...]) -> list[str]:
    """Every difference between two fingerprints in ``parts``, as readable lines (empty: identical)."""
    import pandas as pd

    diffs: list[str] = []
    if "sim" in parts:
        diffs += [f"sim.{d}" for d in simfp.compare(base["sim"], new["sim"])]
    if "outputs" in parts:
        b, n = base["outputs"], new["outputs"]
        diffs += [f"outputs: setting {k} missing in the new run" for k in b if k not in n]
        diffs += [f"outputs[{k}]: {_first_diff(b[k], n[k])}" for k in b if k in n and not _same(b[k], n[k])]
    if "records" in parts:
        b, n = base["records"], new["records"]
        for frame in ("steps", "requests"):
            try:
                pd.testing.assert_frame_equal(b[frame], n[frame], check_exact=True)
            except AssertionError as e:
                diffs.append(f"records.{frame}: {str(e).splitlines()[:6]}")
        if not _same(b["events"], n["events"]):
            diffs.append(f"records.events ({len(b['events'])} vs {len(n['events'])}): "
                         f"{_first_diff(b['events'], n['events'])}")
    return diffs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=("write", "compare"))
    p.add_argument("path", help="fingerprint pickle: written by 'write', read by 'compare'")
    p.add_argument("--parts", nargs="*", default=list(PARTS), choices=PARTS)
    p.add_argument("--save", default=None, help="compare: also write this run's fingerprint here")
    args = p.parse_args(argv)
    parts = tuple(args.parts)
    t0 = time.perf_counter()
    import paged
    print(f"paged from {os.path.dirname(paged.__file__)}", file=sys.stderr)  # which checkout is measured
    if args.action == "write":
        fp = record(parts)
        with open(args.path, "wb") as f:
            pickle.dump(fp, f)
        print(f"wrote {', '.join(parts)} to {args.path} in {time.perf_counter() - t0:.0f} s")
        return 0
    with open(args.path, "rb") as f:
        base = pickle.load(f)
    new = record(parts, trace=base.get("trace"))
    if args.save:
        with open(args.save, "wb") as f:
            pickle.dump(new, f)
    diffs = compare(base, new, parts)
    for d in diffs:
        print(d)
    print(f"{', '.join(parts)}: " + ("BIT-IDENTICAL" if not diffs else f"{len(diffs)} differences")
          + f" ({time.perf_counter() - t0:.0f} s)")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
