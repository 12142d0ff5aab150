"""Does block compaction pay on this engine? The measurements behind ``benchmarks/compaction.py``
and notebook 08 (DataFrames; the two sides of every ratio run in the same call, alternating, best of
``rounds`` thread-CPU times, so drifting load on shared cores hits both alike).

- ``read_table``: one K/V read through scattered (random permutation: the worst fragmentation) and
  contiguous block tables: ``slots`` (the engine's CPU path, ``index_select`` of token slots),
  ``decode`` (``kernels.paged_decode_attention``, torch reference), ``memcpy`` (one slice copy: the
  floor of any read; no engine path exploits contiguity), with CUDA ``triton_*``. ratio = median
  over rounds of scattered / contiguous back to back (> 1: contiguity is faster).
- ``copy_table``: a synthetic workload under the scheduler, compaction on vs off (same schedule):
  passes, copies, fragmentation before/after, planning time, and ``kernels.copy_blocks`` applying
  a pass to a float32 cache of ``layers`` x ``kv_heads`` x ``head_dim`` (default SmolLM2-135M's).
- ``engine_table``: the real engine (random model of SmolLM2-135M's layer shape, fewer layers),
  off and on ``repeats`` times alternating: forward and cache-op time, off/on ratios of forward
  (wall) and thread CPU (``cpu_ratio``, robust to neighbours), copies, identical greedy outputs.
- ``verdict``: read time saved per step (linear in breaks removed) x steps a pass serves, vs its cost.
- ``compaction_sim_table``: the simulator charges each copied block like a copy-on-write copy
  (HBM read + write) and credits no speed-up (none was measured above): what copies cost at scale.
- ``compaction_snapshots``: a fragmented pool snapshotted before and after one pass
  (``CompactionDemo``, drawn by ``paged.viz.compaction``); ``runs_frame`` lists each request's
  own-block runs. "After" holds the same requests, tokens and ref counts (only block ids change);
  a request's runs after the pass are 1 unless the pass skipped it.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import pandas as pd
import torch

from paged._kernels import kernels
from paged.core.clock import SimulatedClock
from paged.core.compaction import CompactionPlan, count_runs, own_blocks
from paged.core.kv_manager import KVCacheManager
from paged.core.loop import MemoryOnlyExecutor, StepLoop
from paged.core.request import Request
from paged.core.scheduler import Scheduler, SchedulerConfig
from paged.core.snapshot import KVSnapshot
from paged.studies.engine_setup import study_model

__all__ = ["CompactionDemo", "compaction_sim_table", "compaction_snapshots", "copy_table", "engine_table",
           "read_table", "runs_frame", "verdict"]


def _times(fns: Sequence[Callable[[], object]], rounds: int) -> tuple[list[float], list[list[float]]]:
    """Thread CPU ms of each fn: (best of ``rounds``, every round's), the fns alternating within
    every round after 3 warm-ups each, so a ratio of two fns can be taken per round (robust to load)."""
    for fn in fns:
        for _ in range(3):
            fn()
    per_round = [[_ms(fn) for fn in fns] for _ in range(rounds)]
    return [min(r[i] for r in per_round) for i in range(len(fns))], per_round


def _ms(fn: Callable[[], object]) -> float:
    t0 = time.thread_time()
    fn()
    return (time.thread_time() - t0) * 1e3


def _ratio(per_round: list[list[float]], i: int, j: int) -> float:
    """Median over rounds of fn i's time / fn j's time (measured back to back)."""
    return statistics.median(r[i] / r[j] for r in per_round if r[j] > 0)


def _layer(num_seqs: int, ctx: int, bs: int, heads: int, head_dim: int, dtype, device, shuffle: bool, seed: int = 0):
    per = -(-ctx // bs)
    fmt = "fp16" if dtype == torch.float16 else "fp32"
    layer = kernels.allocate_kv_cache(num_seqs * per, bs, heads, head_dim, fmt, dtype=dtype, device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    layer.k.normal_(generator=g)
    layer.v.normal_(generator=g)
    order = (torch.randperm(num_seqs * per, generator=torch.Generator().manual_seed(seed)) if shuffle
             else torch.arange(num_seqs * per))
    tables = order.reshape(num_seqs, per).int().to(device)
    return layer, tables, torch.full((num_seqs,), ctx, dtype=torch.int32, device=device)


def read_table(contexts: Sequence[int] = (256, 1024, 4096), block_sizes: Sequence[int] = (16, 128), *,
               batch: int = 4, q_heads: int = 9, kv_heads: int = 3, head_dim: int = 64, rounds: int = 15,
               gpu: bool | None = None):
    """Scattered vs contiguous tables over the same data, one row per (context, block size)."""
    h, d = kv_heads, head_dim
    rows = []
    for ctx in contexts:
        for bs in block_sizes:
            (ls, ts, lens), (lc, tc, _) = (_layer(batch, ctx, bs, h, d, torch.float32, "cpu", sh)
                                           for sh in (True, False))
            q = torch.randn(batch, q_heads, d)
            p = torch.arange(ctx)

            def slots(layer, tables):
                kc, vc = layer.k.view(-1, h, d), layer.v.view(-1, h, d)
                sl = (tables.long()[:, p // bs] * bs + p % bs).reshape(-1)
                return lambda: (kc.index_select(0, sl), vc.index_select(0, sl))

            def decode(layer, tables):
                return lambda: kernels.paged_decode_attention(q, layer, None, tables, lens, backend="torch")

            per = tc.shape[1] * bs
            kc0, vc0 = lc.k.view(-1, h, d), lc.v.view(-1, h, d)
            memcpy = lambda: [(kc0[i * per:i * per + ctx].clone(), vc0[i * per:i * per + ctx].clone())  # noqa: E731
                              for i in range(batch)]
            t, rounds_ms = _times([slots(ls, ts), slots(lc, tc), decode(ls, ts), decode(lc, tc), memcpy], rounds)
            rows.append(dict(ctx=ctx, block=bs, batch=batch, slots_scat_ms=t[0], slots_contig_ms=t[1],
                             slots_ratio=_ratio(rounds_ms, 0, 1), decode_scat_ms=t[2], decode_contig_ms=t[3],
                             decode_ratio=_ratio(rounds_ms, 2, 3), memcpy_ms=t[4],
                             slots_vs_memcpy=_ratio(rounds_ms, 1, 4)))
    if gpu if gpu is not None else torch.cuda.is_available():
        rows += _triton_rows(contexts, block_sizes, q_heads, kv_heads, head_dim)
    return pd.DataFrame(rows)


def _triton_rows(contexts, block_sizes, q_heads: int, kv_heads: int, head_dim: int, batch: int = 16) -> list[dict]:
    """The Triton decode kernel on fp16 K/V, scattered vs contiguous (``triton.testing.do_bench``)."""
    import triton.testing
    rows = []
    for ctx in contexts:
        for bs in block_sizes:
            us = []
            for shuffle in (True, False):
                layer, tables, lens = _layer(batch, ctx, bs, kv_heads, head_dim, torch.float16, "cuda", shuffle)
                q = torch.randn(batch, q_heads, head_dim, device="cuda", dtype=torch.float16)
                us.append(triton.testing.do_bench(
                    lambda: kernels.paged_decode_attention(q, layer, None, tables, lens, backend="triton"),
                    warmup=25, rep=100) * 1e3)
                del layer
            rows.append(dict(ctx=ctx, block=bs, batch=batch, triton_scat_us=us[0], triton_contig_us=us[1],
                             triton_ratio=us[0] / us[1]))
        torch.cuda.empty_cache()
    return rows


def _workload(n: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    system = [rng.randrange(1000) for _ in range(64)]
    return [Request(f"r{i}", (system if i % 2 else []) + [rng.randrange(1000) for _ in range(rng.randint(16, 400))],
                    max_tokens=rng.randint(16, 256)) for i in range(n)]


def _drive(on: bool, requests: int, num_blocks: int, threshold: float, interval: int, seed: int) -> dict:
    kv = KVCacheManager(num_blocks, 16)
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=32, enable_block_compaction=on,
                                          compaction_threshold=threshold, compaction_interval=interval))
    loop = StepLoop(sched, MemoryOnlyExecutor(lambda rid: 7), SimulatedClock())
    reqs = _workload(requests, seed)
    r = dict(steps=0, passes=[], frag=[], plan_ms=[], ctx=[], decodes=[], schedule=[])
    while reqs or loop.has_unfinished_requests():
        for _ in range(min(2, len(reqs))):
            loop.add_request(reqs.pop())
        step = loop.step()
        plan = step.plan
        if plan.compaction_copies:
            lc = kv.last_compaction
            r["passes"].append(plan.compaction_copies)
            r["plan_ms"].append(step.schedule_s * 1e3)
            r["frag"].append((lc.fragmentation_before, lc.fragmentation_after))
        r["ctx"] += [c.start + 1 for c in plan.scheduled if c.is_decode]
        r["decodes"].append(plan.num_decode_tokens)
        r["schedule"].append([(c.request_id, c.start, c.num_tokens) for c in plan.scheduled])
        r["steps"] += 1
    return r


def copy_table(requests: int = 120, num_blocks: int = 1200, *, threshold: float = 0.25, interval: int = 16,
               layers: int = 30, kv_heads: int = 3, head_dim: int = 64, seed: int = 0):
    """One row: what compaction did on the workload and what its passes cost (see module docstring)."""
    on = _drive(True, requests, num_blocks, threshold, interval, seed)
    off = _drive(False, requests, num_blocks, threshold, interval, seed)
    cache = [kernels.allocate_kv_cache(num_blocks, 16, kv_heads, head_dim, "fp32", dtype=torch.float32)
             for _ in range(layers)]
    apply_ms = []
    for copies in on["passes"]:
        t0 = time.perf_counter()
        kernels.copy_blocks(cache, copies, backend="torch")
        apply_ms.append((time.perf_counter() - t0) * 1e3)
    n = [len(c) for c in on["passes"]]
    med = lambda xs: statistics.median(xs) if xs else 0.0  # noqa: E731
    mean = lambda xs: statistics.mean(xs) if xs else 0.0  # noqa: E731
    return pd.DataFrame([dict(
        steps=on["steps"], same_schedule=on["schedule"] == off["schedule"], passes=len(n),
        copies_per_pass=mean(n), max_copies=max(n, default=0), frag_before=mean([f for f, _ in on["frag"]]),
        frag_after=mean([f for _, f in on["frag"]]), plan_ms=med(on["plan_ms"]), apply_ms=med(apply_ms),
        mib_per_pass=mean(n) * layers * 2 * 16 * kv_heads * head_dim * 4 / 2**20,
        mean_decode_ctx=mean(on["ctx"]), decodes_per_step=mean(on["decodes"]), layers=layers)])


def verdict(reads, copies) -> dict:
    """Time a pass saves (linear model: the engine path's read saved per decode and layer at full
    scatter, at the measured context closest to the workload's mean, x the share of breaks a pass
    removes x layers x decodes per step x steps per pass) against its cost (plan + copies)."""
    c = copies.iloc[0]
    cpu = reads.dropna(subset=["slots_ratio"]) if "slots_ratio" in reads else reads
    near = cpu.iloc[((cpu["ctx"] - c["mean_decode_ctx"]).abs() + (cpu["block"] != 16)).argsort().iloc[0]]
    per_decode_ms = near["slots_contig_ms"] * (near["slots_ratio"] - 1) / near["batch"]
    fixed = c["frag_before"] - c["frag_after"]
    saved_per_step = per_decode_ms * c["layers"] * c["decodes_per_step"] * fixed
    between = c["steps"] / c["passes"] if c["passes"] else 0.0
    cost = c["plan_ms"] + c["apply_ms"]
    gain = saved_per_step * between
    out = dict(ctx=int(near["ctx"]), block=int(near["block"]), slots_ratio=near["slots_ratio"],
               decode_ratio=near["decode_ratio"], per_decode_layer_us=per_decode_ms * 1e3, breaks_fixed=fixed,
               saved_per_step_ms=saved_per_step, steps_per_pass=between, saved_per_pass_ms=gain, pass_ms=cost,
               payback=gain / cost if cost else float("nan"))
    return {**{k: (v if isinstance(v, int) else float(v)) for k, v in out.items()}, "pays": bool(gain > cost)}


def engine_table(model=None, *, layers: int = 2, requests: int = 16, max_tokens: int = 96, num_blocks: int = 400,
                 interval: int = 16, threshold: float = 0.1, repeats: int = 3, seed: int = 0):
    """Compaction off vs on on the real engine path (see module docstring); ``model``: a
    ``LoadedModel`` (default: a random checkpoint of SmolLM2-135M's layer shape with ``layers`` layers,
    written with ``paged.models.testing.make_tiny_checkpoint``, which needs ``transformers``)."""
    from paged.engine.llm import LLM
    from paged.engine.sampling import SamplingParams

    model = study_model(model, prefix="paged-compaction-", vocab_size=512, hidden_size=576, intermediate_size=1536,
                        num_layers=layers, num_heads=9, num_kv_heads=3, head_dim=64)
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(16, 64))] for _ in range(requests)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rows, outputs = [], {}
    for rep in range(repeats):
        for on in (False, True):
            llm = LLM(model=model, num_blocks=num_blocks, block_size=16, max_num_seqs=32, enable_block_compaction=on,
                      compaction_interval=interval, compaction_threshold=threshold, record_events=False)
            steps = []
            t0, c0 = time.perf_counter(), time.thread_time()
            out = llm.generate(prompts, params, on_step=steps.append)
            wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
            outputs.setdefault(on, [o.outputs[0].token_ids for o in out])
            rows.append(dict(compaction=on, repeat=rep, steps=len(steps), wall_s=wall, cpu_s=cpu,
                             forward_ms=1e3 * sum(st.forward_s for st in steps),
                             cache_ops_ms=1e3 * sum(st.cache_ops_s for st in steps),
                             copies=sum(st.num_compaction_copies for st in steps),
                             passes=sum(1 for st in steps if st.num_compaction_copies)))
    df = pd.DataFrame(rows)
    best = df.groupby("compaction")[["wall_s", "cpu_s", "forward_ms", "cache_ops_ms"]].min()
    off_rows, on_rows = df[~df.compaction].reset_index(drop=True), df[df.compaction].reset_index(drop=True)

    def ratios(col: str, name: str) -> dict[str, float]:  # off/on of each back-to-back pair: median, min, max
        r = off_rows[col] / on_rows[col]
        return {name: float(r.median()), f"{name}_min": float(r.min()), f"{name}_max": float(r.max())}

    summary = dict(identical=outputs[False] == outputs[True], steps=int(df["steps"].iloc[0]),
                   passes=int(on_rows["passes"].iloc[0]), copies=int(on_rows["copies"].iloc[0]),
                   forward_ms_off=best.loc[False, "forward_ms"], forward_ms_on=best.loc[True, "forward_ms"],
                   **ratios("forward_ms", "forward_ratio"),
                   cache_ops_ms_off=best.loc[False, "cache_ops_ms"], cache_ops_ms_on=best.loc[True, "cache_ops_ms"],
                   cpu_s_off=best.loc[False, "cpu_s"], cpu_s_on=best.loc[True, "cpu_s"], **ratios("cpu_s", "cpu_ratio"),
                   wall_ratio=float((off_rows["wall_s"] / on_rows["wall_s"]).median()))
    return pd.DataFrame([summary])


# ---- At scale (the simulator) and on the block pool (one pass, before and after) -----------------------------------


def compaction_sim_table(requests: int = 400, *, model: str = "llama-2-7b", gpu: str = "a100-80gb",
                         num_blocks: int = 3000, threshold: float = 0.05, interval: int = 16,
                         seed: int = 0) -> pd.DataFrame:
    """The simulator (see module docstring): one row per setting (off, on) of a Poisson workload
    (20 req/s, prompts 32-1023, outputs 32-511 tokens): steps, passes, copies, GiB copied,
    simulated seconds and output throughput."""
    from paged.sim.simulator import SimConfig, Simulator

    rng = np.random.default_rng(seed)
    trace = pd.DataFrame(dict(arrival_time=np.cumsum(rng.exponential(0.05, requests)),
                              prompt_tokens=rng.integers(32, 1024, requests),
                              output_tokens=rng.integers(32, 512, requests)))
    rows = []
    for on in (False, True):
        sim = Simulator(SimConfig(model=model, gpu=gpu, num_blocks=num_blocks, enable_block_compaction=on,
                                  compaction_threshold=threshold, compaction_interval=interval, prompt_seed=seed))
        r = sim.run(trace)
        s = r.steps
        copies = int(s["num_compaction_copies"].sum())
        rows.append(dict(compaction=on, model=model, gpu=gpu, steps=len(s),
                         passes=int((s["num_compaction_copies"] > 0).sum()), copies=copies,
                         gib_copied=copies * sim.block_bytes / 2**30,
                         sim_seconds=float(s["step_time_s"].sum()), throughput_tok_s=r.summary["throughput_tok_s"]))
    return pd.DataFrame(rows)


@dataclass
class CompactionDemo:
    """Two snapshots around one pass, the pass's plan, and the running order it used."""

    before: KVSnapshot
    after: KVSnapshot
    plan: CompactionPlan
    order: list[str] = field(default_factory=list)


def compaction_snapshots(num_blocks: int = 192, block_size: int = 4, num_requests: int = 10, *,
                         steps: int = 40, drop_cached: bool = False, seed: int = 0) -> CompactionDemo:
    """Run ``num_requests`` requests (half share a system prompt) for ``steps`` steps with
    compaction off, then one pass (see module docstring). Deterministic for a seed."""
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks, block_size)
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=num_requests))
    loop = StepLoop(sched, MemoryOnlyExecutor(lambda rid: rng.randrange(100)), SimulatedClock())
    system = [rng.randrange(100) for _ in range(3 * block_size)]
    for i in range(num_requests):
        prompt = (system if i % 2 else []) + [rng.randrange(100) for _ in range(rng.randint(2, 6 * block_size))]
        sched.add_request(Request(f"r{i}", prompt, max_tokens=rng.randint(steps // 2, 4 * steps)))
    for _ in range(steps):
        if not sched.has_unfinished_requests():
            break
        loop.step()
        sched.take_finished()
    order = [r.request_id for r in sched.running]
    before = kv.snapshot(sched.requests)
    kv.compact(order, drop_cached=drop_cached)
    return CompactionDemo(before, kv.snapshot(sched.requests), kv.last_compaction, order)


def runs_frame(demo: CompactionDemo) -> pd.DataFrame:
    """One row per running request: own blocks and their runs before and after the pass."""
    def own(snap: KVSnapshot) -> dict[str, list[int]]:
        return dict(own_blocks([(rid, snap.table(rid).tolist()) for rid in demo.order]))

    b, a = own(demo.before), own(demo.after)
    return pd.DataFrame([dict(request_id=r, own_blocks=len(b[r]), runs_before=count_runs(b[r]),
                              runs_after=count_runs(a[r])) for r in demo.order])
