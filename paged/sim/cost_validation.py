"""The cost model held against vidur's measured operator profiles (``mlp.csv``), and the fit of
the per-kernel figures (:mod:`paged.sim.kernel_costs`) to them.

vidur (microsoft/vidur, MIT) profiles every linear and element-wise operator of a decoder layer
on A100, H100 and A40 for tensor parallel 1-8 and 1-4,096 (Llama-3: 32,768) tokens, and stores
one row per (model shape, tensor parallel, num_tokens) with the median CUDA time of each operator
in milliseconds (``time_stats.<op>.median``). The measured "linear part" of a layer is the sum of
``LAYER_OPS``; the predictions are one layer of

- ``roofline``: the closed-form ``CostModel``'s weights/compute part ``max(F / P, B / W)`` at its
  default ``mfu``/``mbu`` (what the simulator uses unless told otherwise), and
- ``kernels``: :class:`~paged.sim.kernel_costs.KernelRoofline` with the GPU's ``KERNEL_COSTS``.

Errors are ratios ``predicted / measured``; a group's error is the geometric-median error
``exp(median |ln ratio|) - 1`` with the smallest and largest ratio.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import pandas as pd

from paged.errors import ConfigError
from paged.sim.kernel_costs import KERNEL_COSTS, KernelCosts, KernelRoofline
from paged.sim.shapes import StepShape
from paged.sim.specs import ModelSpec, get_gpu

__all__ = ["LAYER_OPS", "SHAPE_COLUMNS", "VIDUR_GPUS", "read_mlp_profile", "find_profiles", "layer_model",
           "predictions", "error_table", "fit_kernel_costs", "coordinate_search", "geo_error",
           "allreduce_table"]

LAYER_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj", "mlp_act", "input_layernorm",
             "post_attention_layernorm", "add", "attn_rope")
_OPTIONAL_OPS = ("post_attention_layernorm", "add", "input_layernorm")
SHAPE_COLUMNS = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "use_gated_mlp",
                 "num_tokens", "num_tensor_parallel_workers")
VIDUR_GPUS = {"a100": "a100-80gb", "h100": "h100-sxm", "a40": "a40"}  # vidur's folder -> our preset


def read_mlp_profile(path: str | os.PathLike) -> pd.DataFrame:
    """One vidur ``mlp.csv`` (or a subset with the same columns), duplicates dropped, with a
    ``measured_s`` column (sum of ``LAYER_OPS`` medians, seconds). Raises ConfigError naming what is missing."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConfigError(f"profile {path!r} does not exist; point at vidur's "
                          "data/profiling/compute/<gpu>/<org>/<model>/mlp.csv")
    try:
        df = pd.read_csv(path).drop_duplicates()
    except (pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError) as e:
        raise ConfigError(f"profile {path!r} is empty or not a CSV ({e})") from None
    df = df.copy()
    for op in _OPTIONAL_OPS:  # as vidur's predictor does: a model without the op (phi-2's parallel block) costs 0
        df[f"time_stats.{op}.median"] = df.get(f"time_stats.{op}.median", 0.0)
        df[f"time_stats.{op}.median"] = df[f"time_stats.{op}.median"].fillna(0.0)
    cols = [f"time_stats.{op}.median" for op in LAYER_OPS]
    missing = sorted(set(SHAPE_COLUMNS) - set(df.columns)) + [c for c in cols if c not in df.columns]
    if missing:
        raise ConfigError(f"profile {path!r} lacks columns {missing}; it must be vidur's mlp.csv format")
    if df.empty:
        raise ConfigError(f"profile {path!r} has no rows")
    df["measured_s"] = df[cols].sum(axis=1) * 1e-3
    return df


def find_profiles(root: str | os.PathLike) -> list[tuple[str, str, Path]]:
    """``(vidur gpu, model folder, path)`` of every ``mlp.csv`` under ``root`` (a vidur checkout, its
    ``data/profiling/compute`` folder, or a folder laid out like it)."""
    root = Path(root)
    base = root / "data" / "profiling" / "compute" if (root / "data").is_dir() else root
    found = sorted(base.glob("*/*/*/mlp.csv"))
    if not found:
        raise ConfigError(f"no <gpu>/<org>/<model>/mlp.csv under {base}; pass vidur's repository root")
    return [(p.parts[-4], p.parts[-2], p) for p in found]


def layer_model(row: pd.Series | dict, name: str = "profiled") -> ModelSpec:
    """A one-layer ``ModelSpec`` of a profile row's shape (GQA, gated MLP)."""
    if not bool(row["use_gated_mlp"]):
        raise ConfigError(f"{name}: the profile's MLP is not gated (2 matrices); ModelSpec models SwiGLU only")
    return ModelSpec(name, 1, int(row["n_embd"]), int(row["n_head"]), int(row["n_kv_head"]),
                     int(row["n_expanded_embd"]), 1)  # vocab 1: no LM head in one profiled layer


def predictions(df: pd.DataFrame, gpu: str, costs: KernelCosts | None = None) -> pd.DataFrame:
    """``df`` (one model's profile) with ``roofline_s`` and ``kernels_s`` per row (one layer)."""
    from paged.sim.cost_model import CostModel

    out = []
    for (tp, *_), g in df.groupby(["num_tensor_parallel_workers", "n_head", "n_kv_head", "n_embd",
                                   "n_expanded_embd"], sort=True):
        m = layer_model(g.iloc[0])
        cm = CostModel(m, gpu, tensor_parallel=int(tp))
        P, W = cm.effective_flops, cm.effective_bandwidth
        roof = []
        for n in g["num_tokens"]:
            f, b = cm.roofline_parts(StepShape.make([n], [0], num_sampled=0))
            roof.append(max(f[0] / P, b[0] / W))
        g = g.assign(roofline_s=roof,
                     kernels_s=KernelRoofline(m, gpu, int(tp), costs).layer_seconds(g["num_tokens"].to_numpy()))
        out.append(g)
    return pd.concat(out)


def geo_error(ratio: Iterable[float]) -> float:
    """Geometric-median error of ratios ``predicted / measured``: ``exp(median |ln r|) - 1``."""
    r = np.asarray(list(ratio), dtype=np.float64)
    return float(np.exp(np.median(np.abs(np.log(r)))) - 1.0)


def _summary(g: pd.DataFrame) -> pd.Series:
    out = {"points": len(g)}
    for col in ("roofline", "kernels"):
        r = g[f"{col}_s"] / g["measured_s"]
        out.update({f"{col}_err": geo_error(r), f"{col}_min": r.min(), f"{col}_max": r.max()})
    return pd.Series(out)


def error_table(profiles: Iterable[tuple[str, str, pd.DataFrame]], by_tp: bool = True) -> pd.DataFrame:
    """Per (gpu, model[, tp]) the geometric-median error and ratio range of both models, plus an
    ``all`` row per GPU and overall. ``profiles``: ``(vidur gpu, model, read_mlp_profile frame)``."""
    rows = [predictions(df, VIDUR_GPUS.get(g, g)).assign(gpu=g, model=m) for g, m, df in profiles]
    if not rows:
        raise ConfigError("error_table needs at least one profile")
    d = pd.concat(rows)
    keys = ["gpu", "model"] + (["num_tensor_parallel_workers"] if by_tp else [])
    t = d.groupby(keys, sort=True).apply(_summary, include_groups=False).reset_index()
    per_gpu = d.groupby("gpu").apply(_summary, include_groups=False).reset_index().assign(model="all")
    total = _summary(d).to_frame().T.assign(gpu="all", model="all")
    t = pd.concat([t, per_gpu, total], ignore_index=True)
    return t.rename(columns={"num_tensor_parallel_workers": "tp"})


# -- fit -----------------------------------------------------------------------------------------

_GRID = {
    "gemm_floor_s": [3e-6, 4e-6, 5e-6, 6e-6, 7e-6, 8e-6],
    "gemm_mfu": [0.6, 0.64, 0.68, 0.7, 0.72, 0.74, 0.76, 0.78, 0.8, 0.82, 0.85],
    "gemm_mbu": [0.7, 0.75, 0.8, 0.83, 0.86, 0.9, 0.95, 1.0],
    "ridge_p": [1.5, 2.0, 2.5, 3.0, 4.0],
    "m_tiles": [((0, 64),), ((0, 128),), ((0, 64), (256, 128)), ((0, 128), (512, 256)), ((0, 64), (256, 128), (1024, 256))],
    "ew_floor_s": [0.5e-6, 1e-6, 1.5e-6, 2e-6, 3e-6],
    "ew_mbu": [0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6, 0.7],
}


def _score(ratio: np.ndarray) -> float:
    """Lower is better: the worse of the geometric-median error against 5% and the widest ratio against 0.8-1.25."""
    lr = np.abs(np.log(ratio))
    return max(geo_error(ratio) / 0.05, float(lr.max()) / np.log(1.25))


def fit_kernel_costs(df: pd.DataFrame, gpu: str, start: KernelCosts | None = None, rounds: int = 3,
                     source: str = "") -> tuple[KernelCosts, float]:
    """Coordinate search over ``_GRID`` (deterministic) for the ``KernelCosts`` that best match one
    GPU's profile rows ``df`` (any models); returns the figures and their score (<= 1 meets
    the 5% / 0.8-1.25x bounds)."""
    preset = VIDUR_GPUS.get(gpu, gpu)
    c = start or KERNEL_COSTS.get(get_gpu(preset).name) or KernelCosts(5e-6, 0.7, 0.85, 2.0, ((0, 128),), 1e-6, 0.5)
    models = [(KernelRoofline(layer_model(g.iloc[0]), preset, int(tp), c), g["num_tokens"].to_numpy(),
               g["measured_s"].to_numpy())
              for (tp, *_), g in df.groupby(["num_tensor_parallel_workers", "n_head", "n_kv_head", "n_embd",
                                             "n_expanded_embd"], sort=True)]

    def score(k: KernelCosts) -> float:
        r = []
        for kr, n, y in models:
            kr.costs = k
            r.append(kr.layer_seconds(n) / y)
        return _score(np.concatenate(r))

    c, best = coordinate_search(score, c, _GRID, rounds)
    return c.with_(source=source or c.source), best


def coordinate_search(score: Callable[[KernelCosts], float], start: KernelCosts, grid: dict[str, list],
                      rounds: int = 3) -> tuple[KernelCosts, float]:
    """Deterministic: one field of ``grid`` at a time, in order, keeping any strict improvement of
    ``score``; stops after ``rounds`` passes or a pass without one. Returns the figures and their score."""
    c, best = start, score(start)
    for _ in range(rounds):
        improved = False
        for name, values in grid.items():
            for v in values:
                cand = c.with_(**{name: v})
                s = score(cand)
                if s < best - 1e-9:
                    c, best, improved = cand, s, True
        if not improved:
            break
    return c, best


# -- tensor-parallel all-reduce --------------------------------------------------------------------

VIDUR_NETWORKS = {"a100_dgx": "a100-80gb", "h100_dgx": "h100-sxm"}  # vidur's network folder -> our preset


def allreduce_table(root: str | os.PathLike) -> pd.DataFrame:
    """The closed form's all-reduce (``2 (tp-1)/tp x bytes / interconnect + allreduce_latency_s``,
    ``CostModel.comm_seconds`` per call) against vidur's ``network/<node>/all_reduce.csv`` (single
    node: ``devices_per_node == num_workers``); per (network, tp) the error, the ratio range, and
    the latency and bus bandwidth a relative least-squares fit of ``a + 2 (tp-1)/tp x bytes / b``
    to the measurements gives."""
    from paged.sim.cost_model import CostModel

    root = Path(root)
    base = root / "data" / "profiling" / "network" if (root / "data").is_dir() else root
    rows = []
    for net, preset in VIDUR_NETWORKS.items():
        path = base / net / "all_reduce.csv"
        if not path.is_file():
            continue
        df = pd.read_csv(path)
        df = df[(df["collective"] == "all_reduce") & (df["devices_per_node"] == df["num_workers"])]
        lat, gpu = CostModel("llama-2-7b", preset).allreduce_latency_s, get_gpu(preset)
        for tp, g in df.groupby("num_workers", sort=True):
            g = g.groupby("size")["time_stats.all_reduce.median"].median()
            size, meas = g.index.to_numpy(dtype=np.float64), g.to_numpy() * 1e-3
            vol = 2 * (tp - 1) / tp * size
            ratio = (vol / gpu.interconnect_bandwidth + lat) / meas
            X = np.column_stack([np.ones_like(vol), vol]) / meas[:, None]
            a, inv_b = np.linalg.lstsq(X, np.ones_like(meas), rcond=None)[0]
            fit = (a + vol * inv_b) / meas
            rows.append({"network": net, "tp": int(tp), "points": len(g), "closed_err": geo_error(ratio),
                         "closed_min": ratio.min(), "closed_max": ratio.max(), "fit_latency_us": a * 1e6,
                         "fit_busbw_GBps": 1 / inv_b / 1e9, "fit_err": geo_error(fit)})
    return pd.DataFrame(rows)
