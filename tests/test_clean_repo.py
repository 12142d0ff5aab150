"""After the notebooks ran, `git status` is clean.

Two mechanisms, both from nbstripout: `make lab` saves (and autosaves) git-tracked notebooks without
outputs (jupyter/jupyter_server_config.py, a pre-save hook), and the set-up installs nbstripout as
a git clean filter, so outputs written by any other editor never reach a commit. Artefacts go to
notebooks/outputs/, which git ignores. The browser test runs every notebook in JupyterLab under the
same settings and checks `git status` at the end; here the two mechanisms are checked on their own.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = "02_block_tables_live.ipynb"


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def _repo(tmp: Path) -> Path:
    """A git repository of the working tree's notebooks and .gitignore, with the set-up's filter."""
    repo = tmp / "repo"
    shutil.copytree(ROOT / "notebooks", repo / "notebooks", ignore=shutil.ignore_patterns("outputs", ".ipynb_*"))
    for name in (".gitignore", ".gitattributes"):
        shutil.copy(ROOT / name, repo / name)
    _git(repo.parent, "init", "-q", str(repo))
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "notebooks")
    subprocess.run([str(ROOT / "scripts" / "install_nbfilter.sh"), sys.executable], cwd=repo, check=True)
    return repo


def _with_outputs(path: Path) -> dict:
    """The notebook as JupyterLab saves it after a run: outputs, counts, and the kernel's language details."""
    nb = json.loads(path.read_text())
    nb["metadata"]["language_info"] = {"codemirror_mode": {"name": "ipython", "version": 3}, "file_extension": ".py",
                                       "mimetype": "text/x-python", "name": "python", "nbconvert_exporter": "python",
                                       "pygments_lexer": "ipython3", "version": "3.11.7"}
    for i, c in enumerate(x for x in nb["cells"] if x["cell_type"] == "code"):
        c["execution_count"] = i + 1
        c["outputs"] = [{"output_type": "stream", "name": "stdout", "text": [f"output of cell {i}\n" * 50]}]
    return nb


def test_lab_saves_tracked_notebooks_without_outputs(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp_path / "jc"), JUPYTER_DATA_DIR=str(tmp_path / "jd"),
               JUPYTER_RUNTIME_DIR=str(tmp_path / "jr"), IPYTHONDIR=str(tmp_path / "ipy"))
    srv = subprocess.Popen([sys.executable, "-m", "jupyter_server", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
                            "--allow-root", "--IdentityProvider.token=tok", f"--ServerApp.root_dir={repo / 'notebooks'}",
                            f"--config={ROOT / 'jupyter' / 'jupyter_server_config.py'}"],
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        def put(name: str, nb: dict) -> None:
            body = json.dumps({"type": "notebook", "format": "json", "content": nb}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/api/contents/{name}?token=tok", data=body,
                                         method="PUT", headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                assert r.status in (200, 201)

        deadline = time.time() + 120
        while True:
            try:
                put(NOTEBOOK, _with_outputs(repo / "notebooks" / NOTEBOOK))  # what Lab's (auto)save sends
                break
            except OSError:
                assert srv.poll() is None and time.time() < deadline, "jupyter_server did not come up"
                time.sleep(1)
        put("mine.ipynb", _with_outputs(repo / "notebooks" / NOTEBOOK))  # a notebook of your own
    finally:
        os.killpg(srv.pid, signal.SIGTERM)
        srv.wait(timeout=30)
    assert (repo / "notebooks" / NOTEBOOK).read_text() == _git(repo, "show", f"HEAD:notebooks/{NOTEBOOK}")  # byte for byte
    saved = json.loads((repo / "notebooks" / NOTEBOOK).read_text())
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in saved["cells"]
               if c["cell_type"] == "code")
    mine = json.loads((repo / "notebooks" / "mine.ipynb").read_text())
    assert any(c.get("outputs") for c in mine["cells"] if c["cell_type"] == "code")  # yours keep their outputs
    assert _git(repo, "status", "--porcelain") == "?? notebooks/mine.ipynb\n"


def test_outputs_written_by_another_editor_never_reach_git(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    path = repo / "notebooks" / NOTEBOOK
    path.write_text(json.dumps(_with_outputs(path), indent=1))
    (repo / "notebooks" / "outputs").mkdir()
    (repo / "notebooks" / "outputs" / "02_block_tables.npz").write_bytes(b"artefact")
    assert _git(repo, "diff") == ""  # the filter cleans what git compares
    _git(repo, "add", "-A")
    assert _git(repo, "diff", "--cached", "--stat") == ""  # nothing to commit: no outputs, no artefacts
    assert _git(repo, "status", "--porcelain") == ""
