"""Test-wide environment, set before anything imports triton.

Triton kernels decide at definition time whether they run in the interpreter, so
``TRITON_INTERPRET=1`` must be in the environment before ``kernels``' Triton module is imported.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_CACHE_DIR", "/tmp/paged-triton-cache")
os.environ.setdefault("PAGED_NATIVE_DIR", "/tmp/paged-native-cache")  # kernels/native's compiled library


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M, loaded once per test session (dequantizing its GGUF is the
    slowest setup of the suite); tests only read it."""
    from paged.models import load_model
    return load_model("smollm2")
