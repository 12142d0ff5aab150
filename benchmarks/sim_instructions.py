"""The simulator's cost in instructions and wall time, one checkout beside another.

    python benchmarks/sim_instructions.py --base /tmp/base3f            # this tree vs the base checkout
    python benchmarks/sim_instructions.py --base /tmp/base3f -n 400 --wall-runs 5 --no-callgrind
    python benchmarks/sim_instructions.py --profile                     # cProfile of the simulation (this tree)

Workload: ``synthetic_trace("sharegpt", n)`` (seed 0, all arriving at once) simulated for Llama-2-13B on
an A100-80GB with the default ``SimConfig``. Each checkout runs in its own interpreter with that checkout
first on ``sys.path``. Instructions: valgrind's callgrind collecting only inside ``operator.call`` (the
C function ``_operator_call``), through which the child calls ``Simulator.run`` alone, so imports, the
trace and the simulator's construction are not counted. Wall time: runs of the two checkouts alternated
(base, tree, base, tree, ...), the median of each, without valgrind. Ratios are tree / base.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(n: int, profile: bool) -> None:
    """Run the workload once in this interpreter (the checkout is the first entry of sys.path)."""
    import operator
    import time

    from paged.sim.simulator import SimConfig, Simulator
    from paged.sim.workload import synthetic_trace

    trace = synthetic_trace("sharegpt", n)
    sim = Simulator(SimConfig(model="llama-2-13b", gpu="a100-80gb"))
    if profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.runcall(sim.run, trace)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return
    t0 = time.perf_counter()
    res = operator.call(sim.run, trace)  # callgrind collects inside _operator_call only
    wall = time.perf_counter() - t0
    import paged

    print(json.dumps({"wall_s": wall, "steps": int(res.summary["num_steps"]),
                      "paged": os.path.dirname(os.path.abspath(paged.__file__))}))


def _env(tree: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=tree, PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
    return env


def _run(tree: str, n: int, valgrind: bool) -> dict:
    cmd = [sys.executable, "-P", os.path.abspath(__file__), "--child", "-n", str(n)]
    out = None
    if valgrind:
        out = tempfile.mkdtemp(prefix="simins")
        cmd = ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=_operator_call",
               f"--callgrind-out-file={out}/cg.out"] + cmd
    proc = subprocess.run(cmd, env=_env(tree), cwd=tree, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{tree}: child failed\n{proc.stderr[-3000:]}")
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    if not row["paged"].startswith(os.path.abspath(tree)):
        raise SystemExit(f"{tree}: imported paged from {row['paged']}; check PYTHONPATH")
    if out is not None:
        with open(f"{out}/cg.out") as f:
            totals = [line for line in f if line.startswith(("totals:", "summary:"))]
        row["instructions"] = int(totals[-1].split()[1])
        shutil.rmtree(out)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", type=int, default=400, help="requests in the trace")
    p.add_argument("--base", default="/tmp/base3f", help="the checkout to compare with")
    p.add_argument("--tree", default=HERE, help="the checkout measured (default: this one)")
    p.add_argument("--wall-runs", type=int, default=5, help="alternated wall-time runs per checkout")
    p.add_argument("--no-callgrind", action="store_true", help="wall time only")
    p.add_argument("--profile", action="store_true", help="cProfile of --tree's simulation, top functions")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child or a.profile:
        if a.profile and not a.child:
            sys.path.insert(0, a.tree)
        child(a.n, a.profile)
        return
    trees = {"base": os.path.abspath(a.base), "tree": os.path.abspath(a.tree)}
    rows = {k: {"checkout": v} for k, v in trees.items()}
    if not a.no_callgrind:
        if shutil.which("valgrind") is None:
            raise SystemExit("valgrind not found; install it or pass --no-callgrind")
        for k, tree in trees.items():
            r = _run(tree, a.n, True)
            rows[k].update(steps=r["steps"], instructions=r["instructions"])
    walls: dict[str, list[float]] = {k: [] for k in trees}
    for _ in range(a.wall_runs):
        for k, tree in trees.items():
            r = _run(tree, a.n, False)
            walls[k].append(r["wall_s"])
            rows[k]["steps"] = r["steps"]
    for k in trees:
        rows[k]["wall_s_median"] = statistics.median(walls[k]) if walls[k] else float("nan")
        rows[k]["wall_s_min"] = min(walls[k]) if walls[k] else float("nan")
    print(f"## simulator: {a.n} ShareGPT-like requests, Llama-2-13B on A100-80GB (Simulator.run only)")
    cols = ["steps", "instructions", "wall_s_median", "wall_s_min"]
    print(f"{'':6} {'checkout':28} " + " ".join(f"{c:>15}" for c in cols))
    for k in trees:
        vals = [rows[k].get(c, float("nan")) for c in cols]
        print(f"{k:6} {rows[k]['checkout'][-28:]:28} " + " ".join(
            f"{v:>15,}" if isinstance(v, int) else f"{v:>15.4f}" for v in vals))
    ratio = [rows["tree"].get(c, float("nan")) / rows["base"].get(c, float("nan")) for c in cols]
    print(f"{'ratio':6} {'tree / base':28} " + " ".join(f"{v:>15.4f}" for v in ratio))


if __name__ == "__main__":
    main()
