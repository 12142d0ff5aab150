"""Run a test's body in a fresh Python interpreter, so what it generates does not depend on test order.

Hypothesis, even derandomized (``settings(derandomize=True)``), draws some integers from the
constants of every project module loaded in the process at the time (its "local constants":
non-test modules outside site-packages, found through ``sys.modules``). So the examples a property
test runs depend on which test files ran before it in the same pytest process: the KV-manager
property test passed alone and failed after a list of engine and study tests, on a case its
usual examples never reach. In a fresh interpreter the loaded modules are the test module's own
imports, whatever ran before, so the examples are the same in every run and every order.

``run_fresh("test_kv_properties", "run_machine")`` imports the module from ``tests/`` in a child
interpreter (same ``sys.executable``, environment and working directory; ``PYTHONHASHSEED=0``),
calls the function and returns its JSON-able result; a failure raises ``pytest.fail`` with the
child's output (Hypothesis's falsifying example included). To debug, call the same function in
your own interpreter (``python -c "import test_kv_properties as t; t.run_machine()"`` from tests/).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parent
_MARK = "@@fresh-interpreter-result@@ "


def run_fresh(module: str, function: str, *, timeout_s: float = 1200.0) -> Any:
    """``module.function()`` (a module in tests/) run in a new interpreter; its result, via JSON."""
    code = (f"import json, sys; sys.path.insert(0, {str(TESTS)!r}); import {module} as m; "
            f"print({_MARK!r} + json.dumps(m.{function}()))")
    env = dict(os.environ, PYTHONHASHSEED="0")
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{module}.{function} ran past {timeout_s:.0f} s in its interpreter:\n{e.stdout}\n{e.stderr}")
    results = [line[len(_MARK):] for line in done.stdout.splitlines() if line.startswith(_MARK)]
    if done.returncode or not results:
        out = (done.stdout + "\n" + done.stderr)[-12000:]
        pytest.fail(f"{module}.{function} failed in a fresh interpreter (exit status {done.returncode}):\n{out}",
                    pytrace=False)
    return json.loads(results[-1])
