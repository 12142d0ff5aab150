"""Paged KV-cache kernels: Triton kernels, each beside the plain-torch reference that defines it.

Layout (shared with ``paged/``): per layer, ``k`` and ``v`` are ``[num_blocks, block_size,
num_kv_heads, head_dim]``; token slot ``= block_id * block_size + offset``; block tables are int32
``[num_seqs, max_blocks]``. Quantized formats keep that block layout for their data (int4: two
codes per byte along head_dim) and for their per-token scale/zero side tensors (see
:mod:`kernels.formats`); ``int4_kivi`` K scales are per block ``[num_blocks, num_kv_heads,
head_dim]`` and unfilled blocks' K lives in a staging pool (:mod:`kernels.kivi_cache`).

Typical use by a model runner::

    layer = kernels.allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim,
                                      kv_format="auto", dtype=torch.float16, device="cuda")
    kernels.write_kv(k, v, layer, slot_mapping)
    out = kernels.paged_prefill_attention(q, layer, None, block_tables, seq_lens, query_start_loc)  # mixed batch
    out = kernels.paged_decode_attention(q, layer, None, block_tables, seq_lens)  # one query token per sequence
    kernels.copy_blocks([layer0, layer1, ...], [(src, dst), ...])      # copy-on-write
    kernels.swap_blocks(gpu_layers, cpu_layers, [(gpu_block, cpu_block), ...])
    kernels.release_blocks(layer, freed_block_ids)        # int4_kivi: free staging (no-op otherwise)

``KVCacheLayer`` is data only (tensors, format, staging pool); every operation on it is a
function of :mod:`kernels.api` / :mod:`kernels.blocks`.

Entry points (each takes ``backend=None|"triton"|"interpreter"|"native"|"torch"``, see :mod:`kernels.backend`):

* ``paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, *, scale=None, k_scale=None,
  v_scale=None, k_zero=None, v_zero=None, kv_format=None, backend=None, return_lse=False, num_splits=None)``
* ``paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *, scale=None,
  k_scale=None, v_scale=None, k_zero=None, v_zero=None, kv_format=None, backend=None)``
* ``write_kv(key, value, layer, slot_mapping, *, backend=None, positions=None)``: into a layer only
* ``copy_blocks(caches, block_mapping, *, backend=None)``, ``swap_blocks(src, dst, block_mapping)``
* ``quantize_kv(x, kv_format, *, scale=None, group_size=32) -> QuantizedKV(data, scale, zero)``,
  ``dequantize_kv(data, kv_format, scale, zero, *, dtype=torch.float32)``
* ``allocate_kv_cache(..., num_staging_blocks=None) -> KVCacheLayer``; ``k_cache`` may be a
  ``KVCacheLayer`` (then ``v_cache=None`` and no format/scale arguments: the layer carries them;
  ``int4_kivi`` works only through layers). ``release_blocks(layer, ids)``.

KV formats: ``"fp16"``, ``"bf16"``, ``"fp32"``, ``"fp8_e4m3"``, ``"fp8_e5m2"`` (per-head float32
scales), ``"int8"`` (per token-head fp16 scale), ``"int4"`` (per token-head group of 32 fp16
scale and zero point), ``"int4_kivi"`` (KIVI: V as int4; K int4 per channel over each block
with fp16 scale/zero per (block, head, channel); a block's K stays in the model dtype in a
staging pool of ``num_staging_blocks`` slots until the write that fills it; see
:mod:`kernels.kivi_cache` for its invariants and lifetimes); ``"auto"`` stores the model dtype.
:mod:`kernels.kivi` holds the per-channel key quantizer (any group size, for error studies).

Checks: ``tests/test_kernels_*.py`` compare every Triton kernel with its reference under the
interpreter; ``python -m kernels.triton_impl.compile_check`` compiles them for sm_80/sm_90
without a GPU; on a GPU run ``TRITON_INTERPRET=0 pytest tests/test_kernels_triton.py`` and
``python benchmarks/kernels.py --gpu``.

Name note: PyPI has an unrelated package also called ``kernels`` (Hugging Face's hub kernels).
This one is ``paged-kv-workbench``'s top-level package. If both are installed, the first
``kernels`` on ``sys.path`` wins, and with our editable install (a finder placed after the normal
path search) a regular install of the other one in site-packages shadows ours everywhere except
when the repository root is the working directory (checked: a foreign ``kernels`` earlier on the
path is imported instead). Importers should check ``getattr(kernels, "WORKBENCH", False)`` (True
only here) and otherwise tell the user to ``pip uninstall kernels`` or use a separate environment.

Importing this package imports neither torch nor triton: its names load on first use, and the
Triton kernels on the first Triton call.
"""

from __future__ import annotations

import importlib

WORKBENCH = True  # marks this package apart from PyPI's unrelated `kernels`

# Public name -> submodule. Loaded on first access (PEP 562), so that importing `kernels` (or the
# torch-free `kernels.format_table`, which the simulator reads) does not import torch.
_LAZY = {
    "paged_decode_attention": "api", "paged_prefill_attention": "api", "write_kv": "api", "release_blocks": "api",
    "release_window": "api", "default_tables": "cache", "SideFormat": "format_table",
    "BACKENDS": "backend", "resolve_backend": "backend",
    "copy_blocks": "blocks", "swap_blocks": "blocks",
    "KVCacheLayer": "cache", "allocate_kv_cache": "cache", "as_layer": "cache",
    "BackendUnavailableError": "errors", "KernelError": "errors", "KVFormatError": "errors",
    "ShapeError": "errors", "StagingExhaustedError": "errors",
    "FORMATS": "format_table", "KVFormat": "format_table", "bytes_per_token": "formats", "get_format": "formats",
    "QuantizedKV": "quant", "dequantize_kv": "quant", "fp8_scale": "quant", "pack_int4": "quant",
    "quantize_kv": "quant", "unpack_int4": "quant",
}

__all__ = [*_LAZY, "WORKBENCH"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
