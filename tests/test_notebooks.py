"""Every notebook executes headless, top to bottom, without an error (nbclient, ``PAGED_SMOKE=1``).

Each notebook is its own test case. The kernel is the interpreter running pytest (the venv's
ipykernel), started with IPython and Jupyter directories in a temporary folder and one OpenMP
thread; the notebook runs from a copy inside ``notebooks/``'s temporary twin (``data/`` linked),
so relative paths resolve as they do in JupyterLab and the repository's files stay output-free.
Every output is also checked: plotly figures pass ``tests/figure_check.py.figure_problems`` (heights, rows,
integer count axes, labels) and no output shows a path of this machine. Also checked: the layout rules of CONTRACT (a ``parameters`` cell that reads PAGED_SMOKE, no
committed outputs, no function definitions in code cells, a "Try this" ending).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
TIMEOUT_S = int(os.environ.get("PAGED_NOTEBOOK_TIMEOUT", "300"))  # per cell


def _kernel_env(tmp: Path) -> dict[str, str]:
    env = {
        "PAGED_SMOKE": "1", "OMP_NUM_THREADS": "1", "IPYTHONDIR": str(tmp / "ipython"),
        "JUPYTER_CONFIG_DIR": str(tmp / "jconfig"), "JUPYTER_DATA_DIR": str(tmp / "jdata"),
        "JUPYTER_RUNTIME_DIR": str(tmp / "jruntime"), "MPLCONFIGDIR": str(tmp / "mpl"),
        "TRITON_CACHE_DIR": os.environ.get("TRITON_CACHE_DIR", str(ROOT / ".cache" / "triton")),
    }
    return env


def test_there_are_notebooks() -> None:
    assert NOTEBOOKS, f"no notebooks in {ROOT / 'notebooks'}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_layout(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    params = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1, f"{path.name}: needs exactly one code cell tagged 'parameters', found {len(params)}"
    assert "PAGED_SMOKE" in params[0].source, f"{path.name}: the parameters cell must read PAGED_SMOKE"
    with_outputs = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not with_outputs, f"{path.name}: cells {with_outputs} have committed outputs; clear them"
    defs = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"
            and any(line.lstrip().startswith(("def ", "async def ", "class ")) for line in c.source.splitlines())]
    assert not defs, f"{path.name}: cells {defs} define functions or classes; move them into the package"
    last_md = [c for c in nb.cells if c.cell_type == "markdown"][-1].source.lower()
    assert "try this" in last_md, f"{path.name}: end with a 'Try this' markdown cell"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path: Path, tmp_path: Path) -> None:
    from nbclient import NotebookClient

    work = tmp_path / "notebooks"
    work.mkdir()
    if (ROOT / "data").is_dir():
        (tmp_path / "data").symlink_to(ROOT / "data")
    shutil.copy(path, work / path.name)
    nb = nbformat.read(work / path.name, as_version=4)
    env = _kernel_env(tmp_path)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits the environment of its manager
    try:
        client = NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3", allow_errors=False,
                                resources={"metadata": {"path": str(work)}})
        km = client.create_kernel_manager()
        # "python3" is the venv's own ipykernel spec; jupyter_client launches its "python" as sys.executable
        spec = km.kernel_spec
        assert spec.resource_dir.startswith(sys.prefix) and spec.argv[0] in ("python", sys.executable), \
            f"kernel python3 is {spec.resource_dir} {spec.argv}, not this venv's ipykernel"
        t0 = time.perf_counter()
        client.execute()
        took = time.perf_counter() - t0
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    print(f"{path.name}: executed in {took:.1f} s; slowest cells: {_slowest(nb)}")
    problems = _output_problems(nb)
    assert not problems, f"{path.name}: " + "; ".join(problems)


def _output_problems(nb) -> list[str]:
    """Unreadable figures (tests/figure_check.py) and paths of this machine in any output of an executed notebook."""
    from figure_check import figure_problems, output_problems
    out = []
    for i, c in enumerate(nb.cells):
        for o in c.get("outputs", []) if c.cell_type == "code" else []:
            data = o.get("data", {})
            fig = data.get("application/vnd.plotly.v1+json")
            if fig is not None:
                out += [f"cell {i}: {p}" for p in figure_problems(fig)]
            text = "".join(o.get("text", "")) + "".join(str(data.get(k, "")) for k in ("text/plain", "text/html",
                                                                                     "text/markdown"))
            out += [f"cell {i}: {p}" for p in output_problems(text)]
    return out


def _slowest(nb, n: int = 3) -> str:
    """The ``n`` slowest code cells as 'index: seconds' (nbclient records start/end stamps)."""
    from datetime import datetime

    times = []
    for i, c in enumerate(nb.cells):
        ex = c.get("metadata", {}).get("execution", {})
        a, b = ex.get("iopub.execute_input"), ex.get("shell.execute_reply")
        if a and b:
            times.append(((datetime.fromisoformat(b.replace("Z", "+00:00"))
                           - datetime.fromisoformat(a.replace("Z", "+00:00"))).total_seconds(), i))
    return ", ".join(f"cell {i}: {t:.1f} s" for t, i in sorted(times, reverse=True)[:n])
