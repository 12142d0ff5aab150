"""Triton kernels (imported lazily by :mod:`kernels.api`; never on ``import kernels``)."""
