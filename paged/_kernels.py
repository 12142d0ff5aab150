"""The workbench's `kernels` package, checked on import.

PyPI has an unrelated package also named `kernels` (Hugging Face's hub kernels). If it comes
first on `sys.path`, fail here with a message that says what to change, instead of deep
inside a forward pass.
"""
from __future__ import annotations

import kernels

if not getattr(kernels, "WORKBENCH", False):
    raise ImportError(
        f"`import kernels` found {getattr(kernels, '__file__', kernels)!r}, which is not the paged-KV "
        "workbench's kernels package (PyPI's unrelated 'kernels' shadows it); uninstall that package "
        "or put this repository first on sys.path")

__all__ = ["kernels"]
