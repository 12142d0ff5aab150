"""`make lab` / `make dashboard` print the URL they really serve, even when the default port is busy,
and refuse a busy port the user chose with a message that says what to do."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAMP = ".venv/.installed"


def _hold(port: int) -> socket.socket | None:
    """Occupy 127.0.0.1:port (None if something else already does: busy either way)."""
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
        s.listen()
        return s
    except OSError:
        s.close()
        return None


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LAB_PORT", "DASHBOARD_PORT", "MAKEFLAGS", "MFLAGS")}
    env.update(JUPYTER_CONFIG_DIR=str(tmp / "jc"), JUPYTER_DATA_DIR=str(tmp / "jd"), JUPYTER_RUNTIME_DIR=str(tmp / "jr"),
               IPYTHONDIR=str(tmp / "ipy"), LAB_TOKEN="t0ken", **extra)
    return env


def _serve_and_fetch(target: str, default_port: int, path: str, tmp: Path) -> int:
    held = _hold(default_port)
    # -o STAMP: use the venv as it is (never reinstall from inside a test)
    proc = subprocess.Popen(["make", "-s", "-o", STAMP, target], cwd=ROOT, env=_env(tmp), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        line = ""
        t0 = time.time()
        while time.time() - t0 < 60 and "http://" not in line:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, f"make {target} exited: {proc.returncode}"
        m = re.search(r"http://127\.0\.0\.1:(\d+)/\S*token=t0ken", line)
        assert m, f"make {target} printed no URL: {line!r}"
        port = int(m.group(1))
        assert port != default_port, f"{target}: printed the busy port {default_port}"
        deadline = time.time() + 180
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}?token=t0ken", timeout=5) as r:
                    assert r.status == 200
                    return port
            except OSError:
                assert proc.poll() is None, f"make {target} exited with {proc.returncode} before serving"
                assert time.time() < deadline, f"nothing served at the printed URL (port {port}) in 180 s"
                time.sleep(1)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        if held is not None:
            held.close()


@pytest.mark.parametrize("target,port,path", [("lab", 8888, "/api/status"), ("dashboard", 8866, "/")])
def test_busy_default_port_moves_and_the_printed_url_works(target: str, port: int, path: str, tmp_path: Path) -> None:
    _serve_and_fetch(target, port, path, tmp_path)


def test_a_busy_port_you_chose_is_refused_with_a_message(tmp_path: Path) -> None:
    """`make lab LAB_PORT=<busy>` exits at once with the message. A regression (a server that starts
    anyway) fails as soon as a URL is printed, and the server's process group is stopped either way."""
    import selectors
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        proc = subprocess.Popen(["make", "-s", "-o", STAMP, "lab", f"LAB_PORT={busy}"], cwd=ROOT, env=_env(tmp_path),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        out = {"stdout": "", "stderr": ""}
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
        sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
        try:
            t0, open_pipes = time.time(), 2
            while open_pipes and time.time() - t0 < 60:
                for key, _ in sel.select(timeout=1):
                    line = key.fileobj.readline()
                    if not line:
                        sel.unregister(key.fileobj)
                        open_pipes -= 1
                        continue
                    out[key.data] += line
                    assert "http://" not in line, f"make lab served although port {busy} is busy: {line!r}"
            rc = proc.wait(timeout=max(1.0, 60 - (time.time() - t0)))
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
            sel.close()
    assert rc != 0
    assert f"port {busy} on 127.0.0.1 is busy" in out["stderr"] and "LAB_PORT=" in out["stderr"]
