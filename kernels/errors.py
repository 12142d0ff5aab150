"""Exception types raised by :mod:`kernels`.

Every message says what to change. All of them derive from :class:`KernelError`, which is a
``ValueError`` so that callers validating user input can catch either.
"""

from __future__ import annotations

__all__ = ["KernelError", "KVFormatError", "ShapeError", "BackendUnavailableError", "StagingExhaustedError"]


class KernelError(ValueError):
    """Base class of every error raised for bad input to a kernel entry point."""


class KVFormatError(KernelError):
    """An unknown KV format name, or tensors whose dtype does not fit the format."""


class ShapeError(KernelError):
    """A tensor has the wrong shape, dtype, device or memory layout."""


class BackendUnavailableError(KernelError, RuntimeError):
    """The requested backend cannot run here (no triton, no GPU, interpreter not enabled)."""


class StagingExhaustedError(KernelError, RuntimeError):
    """An ``int4_kivi`` layer has no free staging slot for a block that is not full yet.

    Raised before anything is changed: the layer's state is as it was before the call.
    """
