"""Build notebooks/10_sweeps.ipynb (run from the repository root: python notebooks/builders/build_10.py).

The notebook is written from this script with nbformat, without outputs; edit here, not in JupyterLab.
"""
from __future__ import annotations

from pathlib import Path

import nbformat as nbf

md, code = nbf.v4.new_markdown_cell, nbf.v4.new_code_cell
cells = []

cells.append(md("""# 10 · Sweeps: 200 deployments of Llama-2-70B, on this laptop or a Ray cluster

**Question:** for Llama-2-70B on two A100-80GB (tensor parallel 2), which combinations of **arrival rate**, **block
size**, **token budget** (`max_num_batched_tokens`) and **KV format** give the best trade-off between throughput,
p99 time between tokens (TBT) and the KV memory they hold?

That is a grid of 5 × 5 × 4 × 2 = **200 simulated deployments**, each running 400 ShareGPT-like requests through the
engine's own scheduler and KV-cache manager with the roofline cost model. One call runs them all:

```python
df = paged.sweep("simulate", grid)                                 # this process
df = paged.sweep("simulate", grid, backend="ray")                  # Ray tasks on this machine
df = paged.sweep("simulate", grid, backend="ray", address="auto")  # the same cell on a Ray cluster
```

and returns one tidy table: each point's parameters, its results, its wall and CPU time, where it ran and its status.
Every finished point is stored at once (one Parquet file per point), so running a cell again, or after an interrupt,
computes only what is missing. docs/sweeps.md has the details.

With `PAGED_SMOKE=1` (the test run) the grid is 2 × 2 × 2 × 2 points of 40 requests, in this process.
"""))

cells.append(code("""import os

SMOKE = os.environ.get("PAGED_SMOKE") == "1"  # a toy grid for the headless test run
MODEL, GPU, TP = "llama-2-70b", "a100-80gb", 2
NUM_REQUESTS = 40 if SMOKE else 400           # ShareGPT-like requests per simulated deployment
RATES = [4.0, 16.0] if SMOKE else [2.0, 4.0, 8.0, 16.0, 32.0]      # requests per second
BLOCK_SIZES = [16, 64] if SMOKE else [8, 16, 32, 64, 128]
BUDGETS = [512, 2048] if SMOKE else [512, 1024, 2048, 4096]        # max_num_batched_tokens
KV_FORMATS = ["fp16", "fp8"]
# Where the points run. "local": this process (JOBS=1) or JOBS processes; "ray": one Ray task per point on an
# embedded Ray instance (ADDRESS=None), or a cluster: ADDRESS = "auto" on a cluster machine, "ray://HEAD_IP:10001"
# from elsewhere (see "The same cell on a cluster" below).
BACKEND = "local" if SMOKE else "ray"
ADDRESS = None
JOBS = 1
STORE = ".cache/sweeps"                        # the point store (git-ignored); False keeps nothing"""))
cells[-1].metadata["tags"] = ["parameters"]

cells.append(md("""## The grid

A dict of lists is the Cartesian product of its lists (fixed values are plain scalars). `paged.sweeps.expand` shows
the points the sweep will run; `random_sample` and `latin_hypercube` draw points from ranges instead."""))

cells.append(code("""import paged
from paged.sweeps import expand, pareto_front
from paged.viz.sweep import SweepView, heatmap, parallel_coordinates, pareto

grid = {"model": MODEL, "gpu": GPU, "tensor_parallel": TP, "workload": "sharegpt", "num_requests": NUM_REQUESTS,
        "rate": RATES, "block_size": BLOCK_SIZES, "max_num_batched_tokens": BUDGETS, "kv_format": KV_FORMATS}
points = expand(grid)
print(len(points), "points; the first:", points[0])"""))

cells.append(md("""## Run it, and watch it fill

The view below starts empty: a heatmap of output throughput over rate × block size (the best over the other two
parameters) and a parallel-coordinates plot with one line per deployment, coloured by p99 TBT. Both fill as points
finish (at most four frames a second); the bar counts points and failures.

Run the cell a second time: every point comes from the store (`cached` is True, `computed` is 0)."""))

cells.append(code("""view = SweepView("throughput_tok_s", x="rate", y="block_size", agg="max", grid=grid,
                 dims=["rate", "block_size", "max_num_batched_tokens", "kv_format", "tbt_p99_s", "throughput_tok_s"])
view"""))

cells.append(code("""df = paged.sweep("simulate", grid, backend=BACKEND, address=ADDRESS, jobs=JOBS, store=STORE, on_result=view.add)
view.draw()
df.attrs["sweep"]"""))

cells.append(code("""df[["rate", "block_size", "max_num_batched_tokens", "kv_format", "throughput_tok_s", "tbt_p99_s", "ttft_p99_s",
    "num_preemptions", "status", "wall_s", "cpu_s", "host", "pid", "node"]].head(8)"""))

cells.append(md("""Each row also says where it ran (`host`, `pid`, and under Ray the `node` id) and what it cost (`wall_s`,
`cpu_s`): the per-point cost tells you what a bigger grid will take. A point that cannot run is a row with its
error, and the others complete; for example a block size of 0 and the model on one GPU:"""))

cells.append(code("""bad = paged.sweep("simulate", [{**points[0], "block_size": 0}, {**points[0], "tensor_parallel": 1}, points[0]],
                  store=False, progress=False)
bad[["block_size", "tensor_parallel", "status", "error"]]"""))

cells.append(md("""## The Pareto front: throughput vs p99 TBT vs KV memory

The KV memory a deployment holds is its mean share of the KV pool times the pool's size (the pool fills what the
weights leave of each GPU; fp8 stores a token in half the bytes of fp16). A deployment is **Pareto-optimal** when no
other one has at least its throughput, at most its p99 TBT and at most its memory, and is strictly better on one."""))

cells.append(code("""from paged.sim.specs import get_model

spec = get_model(MODEL)
bytes_per_token = [spec.kv_bytes_per_token(f, TP, block_size=b) for f, b in zip(df["kv_format"], df["block_size"])]
df["kv_gib_mean"] = df["kv_block_usage_mean"] * df["num_kv_blocks"] * df["block_size"] * bytes_per_token / 2**30
front = pareto_front(df, maximize=["throughput_tok_s"], minimize=["tbt_p99_s", "kv_gib_mean"])
print(f"{int(front.sum())} of {len(df)} deployments are on the front")
df[front].sort_values("throughput_tok_s", ascending=False)[["rate", "block_size", "max_num_batched_tokens", "kv_format",
                                                          "throughput_tok_s", "tbt_p99_s", "kv_gib_mean",
                                                          "num_preemptions"]].head(15)"""))

cells.append(code("""pareto(df, "tbt_p99_s", "throughput_tok_s", maximize=["throughput_tok_s"], minimize=["tbt_p99_s", "kv_gib_mean"],
       color="kv_gib_mean", hover=["rate", "block_size", "max_num_batched_tokens", "kv_format"])"""))

cells.append(md("""What each knob does, averaged over the others (the full run, `PAGED_SMOKE` unset, showed: fp8 sustains
about 1,300 output tokens/s against about 980 for fp16 from 8 requests/s on, because fp16's pool
fills and requests are preempted and recomputed, while fp8 holds twice the tokens in the same bytes; a 512-token
budget keeps p99 TBT near 0.2 s where 2,048 or more let it reach about 0.47 s, for the same throughput; block
size matters least: larger blocks hold more unused slots, so KV memory grows a little from 8 to 128 tokens per
block. Past about 8 requests/s throughput stops growing and only the latency tail does. 45 of the 47 points on the
front are fp8, and 39 of the 47 use a budget of 512 or 1,024 tokens.)"""))

cells.append(code("""from IPython.display import display

knobs = ["throughput_tok_s", "tbt_p99_s", "kv_gib_mean", "num_preemptions"]
for knob in ("kv_format", "max_num_batched_tokens", "block_size", "rate"):
    display(df.groupby(knob)[knobs].mean().round(3))"""))

cells.append(code("""heatmap(df, "max_num_batched_tokens", "rate", "tbt_p99_s", agg="min",
        title="best p99 TBT (s) per rate and token budget")"""))

cells.append(md("""## The same cell on a cluster

The sweep above is Ray tasks on this machine (or local processes in the test run). To run it on many machines:

1. On the head machine: `pip install 'paged-kv-workbench[ray]'` (the same version everywhere), then
   `ray start --head --port=6379` (it also serves Ray Client on port 10001).
2. On every other machine: `ray start --address=HEAD_IP:6379`. `ray status` lists the nodes and CPUs.
3. In the parameters cell set `BACKEND = "ray"` and `ADDRESS = "auto"` (this notebook runs on a cluster machine) or
   `ADDRESS = "ray://HEAD_IP:10001"` (it runs elsewhere; the store stays here). Run the sweep cell again.

Each point is one Ray task asking for one CPU; a worker that dies is replaced and its point re-run (three retries),
and the point still appears once. Simulator points are independent and CPU-bound, so a grid scales with the cores
until a point costs about as much as Ray's per-task overhead (`benchmarks/sweep.py` measures both); a single
simulation does not get faster. If the machines do not have this checkout installed, pass
`ray_init={"runtime_env": {"working_dir": "."}}` to ship it."""))

cells.append(md("""## Try this

- Make the grid bigger (`RATES = [1, 2, 4, 8, 16, 24, 32]`, add `"enable_prefix_caching": [True, False]` or
  `"preemption_mode": ["recompute", "swap"]`): only the new points run, the old ones come from the store.
- Replace the product by a sample: `paged.sweeps.latin_hypercube({"rate": paged.sweeps.Range(1, 32, log=True),
  "block_size": [8, 16, 32, 64], ...fixed keys...}, 100)` covers the same space with 100 points.
- Sweep another study: `paged.sweep("host_tier", {"zipf": [0.6, 1.0, 1.4], "rate": [2.0, 4.0]})` returns one row per
  host-tier variant per point (`row` numbers them); `paged.sweeps.STUDIES` lists them all.
- Interrupt the sweep cell (■) half-way, then run it again: `df.attrs["sweep"]` counts what came from the store.
- `force=True` recomputes everything, e.g. after changing the simulator (the store keys on the package version,
  not on your edits).
"""))

nb = nbf.v4.new_notebook(cells=cells)
nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
nb.metadata["language_info"] = {"name": "python"}
out = Path(__file__).resolve().parents[1] / "10_sweeps.ipynb"
nbf.write(nb, out)
print(f"wrote {out}")
