"""Cost of the live views: snapshot + frame build per pool size, and the engine's throughput with
the live dashboard at its frame cap vs without it, on the same workload.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/viz.py [--quick] [--page-bytes]

Part 1 fills a pool of 1k / 16k / 128k blocks to ~75% with requests of 16 blocks and times
`KVCacheManager.snapshot()` (whole, and of the one grid page drawn), the grid page and block-table
arrays a frame assigns, and whole frames into FigureWidgets (inside `batch_update`): grid + tables
(needs the whole snapshot) and grid only (reads only its page). Part 2 runs SmolLM2 over one chat workload
as a bare `Run` and under a `Dashboard(fps=15)` (grid, tables, usage, timeline), alternating,
best of `--repeats`; it prints tokens/s, their ratio (aim: overhead <= 10%) and the share of the dashboard run's
wall time spent drawing frames, measured inside the dashboard (robust to a busy machine, where
the end-to-end ratio of two runs is noisy). Outside a kernel the
widgets' messages go nowhere, so part 2 measures the kernel-side cost (snapshot, arrays, widget
state); the browser's rendering runs in another process.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the repo's kernels/, not benchmarks/kernels.py

from benchmarks.harness import best_of, wall_s  # noqa: E402


def _best(fn, repeats: int) -> float:
    """Best wall seconds of one call of ``fn`` over ``repeats`` calls."""
    return best_of([fn], repeats, clock=wall_s)[0][0]


def _filled_manager(num_blocks: int, block_size: int = 16):
    from paged.core import KVCacheManager, Request, RequestStatus
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False, hash_fn="builtin")
    reqs = {}
    per = 16 * block_size
    for i in range(int(0.75 * num_blocks) // 16):
        r = Request(f"r{i}", list(range(i, i + per)), 8)
        r.status = RequestStatus.RUNNING
        kv.allocate_slots(r, per)
        r.num_computed_tokens = per
        reqs[r.request_id] = r
    return kv, reqs


def snapshot_table(sizes=(1 << 10, 1 << 14, 1 << 17), repeats: int = 5):
    import pandas as pd
    import plotly.graph_objects as go

    from paged.viz import figures as F
    rows = []
    for n in sizes:
        kv, reqs = _filled_manager(n)
        snap = kv.snapshot(reqs)
        t_snap = _best(lambda: kv.snapshot(reqs), repeats)
        t_grid = _best(lambda: F.grid_data(snap), repeats)
        t_tab = _best(lambda: F.tables_data(snap, 12), repeats)
        grid = go.FigureWidget(F.block_grid(snap))
        tabs = go.FigureWidget(F.block_tables(snap, 12))

        def frame():
            s = kv.snapshot(reqs)
            g, t = F.grid_data(s), F.tables_data(s, 12)
            with grid.batch_update():
                grid.data[0].z, grid.data[0].text = g["z"], g["text"]
            with tabs.batch_update():
                tabs.data[0].z, tabs.data[0].text, tabs.data[0].customdata = t["z"], t["text"], t["hover"]
        t_frame = _best(frame, repeats)
        r, c = F.grid_shape(n)
        t_page = _best(lambda: kv.snapshot(reqs, block_range=(0, r * c)), repeats)

        def grid_frame():
            g = F.grid_data(kv.snapshot(reqs, block_range=(0, r * c)))
            with grid.batch_update():
                grid.data[0].z, grid.data[0].text = g["z"], g["text"]
        t_gframe = _best(grid_frame, repeats)
        rows.append(dict(blocks=n, requests=len(reqs), snapshot_ms=1e3 * t_snap, page_snapshot_ms=1e3 * t_page,
                         grid_page_ms=1e3 * t_grid, tables_ms=1e3 * t_tab,
                         frame_grid_tables_ms=1e3 * t_frame, frame_grid_only_ms=1e3 * t_gframe))
    return pd.DataFrame(rows).set_index("blocks").round(2)


def throughput_table(num_requests: int = 8, max_tokens: int = 32, repeats: int = 2, fps: float = 15.0):
    import pandas as pd

    import paged
    from paged import runs
    from paged.viz import live
    llm = paged.LLM(num_blocks=96)
    wl = runs.chat_workload(llm.tokenizer, num_requests, n=2, max_tokens=max_tokens, arrive_every=1)
    base = runs.Run(llm, wl)
    results = {"bare Run": [], f"Dashboard at {fps:g} fps": []}
    tokens = {}
    share: list[float] = []
    for _ in range(repeats):  # alternate, so drift in the machine's load hits both
        run = base.fresh()
        t = time.perf_counter()
        run.run_to_completion()
        results["bare Run"].append(time.perf_counter() - t)
        tokens["bare Run"] = sum(r["num_decode_tokens"] + r["num_prefill_tokens"] for r in run.rows)
        run = base.fresh()
        dash = live.Dashboard(run, views=("grid", "tables", "usage", "timeline"), fps=fps)
        t = time.perf_counter()
        dash.run_to_completion()
        key = f"Dashboard at {fps:g} fps"
        results[key].append(time.perf_counter() - t)
        tokens[key] = sum(r["num_decode_tokens"] + r["num_prefill_tokens"] for r in run.rows)
        frames = dash.frames
        share.append(dash.pacer.draw_seconds / results[key][-1])
    rows = []
    for k, times in results.items():
        best = min(times)
        rows.append(dict(config=k, wall_s=best, tokens=tokens[k], tokens_per_s=tokens[k] / best))
    df = pd.DataFrame(rows).set_index("config")
    df["ratio_vs_bare"] = df["tokens_per_s"] / df.loc["bare Run", "tokens_per_s"]
    df["frames"] = [0, frames]
    df["drawing_share_of_wall"] = [0.0, min(share)]  # measured inside the dashboard: robust to machine noise
    return df.round(3)


def page_bytes_table(notebook: str = "02_block_tables_live.ipynb", timeout_s: float = 600.0):
    """Bytes the browser receives over the websockets while JupyterLab runs `notebook` (Run All, small
    parameters), with plotly.js shared by every live plot (one PlotlyLibrary widget per kernel) and with
    one copy per plot (``liveplot.SHARE_PLOTLY = False``, the earlier behaviour), in one run."""
    import json
    import shutil
    import signal
    import socket
    import subprocess
    import tempfile

    import nbformat
    import pandas as pd
    from playwright.sync_api import sync_playwright

    root = os.path.join(os.path.dirname(__file__), "..")
    work = tempfile.mkdtemp(prefix="paged-bytes-")
    shutil.copytree(os.path.join(root, "notebooks"), os.path.join(work, "notebooks"),
                    ignore=shutil.ignore_patterns("outputs", ".ipynb_checkpoints"))
    os.symlink(os.path.abspath(os.path.join(root, "data")), os.path.join(work, "data"))
    nb = nbformat.read(os.path.join(work, "notebooks", notebook), as_version=4)
    variants = {"shared plotly.js": True, "plotly.js per plot": False}
    for label, shared in variants.items():
        copy = nbformat.from_dict(json.loads(json.dumps(nb)))
        copy.cells.insert(0, nbformat.v4.new_code_cell(f"from paged.viz import liveplot\nliveplot.SHARE_PLOTLY = {shared}"))
        nbformat.write(copy, os.path.join(work, "notebooks", f"{label.split()[0]}.ipynb"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PAGED_SMOKE="1", JUPYTER_CONFIG_DIR=os.path.join(work, "jc"),
               JUPYTER_DATA_DIR=os.path.join(work, "jd"), JUPYTER_RUNTIME_DIR=os.path.join(work, "jr"),
               IPYTHONDIR=os.path.join(work, "ipy"), PYTHONPATH=os.path.abspath(root))
    srv = subprocess.Popen([sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
                            "--allow-root", "--IdentityProvider.token=tok", f"--ServerApp.root_dir={work}"],
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    rows = []
    try:
        time.sleep(5)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=[
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
            for label in variants:
                page = browser.new_page(viewport={"width": 1366, "height": 900})
                got = [0]
                page.on("websocket", lambda ws: ws.on("framereceived", lambda f: got.__setitem__(0, got[0] + len(f))))
                page.goto(f"http://127.0.0.1:{port}/lab/tree/notebooks/{label.split()[0]}.ipynb?token=tok",
                          timeout=180_000)
                page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=180_000)
                page.click(".lm-MenuBar-item:has-text('Run')")
                page.click(".lm-Menu-item:has-text('Run All Cells')")
                t0 = time.time()
                time.sleep(5)
                while time.time() - t0 < timeout_s:
                    prompts = page.evaluate("() => Array.from(document.querySelectorAll('.jp-CodeCell .jp-InputPrompt'))"
                                            ".map(e => e.textContent)")
                    if prompts and all(any(ch.isdigit() for ch in x) for x in prompts):
                        break
                    time.sleep(2)
                plots = page.evaluate("() => document.querySelectorAll('.js-plotly-plot').length")
                rows.append(dict(variant=label, live_plots=plots, websocket_mb=got[0] / 2**20))
                page.close()
            browser.close()
    finally:
        os.killpg(srv.pid, signal.SIGTERM)
        shutil.rmtree(work, ignore_errors=True)
    df = pd.DataFrame(rows).set_index("variant")
    df["ratio_vs_per_plot"] = df["websocket_mb"] / df.loc["plotly.js per plot", "websocket_mb"]
    return df.round(3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes (for the smoke test)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--page-bytes", action="store_true",
                    help="also: websocket bytes of notebook 02 in JupyterLab, plotly.js shared vs per plot (chromium)")
    a = ap.parse_args()
    import pandas as pd
    pd.set_option("display.width", 140)
    sizes = (1 << 10, 1 << 14) if a.quick else (1 << 10, 1 << 14, 1 << 17)
    print("snapshot + frame build (ms; best of 5)")
    print(snapshot_table(sizes, 2 if a.quick else 5).to_string())
    print()
    print("SmolLM2 throughput with and without the live dashboard (same workload; best of "
          f"{a.repeats}, alternating)")
    kw = dict(num_requests=3, max_tokens=8) if a.quick else {}
    print(throughput_table(repeats=a.repeats, **kw).to_string())
    if a.page_bytes:
        print()
        print("bytes over the websockets while JupyterLab runs notebook 02 (Run All, small parameters)")
        print(page_bytes_table().to_string())
    np.random.seed(0)


if __name__ == "__main__":
    main()
