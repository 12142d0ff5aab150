"""The three ablations of issue 30 (docs/ablations/): each runs as its command and prints its
table, and each uses the public API only (``paged``'s own names and ``paged.telemetry``; no
private attribute)."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import paged

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "docs" / "ablations").glob("*.py"))
ALLOWED_MODULES = {"__future__", "argparse", "tempfile", "pandas", "paged"}
PUBLIC_MODULES = {"telemetry"}  # documented modules a script may import from paged


def test_there_are_three():
    assert [p.stem for p in SCRIPTS] == ["block_size_eviction", "kv_formats_engine", "sweep_resume"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_public_api_only(script):
    tree = ast.parse(script.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            assert not node.attr.startswith("_") or node.attr.startswith("__"), f"{script.name}: .{node.attr}"
            if isinstance(node.value, ast.Name) and node.value.id == "paged":
                assert node.attr in paged.__all__, f"{script.name}: paged.{node.attr} is not public"
        if isinstance(node, ast.Import):
            assert {a.name for a in node.names} <= ALLOWED_MODULES, script.name
        if isinstance(node, ast.ImportFrom):
            assert node.module in ALLOWED_MODULES, f"{script.name}: from {node.module}"
            if node.module == "paged":
                assert {a.name for a in node.names} <= PUBLIC_MODULES | set(paged.__all__), script.name


def _run(script: str, *args: str) -> str:
    out = subprocess.run([sys.executable, str(ROOT / "docs" / "ablations" / script), *args], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_block_size_by_eviction():
    out = _run("block_size_eviction.py", "--requests", "120")
    lines = out.strip().splitlines()
    assert lines[0].split() == ["block_size", "eviction", "prefix_cache_hit_rate", "throughput_tok_s", "tbt_p99_s",
                                "throughput_vs_16_lru"]
    assert len(lines) == 7 and lines[3].split()[:2] == ["16", "lru"] and lines[3].split()[-1] == "1"


def test_kv_formats_on_the_engine():
    out = _run("kv_formats_engine.py", "--max-tokens", "4", "--formats", "auto,int8", "--budget-mib", "16")
    rows = [line.split() for line in out.strip().splitlines()]
    assert rows[0][:3] == ["format", "bytes_per_token", "pool_tokens"] and [r[0] for r in rows[1:]] == ["auto", "int8"]
    auto, int8 = rows[1], rows[2]
    assert auto[-2:] == ["1", "1"] and float(int8[-2]) > 3  # int8 holds > 3x fp32's tokens in the same bytes


def test_the_sweep_resumes_exactly(tmp_path):
    out = _run("sweep_resume.py", "--store", str(tmp_path))
    assert "points 6  stored before resuming 2  computed on resume 4" in out
    assert out.strip().endswith("largest difference, resumed vs uninterrupted: 0")
