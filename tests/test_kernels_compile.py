"""The Triton kernels compile for NVIDIA GPUs (sm_80 and sm_90), checked here without a GPU.

The interpreter forgives things a GPU compile does not (ops that do not broadcast, tl.dot
shape limits, dtype mismatches), so every kernel is compiled to a cubin with the ``ptxas`` that
ships with Triton, in a subprocess without TRITON_INTERPRET. One specialisation per kernel and
KV format here (``--quick``); ``python -m kernels.triton_impl.compile_check`` compiles them all.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_compile_for_nvidia():
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this triton build ships no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_CACHE_DIR", "/tmp/paged-triton-cache")
    r = subprocess.run([sys.executable, "-m", "kernels.triton_impl.compile_check", "--quick", "--arch", "80", "90"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "compiled" in r.stdout
