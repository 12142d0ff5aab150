"""Studies for the sweep tests, importable by name in worker processes (tests/ is on their path).

Each is a module-level function of plain parameters, as ``paged.sweeps.registry`` expects."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pandas as pd

# A small simulated deployment: ~10-30 ms a point on this machine.
SIM_BASE = {"model": "llama-2-7b", "gpu": "a100-40gb", "max_model_len": 1024, "num_requests": 24}


def sim_grid_48() -> dict:
    """48 simulator points: rate x block size x token budget x KV format."""
    return {**SIM_BASE, "rate": [2.0, 8.0, float("inf")], "block_size": [8, 16, 32, 64],
            "max_num_batched_tokens": [512, 2048], "kv_cache_dtype": ["fp16", "fp8"]}


def square(x: int, note: str = "") -> dict:
    if x < 0:
        raise ValueError(f"x must be >= 0, got {x}")
    return {"y": x * x, "note": note}


def table(n: int) -> pd.DataFrame:
    """n rows: a study returning a DataFrame."""
    return pd.DataFrame({"i": range(n), "half": [i / 2 for i in range(n)]})


def echo_meta(x: int) -> dict:
    """Results named like the sweep's own columns and like a parameter."""
    return {"status": "study-status", "x": x + 1, "wall_s": 123.0}


def slow(x: int, delay: float = 0.2) -> dict:
    time.sleep(delay)
    return {"y": x + 1}


def die_once(x: int, marker_dir: str, victim: int = 3) -> dict:
    """Point ``victim`` kills its own worker process on its first attempt (a marker file records
    that attempt); every later attempt, and every other point, returns normally."""
    marker = Path(marker_dir) / f"killed-{x}"
    if x == victim and not marker.exists():
        marker.write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    return {"y": x * 10, "pid_seen": os.getpid()}


def broken_until_fixed(x: int, marker_dir: str) -> dict:
    """Point ``x == 2`` raises until a file ``fixed`` exists in ``marker_dir`` (a bug fixed between
    two sweeps); every other point returns normally."""
    if x == 2 and not (Path(marker_dir) / "fixed").exists():
        raise RuntimeError("not fixed yet")
    return {"y": x * 10}
