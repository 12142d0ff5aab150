"""Backend selection, in one place.

=============== ==========================================================================
backend         when
=============== ==========================================================================
``"triton"``    compiled Triton kernels on CUDA tensors (default on a GPU)
``"interpreter"`` the same Triton kernels run by Triton's interpreter on CPU tensors; needs
                ``TRITON_INTERPRET=1`` in the environment before :mod:`kernels` first runs a
                Triton kernel (tests set it in ``tests/conftest.py``). Default on CPU when set.
``"native"``    the compiled CPU kernels (:mod:`kernels.native`) where they take the layer
                (decode attention over every served format), the torch references otherwise;
                the engine's default on CPU when the kernels build (``PAGED_NATIVE=0`` turns them off)
``"torch"``     plain-torch references (default on CPU otherwise; the oracle)
=============== ==========================================================================

``backend=None`` or ``"auto"`` picks the default for the tensors' device. Asking for a backend that
cannot run raises :class:`~kernels.errors.BackendUnavailableError`.

Triton is imported lazily: ``import kernels`` works (and stays cheap) without it. The kernels
never use hardware fp8 conversions (fp8 is encoded and decoded with integer bit operations), so
fp8 e4m3 runs on GPUs before compute capability 8.9 (A100) with the same kernel.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys

import torch

from .errors import BackendUnavailableError

__all__ = ["BACKENDS", "resolve_backend", "triton_available", "interpreter_enabled"]

BACKENDS = ("triton", "interpreter", "native", "torch")


@functools.cache
def triton_available() -> bool:
    """Whether the ``triton`` package can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # e.g. sys.modules["triton"] = None
        return False


def interpreter_enabled() -> bool:
    """Whether Triton kernels defined now would run in the interpreter.

    Once our Triton module is imported, its mode is fixed: we report that mode from then on.
    """
    mod = sys.modules.get(__package__ + ".triton_impl.common")
    if mod is not None:
        return mod.INTERPRETED
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(requested: str | None, device: torch.device) -> str:
    """Pick the backend for tensors on ``device``; raise if ``requested`` cannot run here."""
    req = "auto" if requested is None else str(requested).lower()
    if req not in BACKENDS + ("auto",):
        names = ", ".join(map(repr, BACKENDS))
        raise BackendUnavailableError(f"unknown backend {requested!r}; use one of 'auto', {names}")
    on_cuda = device.type == "cuda"
    if req == "auto":
        if triton_available() and on_cuda and not interpreter_enabled():
            return "triton"
        if triton_available() and device.type == "cpu" and interpreter_enabled():
            return "interpreter"
        return "torch"
    if req == "torch":
        return req
    if req == "native":
        from . import native
        if device.type != "cpu":
            raise BackendUnavailableError(f"backend 'native' runs on CPU tensors, got {device}; use 'triton' on a GPU")
        if not native.available():
            raise BackendUnavailableError(f"backend 'native' is unavailable: {native.unavailable_reason()}; "
                                          f"use backend='torch'")
        return req
    if not triton_available():
        raise BackendUnavailableError(f"backend {req!r} needs the 'triton' package; pip install triton, "
                                      f"or use backend='torch'")
    if req == "triton":
        if not on_cuda:
            raise BackendUnavailableError(f"backend 'triton' needs CUDA tensors, got {device}; move the tensors "
                                          f"to a GPU, or use backend='interpreter' (TRITON_INTERPRET=1) or 'torch'")
        if interpreter_enabled():
            raise BackendUnavailableError("backend 'triton' was requested but TRITON_INTERPRET=1 is set; "
                                          "unset it before importing kernels to compile for the GPU")
        return req
    if device.type != "cpu":
        raise BackendUnavailableError(f"backend 'interpreter' runs on CPU tensors, got {device}; "
                                      f"use backend='triton' on a GPU")
    if not interpreter_enabled():
        raise BackendUnavailableError("backend 'interpreter' needs TRITON_INTERPRET=1 in the environment before "
                                      "the first Triton kernel is defined (e.g. at the top of tests/conftest.py)")
    return req
