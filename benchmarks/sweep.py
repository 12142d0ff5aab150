"""Sweep benchmark: the 200-point simulator grid serial, in local processes and on Ray.

    nice python benchmarks/sweep.py                # 200 points: rate x block size x token budget x KV format,
                                                   # Llama-2-70B on A100-80GB (TP=2), 400 ShareGPT-like requests each
    nice python benchmarks/sweep.py --quick        # 16 points of 60 requests (a smoke run)
    nice python benchmarks/sweep.py --skip-processes --cpus 2

Printed: wall time of each way of running the grid, its speed-up over serial (Ray's start-up
apart) and the cores' worth of CPU its points got (on a shared machine the wall speed-up follows
the CPU the scheduler gives, not only the core count), the mean per-point cost (its CPU seconds: what a cluster core spends on it), the
per-task overhead (a no-op study of as many points: submission, scheduling, result and store
write), and a cluster estimate. Every run writes a fresh point store (no cache hits), and the
Ray table is checked equal to the serial one. Be kind to a shared machine: run it with `nice`.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import pandas as pd  # noqa: E402

from paged.sweeps import sweep  # noqa: E402

VOLATILE = ["wall_s", "cpu_s", "host", "pid", "node", "backend", "cached"]


def grid(quick: bool, num_requests: int | None) -> dict:
    """rate x block size x token budget x KV format (5 x 5 x 4 x 2 = 200; --quick: 2 x 2 x 2 x 2)."""
    base = {"model": "llama-2-70b", "gpu": "a100-80gb", "tensor_parallel": 2, "workload": "sharegpt",
            "num_requests": num_requests or (60 if quick else 400)}
    if quick:
        return {**base, "rate": [4.0, 16.0], "block_size": [16, 64], "max_num_batched_tokens": [512, 2048],
                "kv_cache_dtype": ["fp16", "fp8"]}
    return {**base, "rate": [2.0, 4.0, 8.0, 16.0, 32.0], "block_size": [8, 16, 32, 64, 128],
            "max_num_batched_tokens": [512, 1024, 2048, 4096], "kv_cache_dtype": ["fp16", "fp8"]}


def noop(i: int) -> dict:
    """A study that does nothing: its cost is the sweep's own per-point overhead."""
    return {"i": i}


def timed(label: str, fn) -> tuple[pd.DataFrame, float]:
    t0 = time.perf_counter()
    df = fn()
    wall = time.perf_counter() - t0
    print(f"  {label:<34} {wall:8.2f} s", flush=True)
    return df, wall


def results(df: pd.DataFrame) -> pd.DataFrame:
    keys = ["rate", "block_size", "max_num_batched_tokens", "kv_cache_dtype"]
    return df.drop(columns=VOLATILE).sort_values(keys).reset_index(drop=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="16 small points")
    p.add_argument("-n", "--num-requests", type=int, default=None, help="requests per point (default 400; quick 60)")
    p.add_argument("--cpus", type=int, default=None, help="CPUs of the local Ray instance and processes (default: all)")
    p.add_argument("--skip-processes", action="store_true", help="skip the local process-pool run")
    args = p.parse_args(argv)
    cpus = args.cpus or os.cpu_count() or 1
    g = grid(args.quick, args.num_requests)
    n = len(g["rate"]) * len(g["block_size"]) * len(g["max_num_batched_tokens"]) * len(g["kv_cache_dtype"])
    tmp = Path(tempfile.mkdtemp(prefix="paged-sweep-bench-"))
    print(f"load average before: {os.getloadavg()[0]:.1f}")
    print(f"## sweep: {n} simulator points ({g['model']} on {g['gpu']} x{g['tensor_parallel']}, "
          f"{g['num_requests']} requests each), {cpus} CPUs, os.cpu_count()={os.cpu_count()}")
    rows = []

    serial, t_serial = timed("serial (backend=local, jobs=1)", lambda: sweep(
        "simulate", g, store=tmp / "serial", progress=False))
    rows.append(("serial", t_serial, serial["cpu_s"].sum()))
    if not args.skip_processes and cpus > 1:
        proc, t_proc = timed(f"local processes (jobs={cpus})", lambda: sweep(
            "simulate", g, jobs=cpus, store=tmp / "proc", progress=False))
        rows.append((f"local processes x{cpus}", t_proc, proc["cpu_s"].sum()))

    import ray

    from paged.sweeps.backends import start_local_ray

    t0 = time.perf_counter()
    started = start_local_ray(num_cpus=cpus, log_to_driver=False)  # False: one was running (then not timed)
    t_start = time.perf_counter() - t0
    print(f"  {'ray.init (embedded instance)':<34} {t_start:8.2f} s")
    first, t_first = timed("ray, first sweep (workers start)", lambda: sweep(
        "simulate", g, backend="ray", store=tmp / "ray1", progress=False))
    on_ray, t_ray = timed("ray, warm workers", lambda: sweep(
        "simulate", g, backend="ray", store=tmp / "ray2", progress=False))
    rows += [("ray, first sweep", t_first, first["cpu_s"].sum()), ("ray, warm", t_ray, on_ray["cpu_s"].sum())]
    same = results(on_ray).drop(columns="point").equals(results(serial).drop(columns="point")) and \
        results(first).drop(columns="point").equals(results(serial).drop(columns="point"))
    ids = {"i": list(range(n))}
    _, t_noop_ray = timed("ray, no-op study", lambda: sweep(noop, ids, backend="ray", store=tmp / "noop_ray",
                                                            progress=False))
    _, t_noop_local = timed("serial, no-op study", lambda: sweep(noop, ids, store=tmp / "noop_local",
                                                                 progress=False))
    if started:
        ray.shutdown()

    cost = serial["wall_s"].mean()
    cpu = serial["cpu_s"].mean()
    print()
    table = pd.DataFrame([{"run": r, "wall_s": t, "speedup_vs_serial": t_serial / t, "points_per_s": n / t,
                           "cores_busy": cpu_sum / t} for r, t, cpu_sum in rows])
    print(table.to_string(index=False, float_format=lambda x: f"{x:.3g}"))
    print()
    per = pd.DataFrame([
        {"what": "simulator point, wall (serial)", "ms": 1e3 * cost},
        {"what": "simulator point, CPU (serial)", "ms": 1e3 * cpu},
        {"what": "simulator point, wall (on a Ray worker)", "ms": 1e3 * on_ray["wall_s"].mean()},
        {"what": "sweep overhead per point, serial (no-op)", "ms": 1e3 * t_noop_local / n},
        {"what": f"sweep overhead per point, Ray x{cpus} (no-op)", "ms": 1e3 * t_noop_ray / n},
    ])
    print(per.to_string(index=False, float_format=lambda x: f"{x:.3g}"))
    print(f"Ray start-up (once per session, not in the speed-ups): {t_start:.1f} s")
    print(f"load average after: {os.getloadavg()[0]:.1f} (cores_busy: the points' CPU seconds / wall: how many "
          f"cores' worth of CPU the run got; below the core count, other processes shared the machine)")
    print(f"\nRay table identical to serial (all result columns, order-independent): {'yes' if same else 'NO'}")
    print(f"ideal speed-up on {cpus} cores: {cpus}x; measured (warm Ray): {t_serial / t_ray:.2f}x")
    ovh = t_noop_ray / n
    for cores in (64, 512):
        work, driver = 1000 * cpu / cores, 1000 * ovh  # CPU seconds: a busy shared machine inflates wall
        print(f"estimate: 1000 points like these on {cores} cluster cores ~ {max(work, driver):.0f} s "
              f"(work {work:.0f} s = points x per-point CPU / cores; driver-bound floor {driver:.0f} s "
              f"= points x Ray overhead per point)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
