"""Package-level behaviour: a foreign `kernels` package is refused with a clear error."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_foreign_kernels_package_is_refused(tmp_path):
    fake = tmp_path / "kernels"
    fake.mkdir()
    (fake / "__init__.py").write_text("# stands in for PyPI's unrelated 'kernels'\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    code = "import paged; import paged.engine.runner"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "not the paged-KV workbench's kernels package" in proc.stderr
    ok = subprocess.run([sys.executable, "-c", "import paged.engine.runner, kernels; print(kernels.WORKBENCH)"],
                        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True)
    assert ok.stdout.strip() == "True", ok.stderr


def test_import_paged_does_not_import_torch():
    code = "import sys, paged; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.stdout.strip() == "False", proc.stderr
