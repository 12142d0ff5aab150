"""Per-kernel roofline of a decoder layer's linear and element-wise work (opt-in in ``CostModel``).

The closed-form roofline prices all weights of the model as one matmul: ``max(F / P, B / W)``.
Held against vidur's measured operator profiles (``paged.sim.cost_validation``) that misses what
real kernels do at small shapes: every kernel costs a few microseconds however little it does,
a GEMM's rows are computed in whole tiles (wave quantisation: 129 tokens cost like 256), near the
ridge point compute and memory traffic do not overlap perfectly, and the element-wise kernels
(RMSNorm, residual add, RoPE, SiLU-and-mul) read and write activations at well below peak bandwidth.

Per layer and GPU, with ``M`` tokens, each of the four GEMMs (QKV, O, gate+up, down: ``K x N``
weights split over tensor parallel ``tp``) costs

    t_gemm = gemm_floor + ( (F_q / P)^p + (B / W)^p )^(1/p)
    F_q = 2 x ceil(M / tile(M)) x tile(M) x K x N,   B = 2 bytes x (K N + M K + M N)

with ``P = peak x gemm_mfu``, ``W = hbm x gemm_mbu`` and ``tile(M)`` the row tile for ``M`` tokens
(``m_tiles``); each of the five element-wise kernels costs ``ew_floor + bytes / (hbm x ew_mbu)``.
The sum is exactly what vidur's ``mlp.csv`` measures per layer (its columns ``attn_pre_proj``,
``attn_post_proj``, ``mlp_up_proj``, ``mlp_down_proj``, ``mlp_act``, ``input_layernorm``,
``post_attention_layernorm``, ``add``, ``attn_rope``; CUDA time of each kernel, no host launch
gap).

Invariants: every kernel costs at least its floor; the time is non-decreasing in ``M`` between
tile boundaries; with ``p -> inf``, no floors, ``m_tiles = ((0, 1),)`` and no element-wise work
it is the closed-form roofline of each matmul.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from paged.errors import ConfigError
from paged.sim.specs import GPUSpec, ModelSpec, get_gpu, get_model

__all__ = ["KernelCosts", "KERNEL_COSTS", "get_kernel_costs", "KernelRoofline"]


@dataclass(frozen=True, slots=True)
class KernelCosts:
    """Achieved-rate figures of one GPU's kernels (see module docstring); ``source`` says where they come from."""

    gemm_floor_s: float
    gemm_mfu: float
    gemm_mbu: float
    ridge_p: float  # p-norm of compute and memory time: large = perfect overlap (max), 1 = none (sum)
    m_tiles: tuple[tuple[int, int], ...]  # (above this many tokens, row tile): the GEMM tile for M rows
    ew_floor_s: float
    ew_mbu: float
    source: str = ""

    def __post_init__(self) -> None:
        if not (0 < self.gemm_mfu <= 1 and 0 < self.gemm_mbu <= 1 and 0 < self.ew_mbu <= 1):
            raise ConfigError(f"KernelCosts rates must lie in (0, 1], got mfu={self.gemm_mfu}, "
                              f"mbu={self.gemm_mbu}, ew_mbu={self.ew_mbu}")
        if self.gemm_floor_s < 0 or self.ew_floor_s < 0 or self.ridge_p < 1:
            raise ConfigError("KernelCosts floors must be >= 0 and ridge_p >= 1")
        if not self.m_tiles or self.m_tiles[0][0] != 0 or any(t < 1 for _, t in self.m_tiles) \
                or any(a[0] >= b[0] for a, b in zip(self.m_tiles, self.m_tiles[1:])):
            raise ConfigError(f"m_tiles must start at (0, tile) with rising thresholds and tiles >= 1, "
                              f"got {self.m_tiles}")

    def with_(self, **kw: Any) -> "KernelCosts":
        return replace(self, **kw)

    def tile(self, m: np.ndarray) -> np.ndarray:
        """Row tile used for ``m`` tokens."""
        t = np.full(np.shape(m), float(self.m_tiles[0][1]))
        for above, tile in self.m_tiles[1:]:
            t = np.where(m > above, float(tile), t)
        return t


_VIDUR = ("fitted by `python benchmarks/cost_validation.py --vidur DIR --refit` to vidur's measured operator "
          "profiles (microsoft/vidur, MIT: data/profiling/compute/{gpu}/meta-llama/Llama-2-{{7b,70b}}-hf/mlp.csv, "
          "per-layer CUDA-time medians, tensor parallel 1-8, 1-4,096 tokens)")

# Per GPU preset, fitted on Llama-2-7B and -70B; vidur's other models on the same GPU are the held-out check.
KERNEL_COSTS: dict[str, KernelCosts] = {
    "a100-80gb": KernelCosts(7e-6, 0.74, 0.86, 2.0, ((0, 64), (256, 128)), 3e-6, 0.55, _VIDUR.format(gpu="a100")),
    "h100-sxm": KernelCosts(6e-6, 0.74, 0.90, 2.0, ((0, 128), (512, 256)), 1.5e-6, 0.50, _VIDUR.format(gpu="h100")),
    "a40": KernelCosts(4e-6, 0.80, 0.80, 2.0, ((0, 64),), 3e-6, 0.45, _VIDUR.format(gpu="a40")),
}


def get_kernel_costs(gpu: str | GPUSpec | KernelCosts) -> KernelCosts:
    """The measured figures of a GPU preset, or a ConfigError naming the presets that have them."""
    if isinstance(gpu, KernelCosts):
        return gpu
    name = get_gpu(gpu).name
    if name not in KERNEL_COSTS:
        raise ConfigError(f"no measured kernel figures for GPU {name!r} (have {sorted(KERNEL_COSTS)}); "
                          "pass kernel_costs=KernelCosts(...) or a profile (paged.sim.profiles)")
    return KERNEL_COSTS[name]


class KernelRoofline:
    """Seconds of the linear and element-wise kernels of ``model`` on one of ``tp`` GPUs."""

    __slots__ = ("model", "gpu", "tp", "costs", "_gemms", "_ew_bytes_per_token")

    def __init__(self, model: ModelSpec | str, gpu: GPUSpec | str, tp: int = 1,
                 costs: KernelCosts | str | None = None) -> None:
        self.model, self.gpu, self.tp = get_model(model), get_gpu(gpu), tp
        self.model.check_tensor_parallel(tp)
        self.costs = get_kernel_costs(self.gpu if costs is None else costs)
        m = self.model
        h, d, i = m.hidden_size, m.head_dim, m.intermediate_size
        q_heads, kv_heads = m.num_heads / tp, max(1, m.num_kv_heads // tp) if tp > 1 else m.num_kv_heads
        # (K, N) of QKV, O, gate+up, down on one GPU
        self._gemms = ((h, (q_heads + 2 * kv_heads) * d), (q_heads * d, h), (h, 2 * i / tp), (i / tp, h))
        b = m.dtype_bytes
        # bytes per token: 2 RMSNorms (read + write h), residual add (2 reads + 1 write), RoPE on q and k
        # (read + write), SiLU-and-mul (read 2 i/tp, write i/tp)
        self._ew_bytes_per_token = b * (2 * 2 * h + 3 * h + 2 * (q_heads + kv_heads) * d + 3 * i / tp)

    def _gemm(self, m: np.ndarray, k: float, n: float) -> np.ndarray:
        c, g = self.costs, self.gpu
        mq = np.ceil(m / c.tile(m)) * c.tile(m)
        tf = 2.0 * mq * k * n / (g.peak_flops * c.gemm_mfu)
        tb = self.model.dtype_bytes * (k * n + m * k + m * n) / (g.hbm_bandwidth * c.gemm_mbu)
        hi, lo = np.maximum(tf, tb), np.minimum(tf, tb)  # p-norm as hi x (1 + (lo/hi)^p)^(1/p): no underflow
        return c.gemm_floor_s + hi * (1.0 + (lo / hi) ** c.ridge_p) ** (1.0 / c.ridge_p)

    def layer_seconds(self, num_tokens: np.ndarray | float) -> np.ndarray:
        """One layer's GEMM and element-wise seconds for each entry of ``num_tokens`` (what vidur's
        mlp.csv measures per row)."""
        m = np.asarray(num_tokens, dtype=np.float64)
        c = self.costs
        t = sum(self._gemm(m, k, n) for k, n in self._gemms)
        ew = 5 * c.ew_floor_s + m * self._ew_bytes_per_token / (self.gpu.hbm_bandwidth * c.ew_mbu)
        return np.where(m > 0, t + ew, 0.0)
