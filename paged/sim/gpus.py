"""GPU presets: the peak figures of each accelerator the cost model and the sizing read (datasheet values)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from paged.errors import ConfigError

__all__ = ["GiB", "MiB", "GPUSpec", "GPU_PRESETS", "get_gpu", "preset_key"]

GiB = 1024**3
MiB = 1024**2


def preset_key(name: str) -> str:
    """A preset name as the preset tables spell it (lower case, dashes): GPUs here, models in specs."""
    return name.lower().replace("_", "-").replace(" ", "-")


@dataclass(frozen=True, slots=True)
class GPUSpec:
    """Peak figures of one accelerator (datasheet values)."""

    name: str
    peak_flops: float  # dense FP16/BF16 tensor-core FLOP/s
    hbm_bytes: float
    hbm_bandwidth: float  # bytes/s
    pcie_bandwidth: float  # bytes/s, host<->device, one direction
    interconnect_bandwidth: float = 0.0  # bytes/s per GPU for all-reduce (NVLink); 0 = PCIe

    def with_(self, **kw: Any) -> "GPUSpec":
        return replace(self, **kw)


GPU_PRESETS: dict[str, GPUSpec] = {
    g.name: g
    for g in (
        GPUSpec("a100-40gb", 312e12, 40 * GiB, 1555e9, 32e9, 300e9),
        GPUSpec("a100-80gb", 312e12, 80 * GiB, 2039e9, 32e9, 300e9),
        GPUSpec("h100-sxm", 989e12, 80 * GiB, 3352e9, 64e9, 450e9),
        # "141 GB" on the datasheet is the driver's 143,771 MiB (140.4 GiB), not 141e9 bytes (131 GiB).
        GPUSpec("h200", 989e12, 143771 * MiB, 4.8e12, 64e9, 450e9),
        GPUSpec("l4", 121e12, 24e9, 300e9, 32e9, 0.0),
        # A40 datasheet: 149.7 TFLOP/s dense FP16 tensor, 48 GB GDDR6 at 696 GB/s (the datasheet's 48 GB, not
        # checked against nvidia-smi), PCIe 4.0, NVLink bridge 112.5 GB/s both ways (vidur profiled it).
        GPUSpec("a40", 149.7e12, 48e9, 696e9, 32e9, 56e9),
        # Not a GPU: a rough starting point for calibrating on a CPU (CostModel.fit replaces the rates).
        GPUSpec("cpu", 2e11, 128 * GiB, 20e9, 20e9, 0.0),
    )
}


def get_gpu(name: str | GPUSpec) -> GPUSpec:
    """A preset by its name (case-insensitive). A name that fits several presets (``"a100"``:
    40 or 80 GB) is refused, naming them: a silent pick would size a different pool."""
    if isinstance(name, GPUSpec):
        return name
    key = preset_key(name) if isinstance(name, str) else name
    if key in GPU_PRESETS:
        return GPU_PRESETS[key]
    fits = [g for g in GPU_PRESETS if isinstance(key, str) and key and g.startswith(key)]
    if len(fits) == 1:
        raise ConfigError(f"unknown GPU {name!r}; did you mean {fits[0]!r}? (presets: {', '.join(GPU_PRESETS)})")
    if fits:
        raise ConfigError(f"GPU {name!r} is ambiguous: it may be {' or '.join(map(repr, fits))}, whose memory "
                          f"differs; name one")
    raise ConfigError(f"unknown GPU {name!r}; choose one of {', '.join(GPU_PRESETS)}")
