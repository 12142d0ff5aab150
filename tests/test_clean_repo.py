"""After the notebooks ran, `git status` is clean: outputs never reach git (nbstripout as a clean
filter, installed by the set-up) and artefacts go to an ignored folder (notebooks/outputs/)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def test_running_a_notebook_leaves_git_status_clean(tmp_path: Path) -> None:
    import nbformat
    from nbclient import NotebookClient

    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    subprocess.run([str(ROOT / "scripts" / "install_nbfilter.sh"), sys.executable], cwd=clone, check=True)
    path = clone / "notebooks" / "02_block_tables_live.ipynb"
    before = path.stat().st_size
    nb = nbformat.read(path, as_version=4)
    env = dict(os.environ, PAGED_SMOKE="1", OMP_NUM_THREADS="1", IPYTHONDIR=str(tmp_path / "ipy"),
               JUPYTER_RUNTIME_DIR=str(tmp_path / "jr"))
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute(env=env)
    nbformat.write(nb, path)  # what JupyterLab's autosave does
    assert path.stat().st_size > 4 * before, "the notebook should now hold its outputs"
    assert (clone / "notebooks" / "outputs" / "02_block_tables.npz").exists()
    assert _git(clone, "status", "--porcelain") == ""
    assert _git(clone, "diff", "--stat") == ""
