"""``SimConfig``: everything a simulated deployment needs besides its trace.

Every ``CacheConfig`` and ``SchedulerConfig`` knob (shared with the engine; see
``paged.core.config.ExecutorConfig``), plus the deployment (model and GPU presets, tensor
parallelism, the share of GPU memory vLLM would use, the allocator) and the cost model's knobs:
``SimConfig(block_size=32, model="llama-2-7b")``, read flat or by part (``config.cache``).

Simulator defaults of derived settings: without ``num_blocks`` or ``kv_cache_memory_bytes`` the
pool is what fits in ``gpu_memory_utilization`` of the GPU after weights and activations (as vLLM
sizes it); the CPU pool is ``swap_space_gib`` GiB per GPU, 4 when unset (vLLM's default); 'auto'
KV format is the model's dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paged.checks import need_flag, need_int, need_real
from paged.core.config import ExecutorConfig
from paged.errors import ConfigError
from paged.sim.cost_model import CostModel
from paged.sim.kernel_costs import KERNEL_COSTS
from paged.sim.specs import KVFormat, ModelSpec, get_gpu

__all__ = ["ALLOCATORS", "DEFAULT_SWAP_SPACE_GIB", "LINEAR_MODELS", "SimConfig", "build_cost_model"]

ALLOCATORS = ("contiguous-max", "contiguous-pow2", "contiguous-oracle", "paged")  # as the vLLM paper draws them
LINEAR_MODELS = ("kernels",)
"""``SimConfig.linear``: how the weights part is priced besides the closed form (None; see ``paged.sim.kernel_costs``)."""
DEFAULT_SWAP_SPACE_GIB = 4.0
"""The CPU pool per GPU (swap preemption and the host tier) when neither num_cpu_blocks nor swap_space_gib is given."""


def _error(msg: str) -> ConfigError:
    return ConfigError(f"SimConfig: {msg}")


@dataclass(frozen=True, kw_only=True)
class SimConfig(ExecutorConfig):
    """A simulated deployment (see the module docstring). ``paged_kernel_penalty``: slow KV reads
    for small blocks (see ``paged.sim.cost_model``); ``mfu``/``mbu``/``step_overhead_s``: cost
    model overrides; ``calibration``: a CSV from ``cost_model.calibration_frame`` to fit the cost
    model to; ``linear``: None (the closed-form weights part) or one of ``LINEAR_MODELS``
    (``"kernels"``: per-kernel floors, tiles and measured rates, GPUs with ``KERNEL_COSTS`` only);
    ``prompt_seed``: the synthetic prompts' token ids (a trace's arrivals and lengths
have their own ``trace_seed``, see ``paged.sim.workload``)."""

    model: str = "llama-2-13b"
    gpu: str = "a100-80gb"
    tensor_parallel: int = 1
    gpu_memory_utilization: float = 0.9
    allocator: str = "paged"
    paged_kernel_penalty: bool = True
    mfu: float | None = None
    mbu: float | None = None
    step_overhead_s: float | None = None
    calibration: str | None = None
    linear: str | None = None
    prompt_seed: int = 0
    record_events: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 - frozen
        if self.allocator not in ALLOCATORS:
            raise _error(f"allocator must be one of {ALLOCATORS}, got {self.allocator!r}")
        put("gpu", get_gpu(self.gpu).name)  # the preset's own name, echoed in every summary
        put("tensor_parallel", need_int("tensor_parallel", self.tensor_parallel, _error, minimum=1))
        put("prompt_seed", need_int("prompt_seed", self.prompt_seed, _error))
        put("gpu_memory_utilization", need_real("gpu_memory_utilization", self.gpu_memory_utilization, _error,
                                                minimum=0.0, maximum=1.0, open_min=True))
        put("step_overhead_s", need_real("step_overhead_s", self.step_overhead_s, _error, minimum=0.0,
                                         optional=True))
        if self.linear is not None:
            if self.linear not in LINEAR_MODELS:
                raise _error(f"linear must be None (the closed form) or one of {LINEAR_MODELS}, got {self.linear!r}")
            if self.gpu not in KERNEL_COSTS:
                raise _error(f"linear={self.linear!r} has measured kernel figures for {sorted(KERNEL_COSTS)} only, "
                             f"not gpu={self.gpu!r}; choose one of those GPUs or leave linear unset")
            if self.calibration is not None:
                raise _error("calibration fits the closed-form roofline; leave linear unset to calibrate, "
                             "or drop calibration to use the measured kernel model")
        for name in ("paged_kernel_penalty", "record_events"):
            need_flag(name, getattr(self, name), _error)


def build_cost_model(cfg: SimConfig, model: ModelSpec, kv_format: KVFormat | str | None = None) -> CostModel:
    """The cost model of ``cfg`` for ``model`` (``kv_format``: the resolved format, default the config's)."""
    kw: dict[str, Any] = {k: getattr(cfg, k) for k in ("mfu", "mbu", "step_overhead_s")
                          if getattr(cfg, k) is not None}
    bs = cfg.block_size if (cfg.allocator == "paged" and cfg.paged_kernel_penalty) else None
    return CostModel(model, get_gpu(cfg.gpu), tensor_parallel=cfg.tensor_parallel,
                     kv_format=kv_format if kv_format is not None else cfg.kv_cache_dtype, kv_block_size=bs,
                     swap_overlap=cfg.swap_mode == "overlap", swap_compression=cfg.swap_compression, linear=cfg.linear, **kw)
