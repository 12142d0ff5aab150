"""Calibration of the roofline cost model to measured step times (``CostModel.fit``).

``fit(model, shapes, seconds)`` keeps the roofline's shape (``paged.sim.cost_model``) and fits
its free constants: step overhead, per-sequence and per-token costs, and the effective FLOP/s
and bandwidth (through their ridge point), by non-negative least squares on relative error,
reporting the error on held-out steps. Measured steps come from engine records
(``shapes_from_steps``) or a saved CSV (``calibration_frame`` -> ``read_calibration`` ->
``shapes_from_frame``); the simulator fits to one when ``SimConfig.calibration`` names it.

The model is anything with the roofline's features (:class:`Roofline`: ``CostModel`` is one);
this module does not import the cost model, which re-exports these names.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterable, Protocol, Sequence

import numpy as np

from paged.errors import ConfigError
from paged.sim.shapes import StepShape, step_shape

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["Roofline", "FitReport", "fit", "shapes_from_steps", "calibration_frame", "read_calibration",
           "shapes_from_frame"]


class Roofline(Protocol):
    """What the fit reads of a cost model (``paged.sim.cost_model.CostModel`` has it all); the
    fitted model is ``dataclasses.replace(model, mfu=, mbu=, step_overhead_s=, per_seq_s=,
    per_token_s=[, gpu=])``."""

    gpu: Any  # a GPUSpec: peak_flops, hbm_bandwidth, with_(...)
    step_overhead_s: float
    per_seq_s: float
    per_token_s: float

    @property
    def effective_flops(self) -> float: ...
    @property
    def effective_bandwidth(self) -> float: ...
    def roofline_parts(self, s: StepShape) -> tuple[np.ndarray, np.ndarray]: ...
    def comm_seconds(self, s: StepShape) -> float: ...
    def transfer_seconds(self, s: StepShape) -> float: ...
    def predict(self, shapes: Iterable[StepShape]) -> np.ndarray: ...


@dataclass(frozen=True, slots=True)
class FitReport:
    """Result of ``CostModel.fit``: errors are relative (|pred - true| / true)."""

    model: Any  # the fitted model, of the type given to fit
    n_train: int
    n_holdout: int
    train_mape: float
    holdout_mape: float
    holdout_p90_ape: float
    holdout_r2: float
    ridge_flops_per_byte: float

    def as_dict(self) -> dict:
        m = self.model
        return {"n_train": self.n_train, "n_holdout": self.n_holdout, "train_mape": self.train_mape,
                "holdout_mape": self.holdout_mape, "holdout_p90_ape": self.holdout_p90_ape,
                "holdout_r2": self.holdout_r2, "step_overhead_s": m.step_overhead_s, "per_seq_s": m.per_seq_s,
                "per_token_s": m.per_token_s, "effective_flops": m.effective_flops,
                "effective_bandwidth": m.effective_bandwidth, "ridge_flops_per_byte": self.ridge_flops_per_byte}


def fit(model: "Roofline", shapes: Sequence[StepShape], seconds: Sequence[float], holdout_fraction: float = 0.25,
        seed: int = 0) -> FitReport:
    """Fit overhead, per-seq, per-token, effective FLOP/s and bandwidth to measured steps.

    For each candidate ridge point ``r = P/W`` (FLOP per byte) the step time is linear in
    ``[1, S, T, sum_parts max(f, r b)]`` with coefficients ``[overhead, per_seq, per_token, 1/P]``;
    we solve non-negative least squares on relative error (each row divided by its time) and
    keep the ``r`` with the lowest training error. Steps are split at random (``seed``) into
    train and held-out sets; the returned model is fitted on the training steps only.
    """
    y = np.asarray(seconds, dtype=np.float64)
    n = len(shapes)
    if n != len(y) or n < 8:
        raise ConfigError(f"fit needs >= 8 steps with one time each, got {n} shapes and {len(y)} times")
    if np.any(y <= 0):
        raise ConfigError("fit needs positive step times")
    idx = np.random.default_rng(seed).permutation(n)
    n_hold = max(1, int(round(n * holdout_fraction))) if holdout_fraction > 0 else 0
    hold, train = idx[:n_hold], idx[n_hold:]
    parts = [model.roofline_parts(s) for s in shapes]
    S = np.array([s.num_seqs for s in shapes], dtype=np.float64)
    T = np.array([s.q.sum() for s in shapes], dtype=np.float64)
    extra = np.array([model.comm_seconds(s) + model.transfer_seconds(s) for s in shapes])
    best: tuple[float, float, np.ndarray] | None = None
    for r in np.geomspace(0.01, 1e4, 121):
        roof = np.array([np.maximum(f, r * b).sum() for f, b in parts])
        X = np.column_stack([np.ones(n), S, T, roof])
        coef = _nnls_rel(X[train], y[train] - extra[train])
        if coef[3] <= 0:
            continue
        pred = X[train] @ coef + extra[train]
        err = float(np.mean(np.abs(pred - y[train]) / y[train]))
        if best is None or err < best[0]:
            best = (err, float(r), coef)
    if best is None:
        raise ConfigError("fit found no positive compute coefficient; are step shapes empty?")
    _, r, coef = best
    eff_flops = float(1.0 / coef[3])
    eff_bw = eff_flops / r
    fitted = replace(model, mfu=min(1.0, eff_flops / model.gpu.peak_flops),
                     mbu=min(1.0, eff_bw / model.gpu.hbm_bandwidth),
                     step_overhead_s=float(coef[0]), per_seq_s=float(coef[1]), per_token_s=float(coef[2]))
    if eff_flops > model.gpu.peak_flops or eff_bw > model.gpu.hbm_bandwidth:
        # measured device is faster than the preset: raise the preset's peaks instead of clipping
        gpu = model.gpu.with_(peak_flops=max(model.gpu.peak_flops, eff_flops),
                              hbm_bandwidth=max(model.gpu.hbm_bandwidth, eff_bw))
        fitted = replace(fitted, gpu=gpu, mfu=eff_flops / gpu.peak_flops, mbu=eff_bw / gpu.hbm_bandwidth)
    pred = fitted.predict(shapes)
    ape = np.abs(pred - y) / y
    if n_hold:
        yh, ph = y[hold], pred[hold]
        ss_res = float(((yh - ph) ** 2).sum())
        ss_tot = float(((yh - yh.mean()) ** 2).sum()) or float("nan")
        h_mape, h_p90, r2 = float(ape[hold].mean()), float(np.quantile(ape[hold], 0.9)), 1 - ss_res / ss_tot
    else:
        h_mape = h_p90 = r2 = float("nan")
    return FitReport(fitted, len(train), n_hold, float(ape[train].mean()), h_mape, h_p90, r2, r)


def shapes_from_steps(steps: Iterable[Any], block_bytes: float = 0.0) -> tuple[list[StepShape], np.ndarray]:
    """Engine step records -> (``StepShape`` list, seconds) for ``CostModel.fit``.

    Each record (an engine ``StepOutput``) needs ``scheduled`` (chunks with ``start``, ``num_tokens``,
    ``samples``), ``num_swapped_out_blocks``, ``num_swapped_in_blocks``, ``num_block_copies`` and
    ``step_time_s`` (seconds: scheduling, cache ops, forward and sampling, which is what ``step_time``
    predicts). Steps that scheduled nothing are skipped. ``block_bytes`` prices swapped/copied blocks
    (see ``step_shape``).
    """
    shapes: list[StepShape] = []
    secs: list[float] = []
    for st in steps:
        chunks = list(st.scheduled)
        if not chunks:
            continue
        shapes.append(step_shape(chunks, st.num_swapped_out_blocks + st.num_swapped_in_blocks,
                                 st.num_block_copies, block_bytes))
        secs.append(float(st.step_time_s))
    return shapes, np.asarray(secs)


def calibration_frame(steps: Iterable[Any]) -> "pd.DataFrame":
    """Engine step records -> tidy DataFrame, one row per chunk (``step, start, num_tokens, samples,
    seconds``), to save measurements and fit later (``shapes_from_frame``). Unlike
    ``paged.telemetry.steps_frame`` (one row per step) it keeps each chunk's shape."""
    import pandas as pd

    rows = [(i, c.start, c.num_tokens, bool(c.samples), float(st.step_time_s))
            for i, st in enumerate(steps) for c in st.scheduled]
    return pd.DataFrame(rows, columns=["step", "start", "num_tokens", "samples", "seconds"])


def read_calibration(path: str) -> "pd.DataFrame":
    """The calibration CSV (``calibration_frame(...).to_csv``), or a ConfigError naming the file."""
    import pandas as pd

    if not os.path.isfile(path):
        raise ConfigError(f"calibration file {path!r} does not exist; save one with "
                          "paged.sim.cost_model.calibration_frame(...).to_csv(path)")
    try:
        df = pd.read_csv(path)
    except (pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError) as e:
        raise ConfigError(f"calibration file {path!r} is empty or not a CSV ({e})") from None
    if df.empty:
        raise ConfigError(f"calibration file {path!r} has no steps")
    return df


def shapes_from_frame(df: "pd.DataFrame") -> tuple[list[StepShape], np.ndarray]:
    """Inverse of ``calibration_frame``: (shapes, seconds) for ``CostModel.fit``."""
    missing = {"step", "start", "num_tokens", "samples", "seconds"} - set(df.columns)
    if missing:
        raise ConfigError(f"calibration frame lacks columns {sorted(missing)}; write it with calibration_frame()")
    shapes, secs = [], []
    for _, g in df.groupby("step", sort=True):
        shapes.append(StepShape.make(g["num_tokens"].tolist(), g["start"].tolist(), int(g["samples"].sum())))
        secs.append(float(g["seconds"].iloc[0]))
    return shapes, np.asarray(secs)


def _nnls_rel(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares on relative residuals (rows scaled by 1/y); drops negative columns."""
    w = 1.0 / np.maximum(np.abs(y), 1e-12)
    Xw, yw = X * w[:, None], y * w
    scale = np.abs(Xw).max(axis=0)
    scale[scale == 0] = 1.0
    active = [j for j in range(X.shape[1]) if np.any(X[:, j] != 0)]
    coef = np.zeros(X.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(Xw[:, active] / scale[active], yw, rcond=None)
        sol = sol / scale[active]
        if np.all(sol >= 0):
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef
