"""The vLLM venv for tests that run real vLLM code (tests/test_vllm_e2e.py, test_connect_vllm_decoder.py).

``vllm_python()`` builds it with ``make vllm`` when missing (cached by its stamp: a no-op when
present; ~3 min and ~3.4 GB from PyPI on a clean machine, as CI is) and returns its python.
The tests run vLLM in subprocesses: ``paged`` never imports vllm.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def vllm_python() -> Path:
    py = Path(os.environ.get("PAGED_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
    if "PAGED_VLLM_PYTHON" not in os.environ and not (ROOT / ".venv-vllm" / ".installed").is_file():
        subprocess.run(["make", "-C", str(ROOT), "vllm"], check=True, timeout=1800)
    assert py.is_file(), f"no vLLM python at {py} after `make vllm`"
    return py


def run_vllm_python(code: str, *args: str, timeout: float = 300, env: dict | None = None,
                    **kw) -> subprocess.CompletedProcess:
    """Run ``code`` in the vLLM venv's python (``env``: default this process's; never this checkout's
    PYTHONPATH); raises on failure."""
    env = {k: v for k, v in (os.environ if env is None else env).items() if k != "PYTHONPATH"}
    env.update(VLLM_LOGGING_LEVEL="ERROR", VLLM_NO_USAGE_STATS="1", OMP_NUM_THREADS="1")
    p = subprocess.run([str(vllm_python()), "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                       env=env, **kw)
    assert p.returncode == 0, f"vLLM subprocess failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    return p
