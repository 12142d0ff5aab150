"""Roofline step-time model for a model/GPU preset (its calibration: :mod:`paged.sim.calibration`).

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
random forests on profiles (<9% error claimed). ``CostModel.fit`` calibrates its constants to
measured steps (:mod:`paged.sim.calibration`); a step's shape is :class:`paged.sim.shapes.StepShape`.

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

``linear`` replaces the weights part ``max(F_lin / P, B_w / W)`` (opt-in; None keeps the closed
form, bit for bit): ``"kernels"`` prices each layer's GEMMs and element-wise kernels with floors,
tile rounding and measured rates (:mod:`paged.sim.kernel_costs`, figures per GPU fitted to vidur's
profiles), a :class:`paged.sim.profiles.VidurProfile` reads measured layer times; either way the
step's linear part is ``layers x layer_seconds(T)`` plus the LM head on the closed form, and
``mfu``/``mbu`` still price attention. See docs/cost_model.md for the validation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol, Sequence

import numpy as np

from kernels.format_table import bytes_per_token, int4_group, lookup
from paged.errors import ConfigError
from paged.sim import calibration
# the calibration's and the shapes' public names stay importable from here (for now)
from paged.sim.calibration import FitReport, calibration_frame, read_calibration, shapes_from_frame, shapes_from_steps
from paged.sim.kernel_costs import KernelRoofline
from paged.sim.shapes import StepShape, plan_shape, step_shape
from paged.sim.specs import GPUSpec, KVFormat, ModelSpec, get_gpu, get_model


class LayerTimes(Protocol):
    """Measured or modelled seconds of one layer's linear and element-wise kernels for T tokens."""

    def layer_seconds(self, num_tokens: np.ndarray | float) -> np.ndarray: ...


@dataclass(frozen=True, slots=True)
class StepBreakdown:
    total: float
    overhead: float
    linear: float
    attention: float
    comm: float
    swap: float


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
    linear: Any = None  # None (closed form) | "kernels" | a LayerTimes (e.g. paged.sim.profiles.VidurProfile)
    # derived constants (filled in __post_init__)
    _kv_bytes: float = field(init=False, default=0.0)
    _attn_flops_per_tok: float = field(init=False, default=0.0)
    _lin_flops_per_tok: float = field(init=False, default=0.0)
    _head_flops_per_tok: float = field(init=False, default=0.0)
    _weight_bytes: float = field(init=False, default=0.0)
    _swap_ratio: float = field(init=False, default=1.0)
    _layers: Any = field(init=False, default=None)

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
        self._layers = self._layer_times()

    def _layer_times(self) -> LayerTimes | None:
        if self.linear is None:
            return None
        if isinstance(self.linear, str):
            if self.linear != "kernels":
                raise ConfigError(f"linear must be None, 'kernels' or a profile, got {self.linear!r}")
            return KernelRoofline(self.model, self.gpu, self.tensor_parallel)
        if not hasattr(self.linear, "layer_seconds"):
            raise ConfigError(f"linear={self.linear!r} has no layer_seconds(num_tokens); pass 'kernels' or a "
                              "paged.sim.profiles.VidurProfile")
        tp = getattr(self.linear, "tensor_parallel", self.tensor_parallel)
        if tp != self.tensor_parallel:
            raise ConfigError(f"the profile was read for tensor parallel {tp}, the model runs at {self.tensor_parallel}")
        return self.linear

    def linear_seconds(self, num_tokens: float, num_sampled: int) -> float:
        """Seconds of the step's weights part: matmuls (and, with ``linear``, element-wise kernels) + LM head."""
        P, W = self.effective_flops, self.effective_bandwidth
        if self._layers is None:
            f = num_tokens * self._lin_flops_per_tok + num_sampled * self._head_flops_per_tok
            return float(max(f / P, self._weight_bytes / W))
        t = self.model.num_layers * float(self._layers.layer_seconds(float(num_tokens)))
        if num_sampled:
            m = self.model
            t += max(num_sampled * self._head_flops_per_tok / P, m.lm_head_params * m.dtype_bytes / self.tensor_parallel / W)
        return t

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
    def roofline_parts(self, s: StepShape) -> tuple[np.ndarray, np.ndarray]:
        """FLOPs and bytes of each roofline part: [linear, chunk_0, chunk_1, ...]."""
        f = np.empty(len(s.q) + 1)
        b = np.empty(len(s.q) + 1)
        f[0] = float(s.q.sum()) * self._lin_flops_per_tok + s.num_sampled * self._head_flops_per_tok
        b[0] = self._weight_bytes
        f[1:] = self._attn_flops_per_tok * s.q * (s.ctx + (s.q + 1.0) * 0.5)
        b[1:] = (s.ctx + s.q) * self._kv_bytes
        return f, b

    def comm_seconds(self, s: StepShape) -> float:
        """Seconds of the step's tensor-parallel all-reduces (0 on one GPU)."""
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

    def transfer_seconds(self, s: StepShape) -> float:
        """Swap and copy seconds when nothing overlaps (what adds to the forward without overlap)."""
        return self._link(s) + (2 * s.copy_bytes / self.effective_bandwidth if s.copy_bytes else 0.0)

    def _with_swap(self, gpu: float, s: StepShape) -> float:
        """The forward's GPU seconds ``gpu`` combined with the step's swaps and copies."""
        if not self.swap_overlap or not s.swap_bytes:
            return gpu + self.transfer_seconds(s)
        x = self._link(s)
        return max(gpu, x) + min(gpu, x) / self.model.num_layers + 2 * s.copy_bytes / self.effective_bandwidth

    # -- prediction -----------------------------------------------------------------------------
    def breakdown(self, s: StepShape) -> StepBreakdown:
        f, b = self.roofline_parts(s)
        P, W = self.effective_flops, self.effective_bandwidth
        lin = self.linear_seconds(float(s.q.sum()), s.num_sampled)
        attn = float(np.maximum(f[1:] / P, b[1:] / W).sum())
        ovh = self.step_overhead_s + self.per_seq_s * s.num_seqs + self.per_token_s * float(s.q.sum())
        comm = self.comm_seconds(s)
        swap = self._with_swap(lin + attn + comm, s) - (lin + attn + comm)  # exposed (not hidden) swap time
        return StepBreakdown(float(ovh + lin + attn + comm + swap), ovh, lin, attn, comm, swap)

    def step_time(self, s: StepShape) -> float:
        """Predicted seconds for one step (hot path of the simulator)."""
        if len(s.q) == 0:
            return self.transfer_seconds(s) + (self.step_overhead_s if s.swap_bytes else 0.0)
        if s.swap_bytes and self.swap_overlap:
            return self.breakdown(s).total
        P, W = self.effective_flops, self.effective_bandwidth
        q, c = s.q, s.ctx
        T = float(q.sum())
        t = self.linear_seconds(T, s.num_sampled)
        f = self._attn_flops_per_tok / P * q * (c + (q + 1.0) * 0.5)
        t += float(np.maximum(f, (self._kv_bytes / W) * (c + q)).sum())
        t += self.step_overhead_s + self.per_seq_s * len(q) + self.per_token_s * T
        if self.tensor_parallel > 1:
            t += self.comm_seconds(s)
        if s.swap_bytes or s.copy_bytes:
            t += self.transfer_seconds(s)
        return t

    def decode_run_times(self, ctx: Sequence[int], k: int) -> np.ndarray:
        """``step_time`` of ``k`` consecutive all-decode steps (one sampling token per sequence, no
        swaps or copies) whose contexts start at ``ctx`` and grow by one a step, bit for bit: the
        same operations in the same order, step by step (the attention sum accumulated left to
        right, as numpy sums fewer than 8 terms; from 8 sequences on, each step's row summed by numpy)."""
        n = len(ctx)
        q = np.ones(n)
        T = float(q.sum())
        P, W = self.effective_flops, self.effective_bandwidth
        c = np.asarray(ctx, dtype=np.float64)[None, :] + np.arange(k, dtype=np.float64)[:, None]
        f = self._attn_flops_per_tok / P * q * (c + (q + 1.0) * 0.5)
        m = np.maximum(f, (self._kv_bytes / W) * (c + q))
        if n < 8:
            attn = m[:, 0].copy()
            for j in range(1, n):
                attn += m[:, j]
        else:   # a row-wise reduction: numpy's pairwise sum over each contiguous row, as row.sum()
            attn = m.sum(axis=1)
        t = self.linear_seconds(T, n) + attn
        t += self.step_overhead_s + self.per_seq_s * n + self.per_token_s * T
        if self.tensor_parallel > 1:
            t += self.comm_seconds(StepShape(q, q, n, 0.0, 0.0))
        return t

    def predict(self, shapes: Iterable[StepShape]) -> np.ndarray:
        return np.array([self.step_time(s) for s in shapes])

    # -- calibration ----------------------------------------------------------------------------
    def fit(self, shapes: Sequence[StepShape], seconds: Sequence[float], holdout_fraction: float = 0.25,
            seed: int = 0) -> FitReport:
        """This model calibrated to measured steps: :func:`paged.sim.calibration.fit` (closed form only)."""
        if self.linear is not None:
            raise ConfigError("fit calibrates the closed-form roofline; build the CostModel with linear=None "
                              "(a measured linear part needs no fit)")
        return calibration.fit(self, shapes, seconds, holdout_fraction, seed)


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
    sizes, shares = zip(*_PAGE_EFFICIENCY)
    return float(np.interp(np.log2(block_size), np.log2(sizes), shares))


__all__ = ["StepShape", "StepBreakdown", "CostModel", "LayerTimes", "FitReport", "paged_attention_efficiency", "swap_bytes_ratio",
           "step_shape", "plan_shape", "shapes_from_steps", "calibration_frame", "read_calibration",
           "shapes_from_frame"]
