"""Full-size results of the long studies (notebooks 05, 08 and 12), made once and shipped in data/precomputed/.

A class cannot wait 15 minutes for 05's study or 7 for 08's: the notebooks run a small "class"
preset live beside these tables, labelled precomputed. One CSV per table
(``data/precomputed/<notebook>_<name>.csv``, ``.attrs.json`` beside it for ``attrs``), written by
the notebooks' own study functions with their full parameters (``FULL_05``, ``FULL_08``)::

    python -m paged.studies.precomputed 05     # ~15 min on a laptop CPU (08: ~8 min)
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Callable

import pandas as pd

from paged.errors import PagedError

__all__ = ["DATA_DIR", "FULL_05", "FULL_08", "DataError", "describe", "load", "make", "save"]

DATA_DIR = Path(__file__).resolve().parents[2] / "data" / "precomputed"
RELATIVE = "data/precomputed"

FULL_05 = dict(contexts=(512, 2048), max_chunks=1, divergence_tokens=32,
               formats=["fp16", "bf16", "fp16/int8", "int8", "fp8_e4m3", "int8/int4", "int4_kivi", "kivi_g32/int4",
                        "int4+rot", "int4"],
               diag_formats=["int8", "int4", "int4_kivi", "int4+rot"], sensitivity_format="int4")
FULL_08 = dict(engine_tier=dict(num_blocks=32), offload_requests=1000, offload_pressures=(1.0, 0.5, 0.25),
               stream_contexts=(512, 1024, 2048, 4000), swap_engine=dict(num_requests=12, prompt_len=96, max_tokens=48),
               sharing=dict(context_length=256, max_chunks=1, ks=(3, 6, 9, 12), divergence_tokens=16),
               compact_copy_requests=40, compact_sim_requests=400)


class DataError(PagedError, FileNotFoundError):
    """A precomputed table is missing or unreadable."""


def path(notebook: str, name: str, root: Path | None = None) -> Path:
    return (root or DATA_DIR) / f"{notebook}_{name}.csv"


def _jsonable(v):
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    plain = v is None or isinstance(v, (str, int)) or (isinstance(v, float) and math.isfinite(v))
    return v if plain else str(v)  # non-finite floats and other objects as text


def save(notebook: str, frames: dict[str, pd.DataFrame], root: Path | None = None) -> list[Path]:
    """Write each frame to ``<notebook>_<name>.csv`` (its attrs, if any, beside it as JSON)."""
    out = []
    for name, df in frames.items():
        p = path(notebook, name, root)
        p.parent.mkdir(parents=True, exist_ok=True)
        df.to_csv(p, index=False)
        if df.attrs:
            p.with_suffix(".attrs.json").write_text(json.dumps(_jsonable(df.attrs), indent=1))
        out.append(p)
    return out


def load(notebook: str, name: str, root: Path | None = None) -> pd.DataFrame:
    """One precomputed table (attrs restored); `DataError` says how to make it when it is missing."""
    p = path(notebook, name, root)
    if not p.exists():
        raise DataError(f"no precomputed table {RELATIVE}/{p.name}; make it with "
                        f"`python -m paged.studies.precomputed {notebook}` (minutes, see data/README.md)")
    df = pd.read_csv(p)
    meta = p.with_suffix(".attrs.json")
    if meta.exists():
        df.attrs.update(json.loads(meta.read_text()))
    return df


def describe(notebook: str, root: Path | None = None) -> str:
    """'precomputed full run (data/precomputed/05_*.csv, made <date> in <s> s): remake with ...'."""
    info = (root or DATA_DIR) / f"{notebook}_made.json"
    made = json.loads(info.read_text()) if info.exists() else {}
    when = f", made {made['date']} in {made['seconds'] / 60:.0f} min" if made else ""
    return (f"*Precomputed full-size run* ({RELATIVE}/{notebook}_*.csv{when}; remake with "
            f"`python -m paged.studies.precomputed {notebook}`).")


def _make_05() -> dict[str, pd.DataFrame]:
    from paged import quant
    from paged.quant import diagnostics
    from paged.quant.runs import load as load_lm
    f = FULL_05
    lm = load_lm()
    ctx = f["contexts"][0]
    frames = _timed(dict(
        study=lambda: quant.study(lm, formats=f["formats"], context_lengths=f["contexts"], max_chunks=f["max_chunks"],
                                  divergence_tokens=f["divergence_tokens"], progress=False),
        layer_errors=lambda: diagnostics.layer_errors(lm, f["diag_formats"], context_length=ctx),
        sensitivity=lambda: diagnostics.layer_sensitivity(lm, [f["sensitivity_format"]], context_length=ctx),
        formats=lambda: quant.describe_formats(f["formats"], lm)))
    t0 = time.perf_counter()
    channels, layers = diagnostics.key_outliers(lm, context_length=ctx)
    channels.attrs["seconds"] = round(time.perf_counter() - t0, 1)
    return {**frames, "key_channels": channels, "key_layers": layers}


def _make_08() -> dict[str, pd.DataFrame]:
    from paged.models import load_model
    from paged.studies import compaction
    from paged.studies.host_tier import engine_tier_study, tier_study
    from paged.studies.offload import offload_study, streaming_study
    from paged.studies.preemption import engine_swap_study
    from paged.studies.sharing import sharing_study
    from paged.studies.swap_error import swap_error_study
    f = FULL_08
    loaded = load_model()
    jobs: dict[str, Callable[[], pd.DataFrame]] = dict(
        tiers=tier_study, engine_tiers=lambda: engine_tier_study(loaded, **f["engine_tier"]),
        offload=lambda: offload_study(num_requests=f["offload_requests"], pressures=f["offload_pressures"]),
        streaming=lambda: streaming_study(contexts=f["stream_contexts"], kv_fractions=(1.0, 0.25)),
        engine_swap=lambda: engine_swap_study(loaded, **f["swap_engine"]),
        swap_error=lambda: swap_error_study(loaded), sharing=lambda: sharing_study(loaded, **f["sharing"]),
        compaction_reads=compaction.read_table,
        compaction_copies=lambda: compaction.copy_table(requests=f["compact_copy_requests"]),
        compaction_sim=lambda: compaction.compaction_sim_table(f["compact_sim_requests"]))
    return _timed(jobs)


def _timed(jobs: dict[str, Callable[[], pd.DataFrame]]) -> dict[str, pd.DataFrame]:
    """Run each job; its seconds go to the frame's attrs['seconds'] (kept in the .attrs.json)."""
    out = {}
    for name, job in jobs.items():
        t0 = time.perf_counter()
        df = job()
        df.attrs["seconds"] = round(time.perf_counter() - t0, 1)
        out[name] = df
    return out


def _make_12() -> dict[str, pd.DataFrame]:
    from paged.fleet.study import mooncake_policies
    return _timed(dict(mooncake_policies=lambda: mooncake_policies(1000, num_replicas=8)))


MAKERS: dict[str, Callable[[], dict[str, pd.DataFrame]]] = {"05": _make_05, "08": _make_08, "12": _make_12}


def make(notebook: str, root: Path | None = None) -> list[Path]:
    """Run notebook `notebook`'s full-size studies and save their tables (minutes)."""
    if notebook not in MAKERS:
        from paged.errors import ConfigError
        raise ConfigError(f"no precomputed results for notebook {notebook!r}; choose one of {sorted(MAKERS)}")
    t0 = time.perf_counter()
    paths = save(notebook, MAKERS[notebook](), root)
    info = dict(date=time.strftime("%Y-%m-%d"), seconds=round(time.perf_counter() - t0, 1),
                command=f"python -m paged.studies.precomputed {notebook}")
    ((root or DATA_DIR) / f"{notebook}_made.json").write_text(json.dumps(info, indent=1))
    return paths


if __name__ == "__main__":  # python -m paged.studies.precomputed 05|08|12
    for nb in sys.argv[1:] or sorted(MAKERS):
        for p in make(nb):
            print(f"{RELATIVE}/{p.name}")
