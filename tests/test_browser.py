"""A real browser runs every notebook: JupyterLab (Run All, as a lecturer would) and the Voilà dashboard.

What a person sees is checked, not what the kernel says it sent. One JupyterLab server (started as
`make lab` starts it: the same server config and settings) serves a temporary git repository of the
working tree's notebooks; each notebook is opened in Debian's chromium at a laptop's size (1366 x 900),
Run > Run All Cells is clicked, and while it runs and after:

- every plotly plot shows data at some moment, is at least MIN_PLOT_PX tall, and every heatmap gives
  each row at least MIN_ROW_PX pixels;
- no "Error displaying widget" / "Failed to load" / traceback text, and no path of this machine in
  any output;
- a notebook with a live view (a Dashboard, a vLLM ServerView, a SweepView): the window ends on a
  live plot (Run All lands on the show, not on the last cell); with a Dashboard, a plot is redrawn
  while its run goes (live, not replayed) and once the run is over the key-moments timeline is on
  the page with data;
- a notebook with a ReplayView: after the run the replay advances by itself;
- at the end, `git status` of that repository is clean (outputs are never saved into tracked
  notebooks; artefacts go to the ignored notebooks/outputs/).

Voilà (`make dashboard`, progressive rendering) must show notebook 02's first live frame while its
cells are still running. Screenshots mid-run and finished go to ``PAGED_SHOTS=DIR`` when set (the
README's and docs/ pictures come from there). CI installs chromium (``.ci/run``); a missing browser
fails with what to install; ``PAGED_BROWSER=0`` skips on purpose (reported as skipped).

A slow page (about 1.5 min on a 2-core machine): with the browser's CPU throttled 20x, a small live
dashboard's plots must show the kernel's last frames. plotly's FigureWidget came up empty (its 5 MB ESM
missed anywidget's 2-s start-up window); then LivePlot's own models missed it while the page evaluated
plotly.js, and their views kept the opening frame (paged.viz.liveplot: frames now travel on a plain
ipywidgets model). At 12x the old LivePlot failed one run in six here, at 20x four runs in four.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
SOURCE = Path(os.environ.get("PAGED_BROWSER_NOTEBOOKS", ROOT / "notebooks"))  # another folder: for development
NOTEBOOKS = sorted(p.name for p in SOURCE.glob("*.ipynb"))
DEADLINE_S = float(os.environ.get("PAGED_BROWSER_DEADLINE", "420"))  # per notebook
VIEWPORT = {"width": 1366, "height": 900}  # a laptop screen
MIN_PLOT_PX, MIN_ROW_PX = 160, 12
ERROR_TEXTS = ("Error displaying widget", "Failed to load", "Traceback")
MACHINE_PATHS = (str(ROOT), "/tmp/", "/home/", "/root/", "site-packages")

EMPTY = ("null", "[]", "", "[[null]]", "[null]")
# a trace's data as the test compares it (z of heatmaps, else y, else x, ...), shortened
TRACE_DATA = """(t => JSON.stringify(t.z !== undefined ? t.z : t.y !== undefined ? t.y : t.x !== undefined ? t.x
    : t.dimensions !== undefined ? t.dimensions.map(d => d.values) : t.values !== undefined ? t.values
    : t.labels !== undefined ? t.labels : null).slice(0, 20000))"""
# Every plotly plot on the page: its title, rendered height, plot-area height, its traces' types and data,
# and what PAGE_WATCH recorded on it (whether it ever had data; distinct states drawn while a cell ran).
PROBE = """() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(gd => ({
    title: (((gd.layout || {}).title || {}).text || ''),
    height: gd.getBoundingClientRect().height,
    area: ((gd._fullLayout || {})._size || {}).h || 0,
    had: !!gd.__pagedHad, busyStates: gd.__pagedBusy ? gd.__pagedBusy.size : 0,
    traces: (gd.data || []).map(t => ({
        type: t.type || 'scatter',
        rows: t.type === 'heatmap' && Array.isArray(t.z) ? t.z.length : 0,
        data: TRACE_DATA(t)}))}))""".replace("TRACE_DATA", TRACE_DATA)
# The page watching its own plots (an init script, from the page's first script on): every redraw of a plot
# changes the DOM, and a MutationObserver's callback runs after each such change -- no polling interval to
# fall between frames, however busy the machine. On each plot it records whether it ever had data and the
# distinct data states it drew while the notebook's kernel was busy (a cell running; JupyterLab's kernel
# status follows the kernel's own messages, in order with the frames). Then `onState(gd, key)` (a hook).
PAGE_WATCH = """(() => {
  const traceData = TRACE_DATA, empty = new Set(EMPTY);
  const busy = () => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
    const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
    return !!k && k.status === 'busy'; };
  const seen = gd => {
    if (gd.data === gd.__pagedData && gd._fullData === gd.__pagedFull) return;
    gd.__pagedData = gd.data; gd.__pagedFull = gd._fullData;
    const data = (gd.data || []).map(traceData), key = JSON.stringify(data);
    if (data.some(d => !empty.has(d))) gd.__pagedHad = true;
    if (busy()) { gd.__pagedBusy = gd.__pagedBusy || new Set(); if (gd.__pagedBusy.size < 16) gd.__pagedBusy.add(key); }
    if (window.__pagedOnState) window.__pagedOnState(gd, key);
  };
  new MutationObserver(() => document.querySelectorAll('.js-plotly-plot').forEach(seen))
    .observe(document, {subtree: true, childList: true, attributes: true, characterData: true});
})()""".replace("TRACE_DATA", TRACE_DATA).replace("EMPTY", json.dumps(EMPTY))
PLAYERS = """() => Array.from(document.querySelectorAll('.paged-player-label')).map(e => e.textContent)"""
# a live plot inside the window (Run All lands on the show)
LIVE_VIEW_IN_VIEW = """() => Array.from(document.querySelectorAll('.js-plotly-plot'))
    .some(p => { const r = p.getBoundingClientRect(); return r.height > 0 && r.bottom > 120 && r.top < innerHeight - 120; })"""

pytestmark = pytest.mark.skipif(os.environ.get("PAGED_BROWSER") == "0", reason="PAGED_BROWSER=0: browser test off")


def _require_browser() -> None:
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: `apt-get update && apt-get install -y chromium` (.ci/run does it), "
                    "or set PAGED_BROWSER=0 to skip the browser test on purpose", pytrace=False)
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.fail("playwright is missing: `pip install -e .[test]` (never `playwright install`: "
                    f"the test drives {CHROMIUM})", pytrace=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A git repository holding the working tree's notebooks (with the set-up's nbstripout filter)."""
    _require_browser()
    work = tmp_path_factory.mktemp("browser")
    shutil.copytree(SOURCE, work / "notebooks", ignore=shutil.ignore_patterns(".ipynb_checkpoints", "outputs"))
    for name in (".gitignore", ".gitattributes"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, work / name)
    if (ROOT / "data").is_dir():
        (work / "data").symlink_to(ROOT / "data")
    _git(work, "init", "-q")
    _git(work, "add", "-A")
    _git(work, "commit", "-qm", "notebooks")
    subprocess.run([str(ROOT / "scripts" / "install_nbfilter.sh"), sys.executable], cwd=work, check=True)
    return work


def _serve(work: Path, argv: list[str], port: int) -> subprocess.Popen:
    env = dict(os.environ, PAGED_SMOKE="1", OMP_NUM_THREADS="1", IPYTHONDIR=str(work / ".ipython"),
               JUPYTER_CONFIG_DIR=str(work / ".jconfig"), JUPYTER_DATA_DIR=str(work / ".jdata"),
               JUPYTER_RUNTIME_DIR=str(work / ".jruntime"), MPLCONFIGDIR=str(work / ".mpl"),
               TRITON_CACHE_DIR=str(ROOT / ".cache" / "triton"))
    # no "get notified about Jupyter news?" pop-up over the page (`make install` writes the same setting)
    (work / ".jconfig" / "labconfig").mkdir(parents=True, exist_ok=True)
    (work / ".jconfig" / "labconfig" / "page_config.json").write_text(
        json.dumps({"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True},
                    "exposeAppInBrowser": True}))  # window.jupyterapp: the test reads the notebook's kernel
    log = open(work / f".server-{port}.log", "w")
    srv = subprocess.Popen(argv, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    t0 = time.time()
    while time.time() - t0 < 120:
        if srv.poll() is not None:
            raise AssertionError(f"server exited with {srv.returncode}: {(work / f'.server-{port}.log').read_text()[-3000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), 1).close()
            return srv
        except OSError:
            time.sleep(0.5)
    _stop(srv)
    raise AssertionError(f"server did not listen on 127.0.0.1:{port} within 120 s")


def _stop(srv: subprocess.Popen) -> None:
    try:
        os.killpg(srv.pid, signal.SIGTERM)
        srv.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(srv.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def lab(workdir: Path) -> Iterator[tuple[int, str]]:
    """One JupyterLab for every notebook, started with `make lab`'s server settings."""
    port, token = _free_port(), os.urandom(12).hex()
    srv = _serve(workdir, [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
                           "--allow-root", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={workdir}",
                           f"--config={ROOT / 'jupyter' / 'jupyter_server_config.py'}",
                           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"], port)
    yield port, token
    _stop(srv)


def _shot(page, name: str) -> None:
    shots = os.environ.get("PAGED_SHOTS")
    if shots:
        os.makedirs(shots, exist_ok=True)
        page.screenshot(path=os.path.join(shots, name))


# the page's signal that Run All took: a code cell is running or has run, or a dialog opened instead
RUN_STARTED = """() => document.querySelector('.jp-Dialog') !== null ||
    Array.from(document.querySelectorAll('.jp-CodeCell .jp-InputPrompt'))
        .some(e => e.textContent.includes('*') || /[0-9]/.test(e.textContent))"""


def _started(page) -> bool:
    """Some code cell is running or has run (its prompt shows '*' or a number)."""
    prompts = page.evaluate("() => Array.from(document.querySelectorAll('.jp-CodeCell .jp-InputPrompt'))"
                            ".map(e => e.textContent)")
    return any("*" in p or any(ch.isdigit() for ch in p) for p in prompts)


def _api(port: int, token: str, path: str, method: str = "GET", body: dict | None = None):
    """One call of the Jupyter server's REST API (JSON in, JSON out)."""
    import urllib.request
    req = urllib.request.Request(f"http://127.0.0.1:{port}/api/{path}?token={token}", method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        text = r.read()
    return json.loads(text) if text else None


def _sessions_of(port: int, token: str, name: str) -> list[dict]:
    return [s for s in _api(port, token, "sessions") if s["path"] == f"notebooks/{name}"]


def _one_session(port: int, token: str, name: str) -> str | None:
    """None when notebook `name` has exactly one kernel session, else what the server holds for it."""
    found = _sessions_of(port, token, name)
    if len(found) == 1:
        return None
    return f"{len(found)} kernel sessions for notebooks/{name} (exactly one expected): " + \
        json.dumps([{"id": s["id"], "kernel": s["kernel"]["id"], "state": s["kernel"].get("execution_state")}
                    for s in found])


def _open(page, port: int, token: str, name: str) -> None:
    """Open notebook `name` in a workspace of its own, ready to run: its cells drawn, its one kernel idle.

    The kernel session is made first, through the server's REST API, and the page then opens the notebook:
    JupyterLab finds the session by the notebook's path and connects to it, so the page never starts a
    kernel of its own. (Left to the page, a busy machine sometimes gave a notebook TWO sessions -- the page's
    start raced a second one, a "Select Kernel" dialog took the default -- and Run All then waited for ever
    on the kernel that was not the one the cells were sent to: 00 and 08 did not finish in 420 s.)
    Not `/lab/tree/...?reset`: that reloads the page after it has started a session (the same race)."""
    kernel = json.loads((SOURCE / name).read_text() if (SOURCE / name).exists() else "{}") \
        .get("metadata", {}).get("kernelspec", {}).get("name", "python3")
    assert not _sessions_of(port, token, name), f"{name}: a kernel session is left over from before"
    session = _api(port, token, "sessions", "POST",
                   {"path": f"notebooks/{name}", "name": name, "type": "notebook", "kernel": {"name": kernel}})
    workspace = f"t{os.urandom(6).hex()}"
    page.goto(f"http://127.0.0.1:{port}/lab/workspaces/{workspace}/tree/notebooks/{name}?token={token}",
              timeout=120_000)
    page.wait_for_selector(".jp-Notebook .jp-CodeCell", timeout=120_000)
    # not the toolbar's execution indicator: it reads 'idle' before any kernel is connected, and a Run All
    # clicked then asks "Select Kernel" (taking its default started the second kernel)
    # the id the page showed when it was ready (evaluating KERNEL_READY again races the kernel's next
    # status: it read None once, 'busy' a moment after 'idle', on a busy machine)
    shown = page.wait_for_function(KERNEL_READY, timeout=120_000, polling=250).json_value()
    assert shown == session["kernel"]["id"], \
        f"{name}: the page is on kernel {shown}, not the session's {session['kernel']['id']}"
    two = _one_session(port, token, name)
    assert two is None, f"{name}: on opening, {two}"


# the page's own state (JupyterLab's app, exposed by the test's page_config): the id of the open notebook's
# kernel once its session is ready, the kernel connected and idle; else null
KERNEL_READY = """() => {
    const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
    const sc = w && w.sessionContext, k = sc && sc.session && sc.session.kernel;
    return sc && sc.isReady && k && k.connectionStatus === 'connected' && k.status === 'idle' ? k.id : null; }"""


def _kernel_lost(page) -> str | None:
    """The page's own sign that the notebook has no live kernel (then no cell will ever finish)."""
    status = page.evaluate("() => (document.querySelector('.jp-Notebook-ExecutionIndicator') || {}).dataset?.status")
    if status in ("dead", "terminating", "disconnected"):
        return f"the kernel is {status}"
    if page.locator(".jp-Dialog:has-text('Select Kernel')").count():
        return "JupyterLab asks to select a kernel (the notebook lost its kernel)"
    return None


def _settled(page, most_s: float = 60) -> None:
    """Until the page's plots hold still: two probes a second apart the same (frames in flight drawn)."""
    last, t0 = None, time.time()
    while time.time() - t0 < most_s:
        now = json.dumps(page.evaluate(PROBE))
        if now == last:
            return
        last = now
        time.sleep(1)


def _run_all(page, tries: int = 4) -> None:
    """Run > Run All Cells, as a person would, once the page shows the kernel idle (see `_open`). A click
    that the menu swallowed (no cell started) is retried; a dialog (a "Select Kernel" would start a second
    kernel) fails at once with its text."""
    for _ in range(tries):
        page.click(".lm-MenuBar-item:has-text('Run')", timeout=30_000)
        page.click(".lm-Menu-item:has-text('Run All Cells')", timeout=30_000)
        try:
            page.wait_for_function(RUN_STARTED, timeout=20_000, polling=250)
        except Exception as e:  # noqa: BLE001 - playwright's TimeoutError
            if "Timeout" not in type(e).__name__:
                raise
        if page.locator(".jp-Dialog").count():
            raise AssertionError(f"Run All Cells opened a dialog: {page.inner_text('.jp-Dialog')[:500]!r}")
        if _started(page):
            return
    raise AssertionError(f"Run > Run All Cells started no cell in {tries} tries")


def _all_cells_ran(page) -> bool:
    """Every code cell of the open notebook shows an execution count (none waiting or running)."""
    prompts = page.evaluate("() => Array.from(document.querySelectorAll('.jp-CodeCell .jp-InputPrompt'))"
                            ".map(e => e.textContent.trim())")
    return bool(prompts) and all(p[1:-1].strip().isdigit() for p in (x.replace(":", "") for x in prompts))


def _stuck(page, work: Path, port: int) -> str:
    """Why cells did not finish, for the failure message: the prompts (' ', '*' or a count per code cell)
    and the end of the server's log (a kernel that died or restarted says so there)."""
    prompts = page.evaluate("() => Array.from(document.querySelectorAll('.jp-CodeCell .jp-InputPrompt'))"
                            ".map(e => e.textContent.trim())")
    log = work / f".server-{port}.log"
    tail = log.read_text(errors="replace")[-1500:] if log.exists() else "(no server log)"
    return f"prompts {prompts}; server log ends:\n{tail}"


class Watch:
    """What the page showed: per plot (in page order) whether it had data at some moment and the most
    distinct states one plot drew while a cell ran (both as PAGE_WATCH recorded them on the page, at every
    redraw), and the size checks of every sample."""

    def __init__(self) -> None:
        self.had_data: list[bool] = []
        self.most_states = 0  # >= 2: a plot was redrawn while the run went
        self.small: dict[str, str] = {}
        self.plots: list = []

    def sample(self, page, label: str) -> None:
        self.plots = plots = page.evaluate(PROBE)
        self.had_data += [False] * (len(plots) - len(self.had_data))
        for i, p in enumerate(plots):
            has = any(t["data"] not in EMPTY for t in p["traces"])
            self.had_data[i] = self.had_data[i] or has or p["had"]
            self.most_states = max(self.most_states, p["busyStates"])
            if has and p["height"] < MIN_PLOT_PX:
                self.small[p["title"][:60]] = f"{p['height']:.0f} px tall"
            rows = max((t["rows"] for t in p["traces"]), default=0)
            if has and rows and p["area"] / rows < MIN_ROW_PX:
                self.small[p["title"][:60]] = f"{p['area'] / rows:.1f} px per heatmap row ({rows} rows)"
        text = page.inner_text("body")
        bad = [m for m in ERROR_TEXTS if m in text]
        assert not bad, f"{label}: the page shows {bad}:\n{text[-3000:]}"
        paths = [m for m in MACHINE_PATHS if m in text]
        assert not paths, f"{label}: the page shows a path of this machine ({paths}): " \
                          f"{text[max(0, text.find(paths[0]) - 200):text.find(paths[0]) + 200]}"


def _player_values(page) -> list[int]:
    return [int(m.group(1)) for s in page.evaluate(PLAYERS) if (m := re.search(r"(\d+) /", s))]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_in_lab(name: str, lab: tuple[int, str], workdir: Path, browser) -> None:
    port, token = lab
    source = (workdir / "notebooks" / name).read_text()
    has_dashboard, has_replay = "Dashboard(" in source, "ReplayView(" in source
    has_live_view = has_dashboard or "ServerView(" in source or "SweepView(" in source
    page = browser.new_page(viewport=VIEWPORT)
    page.add_init_script(PAGE_WATCH)
    try:
        _open(page, port, token, name)
        _run_all(page)
        watch, stem = Watch(), name.removesuffix(".ipynb")
        t0, mid_shot = time.time(), False
        while time.time() - t0 < DEADLINE_S:
            time.sleep(0.5)
            watch.sample(page, name)
            if not mid_shot and watch.most_states >= 2 and not _all_cells_ran(page):
                _shot(page, f"{stem}-mid.png")
                mid_shot = True
            if _all_cells_ran(page):
                break
            lost = _kernel_lost(page) or _one_session(port, token, name)
            assert lost is None, f"{name}: {lost}; {_stuck(page, workdir, port)}"
        assert _all_cells_ran(page), \
            f"{name}: not every cell ran within {DEADLINE_S:.0f} s; {_stuck(page, workdir, port)}"
        t_ran = time.time()
        _settled(page)  # the last frames on their way
        watch.sample(page, name)
        if not mid_shot:
            _shot(page, f"{stem}-mid.png")
        assert watch.plots, f"{name}: no plotly plot on the page"
        empty = [watch.plots[i]["title"][:60] or i for i, ok in enumerate(watch.had_data) if not ok]
        assert not empty, f"{name}: plots never showed data: {empty}"
        assert not watch.small, f"{name}: plots too small to read: {watch.small}"
        if has_dashboard:
            assert watch.most_states >= 2, f"{name}: no plot was redrawn while the run went (the view is not live)"
        if has_live_view:
            assert page.evaluate(LIVE_VIEW_IN_VIEW), f"{name}: after Run All the window shows no live view"
        if has_dashboard:
            moments = [p for p in watch.plots if p["title"].startswith("key moments of the run")]
            assert moments and (moments[0]["had"] or any(t["data"] not in EMPTY for t in moments[0]["traces"])), \
                f"{name}: no key-moments timeline after the run"
        if has_replay:
            before = after = _player_values(page)
            t_replay = time.time()
            while after == before and time.time() - t_replay < 30:  # it advances every few hundred ms
                time.sleep(0.5)
                after = _player_values(page)
            assert before and any(a != b for a, b in zip(after, before)), \
                f"{name}: the replay does not advance by itself after the run ({before} -> {after})"
        _shot(page, f"{stem}-end.png")
        _save(page, name)
        print(f"{name}: cells ran in {t_ran - t0:.0f} s; most states one plot drew while cells ran: "
              f"{watch.most_states}")
    finally:
        page.close()
        _shut_down_kernels(port, token)  # one notebook's kernel at a time (each holds a model)


# File > Save, as a person would (Ctrl+S runs the same command); the page records when the server has
# answered and whether the notebook is still unsaved
SAVE = """() => { window.__pagedSaved = null;
    window.jupyterapp.commands.execute('docmanager:save').then(
        () => { window.__pagedSaved = {dirty: window.jupyterapp.shell.currentWidget.context.model.dirty}; },
        e => { window.__pagedSaved = {error: String(e)}; }); }"""


def _save(page, name: str) -> None:
    """The notebook, outputs and all, saved through the page; returns once the server has the file (the
    page's own promise, not a pause). Every notebook is saved, so the git-status check covers each one."""
    page.evaluate(SAVE)
    try:
        page.wait_for_function("() => window.__pagedSaved !== null", timeout=60_000, polling=100)
    except Exception as e:  # noqa: BLE001 - playwright's TimeoutError
        dialog = page.inner_text(".jp-Dialog")[:500] if page.locator(".jp-Dialog").count() else "no dialog"
        raise AssertionError(f"{name}: File > Save did not finish within 60 s ({dialog!r})") from e
    saved = page.evaluate("() => window.__pagedSaved")
    assert saved == {"dirty": False}, f"{name}: File > Save: {saved}"


def _shut_down_kernels(port: int, token: str) -> None:
    """Every kernel session ends (DELETE), and the server lists none before the next notebook opens."""
    for s in _api(port, token, "sessions"):
        _api(port, token, f"sessions/{s['id']}", "DELETE")
    t0 = time.time()
    while _api(port, token, "kernels"):
        assert time.time() - t0 < 60, f"kernels still running 60 s after their sessions ended: {_api(port, token, 'kernels')}"
        time.sleep(0.5)


def test_git_status_is_clean_after_every_notebook_ran(workdir: Path, lab) -> None:
    """Runs after the notebooks above (same module, file order), each saved with its outputs once it ran
    (`_save` waits for the server's answer): JupyterLab's saves kept outputs out of the tracked notebooks
    and the artefacts went to the ignored folder."""
    changed = _git(workdir, "status", "--porcelain", "--", "notebooks")
    assert changed == "", f"saving changed tracked notebooks:\n{changed}{_git(workdir, 'diff', '--', 'notebooks')[:3000]}"


def test_voila_shows_the_first_live_frame_while_cells_run(workdir: Path, browser) -> None:
    """`make dashboard`'s Voilà: progressive rendering and the `paged` template (prose reduced to the title
    and question, so the dashboard is near the top): a live frame of 02 while its cells still run."""
    port, token = _free_port(), os.urandom(12).hex()
    os.environ["JUPYTER_PATH"] = str(ROOT / "jupyter")  # the template, as the Makefile exports it
    try:
        srv = _serve(workdir, [sys.executable, "-m", "voila", "notebooks", "--no-browser", "--Voila.ip=127.0.0.1",
                               f"--port={port}", f"--token={token}", "--strip_sources=True", "--show_tracebacks=True",
                               "--template=paged", "--VoilaConfiguration.progressive_rendering=True"], port)
    finally:
        del os.environ["JUPYTER_PATH"]
    name = "02_block_tables_live.ipynb"
    last_output = "saved outputs/02_block_tables"  # what 02's last code cell prints
    try:
        page = browser.new_page(viewport=VIEWPORT)
        # the page watches itself (at every redraw, from its first script on): the moment its pool grid shows
        # a second state, and whether 02's last output was on the page by then -- no race with a 1-s poll
        page.add_init_script(VOILA_WATCH.replace("LAST_OUTPUT", json.dumps(last_output)))
        page.add_init_script(PAGE_WATCH)
        t0 = time.time()
        page.goto(f"http://127.0.0.1:{port}/voila/render/{name}?token={token}", timeout=120_000, wait_until="commit")
        watch, seen = Watch(), None
        while time.time() - t0 < DEADLINE_S:
            time.sleep(1.0)
            try:
                watch.sample(page, "Voila")
                seen = page.evaluate("() => window.__pagedLive && window.__pagedLive.at !== null ? window.__pagedLive : null")
            except Exception as e:  # noqa: BLE001 - the page may still be loading
                if "Execution context was destroyed" in str(e):
                    continue
                raise
            if seen is not None:
                break
        assert seen is not None, f"Voila: no live frame of 02 within {DEADLINE_S:.0f} s"
        live_at = seen["at"] / 1000
        assert not seen["done"], "Voila showed the run only after every cell ran"
        assert seen["top"] is not None, "Voila: a live grid but no dashboard (no 'reset' button) on the page"
        assert seen["top"] < 700, f"Voila: the dashboard starts {seen['top']:.0f} px down the page"
        _shot(page, "voila-02-mid.png")
        print(f"Voila: first live frame {live_at:.1f} s after opening the page")
        page.close()
    finally:
        _stop(srv)


# Voila's page watching itself (a hook of PAGE_WATCH, called at each plot's redraw): when the pool grid first
# shows a second state, whether the last cell's output was already on the page and where the dashboard (its
# 'reset' button) starts
VOILA_WATCH = """(() => {
  const live = window.__pagedLive = {at: null, done: null, top: null};
  const states = new Set();
  window.__pagedOnState = gd => {
    if (live.at !== null || !String(((gd.layout || {}).title || {}).text || '').includes('pool')) return;
    for (const t of gd.data || []) if (t.type === 'heatmap') states.add(JSON.stringify(t.z));
    if (states.size < 2) return;
    live.done = document.body.innerText.includes(LAST_OUTPUT);
    const tops = Array.from(document.querySelectorAll('button')).filter(b => b.textContent.includes('reset'))
      .map(b => b.getBoundingClientRect().top + scrollY);
    live.top = tops.length ? Math.min(...tops) : null;
    live.at = performance.now();
  };
})()"""

SLOW_PAGE = "_slow_page.ipynb"
SLOW_RATE = 20  # Chrome's CPU throttling: the page's JavaScript runs 20x slower (a weak laptop, a busy tab)
SLOW_CELLS = [  # the live dashboard over the simulator (no model to load): whatever plots the dashboard uses
    "from paged import runs\nfrom paged.sim.simulator import SimConfig\nfrom paged.sim.workload import synthetic_trace\n"
    "from paged.viz import live\n"
    "run = runs.Run(SimConfig(model='llama-2-7b', num_blocks=64), synthetic_trace('sharegpt', 8, rate=4.0, trace_seed=0))\n"
    "dash = live.Dashboard(run, views=('grid',), steps_per_second=60)\ndash",
    "dash.run_to_completion()",
    # the titles of the kernel's last frames: the pool (at its peak once the run is over) and the key moments
    "import json\nprint('FINAL', json.dumps([[p.layout.title.text, p.layout.title.subtitle.text]\n"
    "                                   for p in (dash.figures['grid'], dash.story.figure)]))",
]
SLOW_PROBE = """() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(gd => {
    const t = (gd.layout || {}).title || {};
    return [JSON.stringify((gd.data || []).map(t => t.z)), [t.text ?? null, (t.subtitle || {}).text ?? null]]; })"""
SLOW_FINAL = """() => Array.from(document.querySelectorAll('.jp-OutputArea-output'))
    .map(e => e.textContent.trim()).filter(t => t.startsWith('FINAL '))"""


def test_live_plot_survives_a_slow_page(lab: tuple[int, str], workdir: Path, browser) -> None:
    """With the page's CPU throttled SLOW_RATE x from before the run starts, the live plots show data and,
    once the run is over, the kernel's last frames (365 steps at 60 steps/s, frames at <= 15/s)."""
    import nbformat
    port, token = lab
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in SLOW_CELLS])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nbformat.write(nb, workdir / "notebooks" / SLOW_PAGE)
    page = browser.new_page(viewport={"width": 1000, "height": 900})
    errors: list[str] = []  # the page's errors and warnings ("[anywidget] Failed to initialize model.")
    page.on("console", lambda m: errors.append(f"{m.type}: {m.text[:300]}") if m.type in ("error", "warning") else None)
    page.on("pageerror", lambda e: errors.append(str(e)[:300]))
    t0 = time.time()
    try:
        _open(page, port, token, SLOW_PAGE)
        cdp = page.context.new_cdp_session(page)
        cdp.send("Emulation.setCPUThrottlingRate", {"rate": SLOW_RATE})
        t_load = time.time()
        _run_all(page)
        while time.time() - t_load < DEADLINE_S and not _all_cells_ran(page):
            lost = _kernel_lost(page) or _one_session(port, token, SLOW_PAGE)
            assert lost is None, f"slow page: {lost}; {_stuck(page, workdir, port)}"
            time.sleep(2)
        t_ran = time.time()
        assert _all_cells_ran(page), \
            f"slow page: not every cell ran within {DEADLINE_S:.0f} s; {_stuck(page, workdir, port)}"
        final = [json.loads(t.removeprefix("FINAL ")) for t in page.evaluate(SLOW_FINAL)]
        plots: list = []
        for _ in range(30):  # the last frame may still be on its way (still throttled: no help from us)
            plots = page.evaluate(SLOW_PROBE)
            if final and [t for _, t in plots] == final[0]:
                break
            time.sleep(1)
        cdp.send("Emulation.setCPUThrottlingRate", {"rate": 1})
        _shot(page, "lab-slow-page.png")
        print(f"slow page: loaded in {t_load - t0:.0f} s, cells ran in {t_ran - t_load:.0f} s, "
              f"last frame {time.time() - t_ran:.0f} s later; console: {errors[:5]}")
    finally:
        page.close()
        (workdir / "notebooks" / SLOW_PAGE).unlink()
        _shut_down_kernels(port, token)
    assert final, "slow page: the kernel's last title was not printed"
    assert plots, "slow page: no plot at all"
    assert plots[0][0] not in EMPTY and plots[0][0] != "[]", f"slow page: the live plot came up empty: {plots}"
    shown = [t for _, t in plots]
    assert shown == final[0], f"slow page: the plots never showed the last frames {final[0]!r}: {shown!r}; " \
                              f"console: {errors[:40]}"
