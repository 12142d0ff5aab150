"""Linear layers with a oneDNN-blocked copy of the weight on CPU (float32 inference).

Small-batch float32 GEMMs (a decode step multiplies 1-64 rows by each weight) are compute-bound
here, and MKL's ``sgemm`` on a row-major ``[out, in]`` weight reaches ~40% of the FMA peak at 16
rows. oneDNN's inner-product on a weight reordered once into its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, as PyTorch's CPU freezing pass) is faster: a SmolLM2
decode step at batch 16 costs 0.75x transformers' CPU time with it, 0.90x with plain ``F.linear``
(``benchmarks/engine_step.py --unpacked``; README, Speed); and a row's result does not depend on how
many rows share the call (batch-invariant, ``tests/test_packed_linear.py``), so greedy outputs do not
depend on the batch. Results differ from ``F.linear`` only by float32 summation order (~1e-6).

Invariants: the packed copy is rebuilt whenever the weight changes (storage, ``Tensor._version``,
dtype); anything else (autograd, GPU, non-float32, non-2-D input) goes through ``F.linear``. Costs one
extra copy of each weight in host memory. ``ENABLED = False`` turns it off process-wide.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ENABLED = True  # process-wide switch (tests and benchmarks compare both paths)
_BATCH_HINT = 64  # oneDNN picks the blocking from it; 16..256 measured alike for 1..512 rows


def available() -> bool:
    """Whether this torch build has the oneDNN CPU inner-product ops."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") \
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")


_AVAILABLE = available()


class PackCache:
    """One weight's packed copy and the identity (storage, version, dtype) it was built from."""

    __slots__ = ("key", "packed")

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.packed: torch.Tensor | None = None

    def get(self, w: torch.Tensor) -> torch.Tensor:
        key = (w.data_ptr(), w._version, w.dtype, tuple(w.shape))
        if key != self.key:
            with torch.inference_mode():
                self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), _BATCH_HINT)
            self.key = key
        return self.packed


def usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """The packed path applies: enabled, CPU float32, 2-D input, no autograd."""
    return ENABLED and _AVAILABLE and x.dim() == 2 and x.dtype == torch.float32 and w.dtype == torch.float32 \
        and x.device.type == "cpu" and w.device.type == "cpu" and not (torch.is_grad_enabled() and w.requires_grad)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, cache: PackCache) -> torch.Tensor:
    """``F.linear(x, w, bias)``, through the packed weight where :func:`usable`."""
    if not usable(x, w) or x.shape[0] == 0:
        return F.linear(x, w, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), cache.get(w), bias, "none", [], "")


class PackedLinear(nn.Linear):
    """``nn.Linear`` (same parameters and state-dict keys) that multiplies through a packed
    copy of its weight where :func:`usable`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._pack = PackCache()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self._pack)
