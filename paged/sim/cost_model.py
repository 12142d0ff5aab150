"""Roofline step-time model for a model/GPU preset, and its calibration to measured steps.

One step runs every scheduled chunk ``i`` with ``q_i`` new tokens on top of ``c_i`` tokens
already cached (a decode is ``q_i = 1``). Its predicted time is

    t = overhead + per_seq * S + per_token * T
        + max(F_lin / P, B_w / W)                         # weights: matmuls vs reading weights once
        + sum_i max(f_i / P, b_i / W)                     # attention of each chunk vs its KV reads
        + all-reduce (tensor parallel) + swap_bytes / PCIe + copy_bytes / W

with ``P = peak_flops x mfu`` and ``W = hbm_bandwidth x mbu`` per GPU, ``F_lin = 2 x tokens x
params / tp`` (+ LM head for sampled tokens), ``f_i = 4 x layers x heads/tp x head_dim x q_i x
(c_i + (q_i + 1) / 2)`` (causal QK^T and PV) and ``b_i = (c_i + q_i) x kv_bytes_per_token``.

This is the same decomposition as Sarathi-Serve's analysis (prefill is compute bound, decode is
memory bound) and vidur's operator split, reduced to closed form; vidur instead fits per-operator
random forests on profiles (<9% error claimed). ``CostModel.fit`` calibrates ``overhead``,
``per_seq``, ``per_token``, the effective FLOP/s and bandwidth (via their ridge point) to measured
step times by non-negative least squares and reports the held-out error.

With ``kv_block_size`` set, KV reads are slowed by ``paged_attention_efficiency(block_size)``
(measured paged-vs-contiguous kernel bandwidth from flash-attention PR 2468, see ANCHORS.md), so
tiny blocks cost attention time as in the vLLM paper's block-size ablation (its Fig. 18).

Swap transfers (the engine's ``paged.engine.swap``): ``swap_bytes`` (device bytes of the blocks
swapped out and in) cross the host link (``GPUSpec.pcie_bandwidth`` x ``pcie_efficiency``; PCIe 4.0
x16 ~32 GB/s per direction vs ~2 TB/s HBM on an A100) as ``x = swap_bytes x r / link``, ``r`` =
host/device bytes of a block (:func:`swap_bytes_ratio`: 1, or fp8/int4 ``swap_compression``, whose
encode/decode adds ``swap_bytes x (1 + r) / W`` of HBM traffic). Without ``swap_overlap`` the step
is ``compute + x``; with it (side streams, per-layer swap-in fences) ``max(c, x) + min(c, x) / L``:
the larger of the forward's GPU time ``c`` and the transfer, plus one layer's share of the smaller
(the pipeline's fill: layer 0 waits for its own blocks, or the last layer's transfer trails).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np

from paged.core.plan import DecodeRun
from paged.sim.specs import GPUSpec, KVFormat, ModelSpec, get_gpu, get_model
from paged.errors import ConfigError

if TYPE_CHECKING:
    import pandas as pd


@dataclass(slots=True)
class StepShape:
    """What a step computes: per chunk new tokens ``q`` and cached context ``ctx`` before it."""

    q: np.ndarray
    ctx: np.ndarray
    num_sampled: int = 0
    swap_bytes: float = 0.0
    copy_bytes: float = 0.0

    @classmethod
    def make(cls, q: Sequence[int], ctx: Sequence[int], num_sampled: int | None = None,
             swap_bytes: float = 0.0, copy_bytes: float = 0.0) -> "StepShape":
        qa = np.asarray(q, dtype=np.float64)
        ca = np.asarray(ctx, dtype=np.float64)
        if qa.shape != ca.shape:
            raise ConfigError(f"q and ctx must have the same length, got {qa.shape} and {ca.shape}")
        return cls(qa, ca, len(qa) if num_sampled is None else num_sampled, swap_bytes, copy_bytes)

    @property
    def num_tokens(self) -> int:
        return int(self.q.sum())

    @property
    def num_seqs(self) -> int:
        return len(self.q)


@dataclass(frozen=True, slots=True)
class StepBreakdown:
    total: float
    overhead: float
    linear: float
    attention: float
    comm: float
    swap: float


@dataclass(frozen=True, slots=True)
class FitReport:
    """Result of ``CostModel.fit``: errors are relative (|pred - true| / true)."""

    model: "CostModel"
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


@dataclass(slots=True)
class CostModel:
    """Step time of ``model`` on ``tensor_parallel`` x ``gpu`` (seconds). See module docstring."""

    model: ModelSpec
    gpu: GPUSpec
    tensor_parallel: int = 1
    kv_format: str | KVFormat = "fp16"
    mfu: float = 0.6  # achieved fraction of peak FLOP/s in matmuls
    mbu: float = 0.8  # achieved fraction of HBM bandwidth
    pcie_efficiency: float = 0.8
    step_overhead_s: float = 2e-3  # scheduler + launch + sampling per step
    per_seq_s: float = 4e-6
    per_token_s: float = 0.0
    allreduce_latency_s: float = 8e-6
    kv_block_size: int | None = None  # paged KV: scale KV-read bandwidth by paged_attention_efficiency
    swap_overlap: bool = False  # transfers beside the forward: max(compute, transfer) + fill (see docstring)
    swap_compression: str | None = None  # None | "fp8" | "int4": host blocks quantized (fewer link bytes)
    # derived constants (filled in __post_init__)
    _kv_bytes: float = field(init=False, default=0.0)
    _attn_flops_per_tok: float = field(init=False, default=0.0)
    _lin_flops_per_tok: float = field(init=False, default=0.0)
    _head_flops_per_tok: float = field(init=False, default=0.0)
    _weight_bytes: float = field(init=False, default=0.0)
    _swap_ratio: float = field(init=False, default=1.0)

    def __post_init__(self) -> None:
        self.model, self.gpu = get_model(self.model), get_gpu(self.gpu)
        if self.tensor_parallel < 1:
            raise ConfigError(f"tensor_parallel must be >= 1, got {self.tensor_parallel}")
        if not (0 < self.mfu <= 1 and 0 < self.mbu <= 1):
            raise ConfigError(f"mfu and mbu must be in (0, 1], got {self.mfu}, {self.mbu}")
        m, tp = self.model, self.tensor_parallel
        self._kv_bytes = m.kv_bytes_per_token(self.kv_format, tp)
        if m.kv_layers != m.num_layers:  # KV sharing: fewer caches, but every layer reads one (its owner's)
            self._kv_bytes *= m.num_layers / m.kv_layers
        if self.kv_block_size is not None:
            self._kv_bytes /= paged_attention_efficiency(self.kv_block_size)
        self._attn_flops_per_tok = 4.0 * m.num_layers * (m.num_heads / tp) * m.head_dim
        self._lin_flops_per_tok = 2.0 * m.matmul_params_per_token / tp
        self._head_flops_per_tok = 2.0 * m.lm_head_params / tp
        self._weight_bytes = (m.matmul_params_per_token + m.lm_head_params) * m.dtype_bytes / tp
        self._swap_ratio = swap_bytes_ratio(self.swap_compression, m.head_dim, self.kv_format,
                                            self.kv_block_size or 16)

    # -- effective rates ------------------------------------------------------------------------
    @property
    def swap_bytes_ratio(self) -> float:
        """Bytes that cross the host link per byte of KV moved (below 1 with swap compression)."""
        return self._swap_ratio

    @property
    def effective_flops(self) -> float:
        return self.gpu.peak_flops * self.mfu

    @property
    def effective_bandwidth(self) -> float:
        return self.gpu.hbm_bandwidth * self.mbu

    @property
    def kv_bytes_per_token(self) -> float:
        """Stored KV bytes per token on one GPU (without the paged-kernel penalty)."""
        return self.model.kv_bytes_per_token(self.kv_format, self.tensor_parallel)

    # -- features -------------------------------------------------------------------------------
    def _parts(self, s: StepShape) -> tuple[np.ndarray, np.ndarray]:
        """FLOPs and bytes of each roofline part: [linear, chunk_0, chunk_1, ...]."""
        T = float(s.q.sum())
        f_lin = T * self._lin_flops_per_tok + s.num_sampled * self._head_flops_per_tok
        f = np.empty(len(s.q) + 1)
        b = np.empty(len(s.q) + 1)
        f[0], b[0] = f_lin, self._weight_bytes
        f[1:] = self._attn_flops_per_tok * s.q * (s.ctx + (s.q + 1.0) * 0.5)
        b[1:] = (s.ctx + s.q) * self._kv_bytes
        return f, b

    def _comm(self, s: StepShape) -> float:
        tp = self.tensor_parallel
        if tp == 1:
            return 0.0
        m = self.model
        bw = self.gpu.interconnect_bandwidth or self.gpu.pcie_bandwidth
        vol = 2 * m.num_layers * float(s.q.sum()) * m.hidden_size * m.dtype_bytes * 2 * (tp - 1) / tp
        return vol / bw + 2 * m.num_layers * self.allreduce_latency_s

    def _link(self, s: StepShape) -> float:
        """Seconds of one step's swap transfers: link time of the (compressed) bytes + codec HBM time."""
        if not s.swap_bytes:
            return 0.0
        r = self._swap_ratio
        t = s.swap_bytes * r / (self.gpu.pcie_bandwidth * self.pcie_efficiency)
        return t + (s.swap_bytes * (1.0 + r) / self.effective_bandwidth if self.swap_compression else 0.0)

    def _swap(self, s: StepShape) -> float:
        """Swap and copy seconds when nothing overlaps (what adds to the forward without overlap)."""
        t = self._link(s)
        if s.copy_bytes:
            t += 2 * s.copy_bytes / self.effective_bandwidth
        return t

    def _with_swap(self, gpu: float, s: StepShape) -> float:
        """The forward's GPU seconds ``gpu`` combined with the step's swaps and copies."""
        if not (s.swap_bytes or s.copy_bytes):
            return gpu
        if not self.swap_overlap or not s.swap_bytes:
            return gpu + self._swap(s)
        x = self._link(s)
        copies = 2 * s.copy_bytes / self.effective_bandwidth
        return max(gpu, x) + min(gpu, x) / self.model.num_layers + copies

    # -- prediction -----------------------------------------------------------------------------
    def breakdown(self, s: StepShape) -> StepBreakdown:
        f, b = self._parts(s)
        P, W = self.effective_flops, self.effective_bandwidth
        lin = float(max(f[0] / P, b[0] / W))
        attn = float(np.maximum(f[1:] / P, b[1:] / W).sum())
        ovh = self.step_overhead_s + self.per_seq_s * s.num_seqs + self.per_token_s * float(s.q.sum())
        comm = self._comm(s)
        swap = self._with_swap(lin + attn + comm, s) - (lin + attn + comm)  # exposed (not hidden) swap time
        return StepBreakdown(float(ovh + lin + attn + comm + swap), ovh, lin, attn, comm, swap)

    def step_time(self, s: StepShape) -> float:
        """Predicted seconds for one step (hot path of the simulator)."""
        if len(s.q) == 0:
            return self._swap(s) + (self.step_overhead_s if s.swap_bytes else 0.0)
        if s.swap_bytes and self.swap_overlap:
            return self.breakdown(s).total
        P, W = self.effective_flops, self.effective_bandwidth
        q, c = s.q, s.ctx
        T = float(q.sum())
        f_lin = T * self._lin_flops_per_tok + s.num_sampled * self._head_flops_per_tok
        t = float(max(f_lin / P, self._weight_bytes / W))
        f = self._attn_flops_per_tok / P * q * (c + (q + 1.0) * 0.5)
        b = (self._kv_bytes / W) * (c + q)
        t += float(np.maximum(f, b).sum())
        t += self.step_overhead_s + self.per_seq_s * len(q) + self.per_token_s * T
        if self.tensor_parallel > 1:
            t += self._comm(s)
        if s.swap_bytes or s.copy_bytes:
            t += self._swap(s)
        return t

    def predict(self, shapes: Iterable[StepShape]) -> np.ndarray:
        return np.array([self.step_time(s) for s in shapes])

    # -- calibration ----------------------------------------------------------------------------
    def fit(self, shapes: Sequence[StepShape], seconds: Sequence[float], holdout_fraction: float = 0.25,
            seed: int = 0, ridge_grid: Sequence[float] | None = None) -> FitReport:
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
        rng = np.random.default_rng(seed)
        idx = rng.permutation(n)
        n_hold = max(1, int(round(n * holdout_fraction))) if holdout_fraction > 0 else 0
        hold, train = idx[:n_hold], idx[n_hold:]
        parts = [self._parts(s) for s in shapes]
        S = np.array([s.num_seqs for s in shapes], dtype=np.float64)
        T = np.array([s.q.sum() for s in shapes], dtype=np.float64)
        extra = np.array([self._comm(s) + self._swap(s) for s in shapes])
        if ridge_grid is None:
            ridge_grid = np.geomspace(0.01, 1e4, 121)
        best: tuple[float, float, np.ndarray] | None = None
        for r in ridge_grid:
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
        fitted = replace(self, mfu=min(1.0, eff_flops / self.gpu.peak_flops),
                         mbu=min(1.0, eff_bw / self.gpu.hbm_bandwidth),
                         step_overhead_s=float(coef[0]), per_seq_s=float(coef[1]), per_token_s=float(coef[2]))
        if eff_flops > self.gpu.peak_flops or eff_bw > self.gpu.hbm_bandwidth:
            # measured device is faster than the preset: raise the preset's peaks instead of clipping
            gpu = self.gpu.with_(peak_flops=max(self.gpu.peak_flops, eff_flops),
                                 hbm_bandwidth=max(self.gpu.hbm_bandwidth, eff_bw))
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


def swap_bytes_ratio(compression: str | None, head_dim: int, kv_format: str | KVFormat = "fp16",
                     block_size: int = 16) -> float:
    """Host bytes / device bytes of a swapped block (``paged.engine.swap_codec``'s layouts):
    ``fp8`` = e4m3 codes + one float32 scale per (block, head); ``int4`` = packed codes + fp16
    scale and zero per group of ``int4_group(head_dim)``; None = 1. A device cache that is already
    quantized is not compressed again (the engine refuses it; here the ratio is 1)."""
    if compression is None:
        return 1.0
    if compression not in ("fp8", "int4"):
        raise ConfigError(f"swap_compression must be None, 'fp8' or 'int4', got {compression!r}")
    from kernels.format_table import bytes_per_token, int4_group, lookup
    fmt = lookup(kv_format.name if isinstance(kv_format, KVFormat) else kv_format)
    if fmt.quantized:
        return 1.0
    device = bytes_per_token(fmt, 1, head_dim) / 2  # per token-head, K or V
    host = head_dim + 4 / block_size if compression == "fp8" else head_dim / 2 + 4 * (head_dim // int4_group(head_dim))
    return host / device


# (block size, achieved share of the contiguous kernel's bandwidth), from flash-attention PR 2468
# as summarised in ANCHORS.md: page 1 reached 0.87 of 4.0 TB/s at page 128; pages of 16 / 64
# cost 24% / 17%; pages of 128 cost < 1%.
_PAGE_EFFICIENCY = ((1, 0.87 / 4.0), (16, 1 / 1.24), (64, 1 / 1.17), (128, 0.99), (1 << 20, 0.99))


def paged_attention_efficiency(block_size: int) -> float:
    """Bandwidth of a paged attention kernel relative to a contiguous one (interpolated in log2)."""
    if block_size < 1:
        raise ConfigError(f"block_size must be >= 1, got {block_size}")
    xs = np.log2([b for b, _ in _PAGE_EFFICIENCY])
    ys = [e for _, e in _PAGE_EFFICIENCY]
    return float(np.interp(np.log2(block_size), xs, ys))


def step_shape(chunks: Sequence[Any], num_swapped_blocks: int = 0, num_copied_blocks: int = 0,
               block_bytes: float = 0.0) -> StepShape:
    """The ``StepShape`` of one step from its chunks (anything with ``num_tokens``, ``start``,
    ``samples``: the scheduler's ``ScheduledChunk`` or the engine's ``ChunkInfo``); swapped and
    copied blocks are priced at ``block_bytes`` each. The simulator and ``shapes_from_steps``
    both build shapes here."""
    return StepShape(np.array([c.num_tokens for c in chunks], dtype=np.float64),
                     np.array([c.start for c in chunks], dtype=np.float64),
                     [c.samples for c in chunks].count(True), num_swapped_blocks * block_bytes,
                     num_copied_blocks * block_bytes)


def plan_shape(work: Sequence[Any], num_swapped_blocks: int = 0, num_copied_blocks: int = 0,
               block_bytes: float = 0.0) -> StepShape:
    """``step_shape`` of a scheduler plan's ``work`` (chunks and ``DecodeRun``s, in order) without
    unrolling the decode runs: the simulator's hot path. The same shape as
    ``step_shape(plan.scheduled, ...)``."""
    q: list[float] = []
    ctx: list[int] = []
    sampled = 0
    for w in work:
        if w.__class__ is DecodeRun:
            n = len(w.starts)
            q += [1.0] * n
            ctx += w.starts
            sampled += n
        else:
            q.append(w.num_tokens)
            ctx.append(w.start)
            sampled += w.samples
    return StepShape(np.array(q, dtype=np.float64), np.array(ctx, dtype=np.float64), sampled,
                     num_swapped_blocks * block_bytes, num_copied_blocks * block_bytes)


def shapes_from_steps(steps: Iterable[Any], block_bytes: float = 0.0,
                      time_field: str = "total_ms") -> tuple[list[StepShape], np.ndarray]:
    """Engine step records -> (``StepShape`` list, seconds) for ``CostModel.fit``.

    Each record (an engine ``StepOutput``) needs ``scheduled`` (chunks with ``start``, ``num_tokens``,
    ``samples``), ``num_swapped_out_blocks``, ``num_swapped_in_blocks``, ``num_block_copies`` and a
    time in milliseconds (``time_field``; ``total_ms`` of ``paged.engine.StepOutput`` covers
    scheduling, cache ops, forward and sampling, which is what ``step_time`` predicts). Steps that
    scheduled nothing are skipped. ``block_bytes`` prices swapped/copied blocks (see ``step_shape``).
    """
    shapes: list[StepShape] = []
    secs: list[float] = []
    for st in steps:
        chunks = list(st.scheduled)
        if not chunks:
            continue
        shapes.append(step_shape(chunks, st.num_swapped_out_blocks + st.num_swapped_in_blocks,
                                 st.num_block_copies, block_bytes))
        secs.append(float(getattr(st, time_field)) * 1e-3)
    return shapes, np.asarray(secs)


def calibration_frame(steps: Iterable[Any], time_field: str = "total_ms") -> "pd.DataFrame":
    """Engine step records -> tidy DataFrame, one row per chunk (``step, start, num_tokens, samples,
    seconds``), to save measurements and fit later (``shapes_from_frame``). Unlike
    ``paged.telemetry.steps_frame`` (one row per step) it keeps each chunk's shape."""
    import pandas as pd

    rows = [(i, c.start, c.num_tokens, bool(c.samples), float(getattr(st, time_field)) * 1e-3)
            for i, st in enumerate(steps) for c in st.scheduled]
    return pd.DataFrame(rows, columns=["step", "start", "num_tokens", "samples", "seconds"])


def read_calibration(path: str) -> "pd.DataFrame":
    """The calibration CSV (``calibration_frame(...).to_csv``), or a ConfigError naming the file."""
    import os

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


__all__ = ["StepShape", "StepBreakdown", "CostModel", "FitReport", "paged_attention_efficiency", "swap_bytes_ratio",
           "step_shape", "plan_shape", "shapes_from_steps", "calibration_frame", "read_calibration",
           "shapes_from_frame"]
