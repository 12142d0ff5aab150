"""Compiled CPU kernels: paged decode attention read straight from the block-layout cache, and
the row-wise RMSNorm, SiLU-gate and RoPE of a decoder layer.

On CPU the torch path gathers every sequence's K/V into a padded copy per layer and calls SDPA
(~0.6-1 ms per layer at batch 16, context ~150, for ~6 MFLOP of arithmetic). ``paged_decode.c``
reads the blocks in place, one pass over a sequence's K slots and one over its V slots for all
its query heads. torch's CPU ``rms_norm`` and ``silu`` cost 35-110 us on a [16, 576] decode
batch (a few us of arithmetic); ``norm_act.c`` does each in one pass, ``rope.c`` rotates q and k
with torch's exact rounding. The files are compiled on first use with the machine's C compiler
(``cc``, ``-O3 -march=native -fopenmp``, falling back to fewer flags) into one library in a
cache folder: ``$PAGED_NATIVE_DIR``, else ``$XDG_CACHE_HOME/paged-kv`` (``~/.cache/paged-kv``).
Plain C called through :mod:`ctypes`: no torch headers, about a second to build.

Optional by design: without a compiler, on a build error, with ``PAGED_NATIVE=0`` in the
environment or ``ENABLED = False`` (process-wide; benchmarks compare both paths), :func:`available`
is False (:func:`unavailable_reason` says why) and callers keep the torch path. Only float32
CPU tensors.

Memory safety: C trusts its indices, so :class:`DecodePlan` checks them once per step (every
table entry a sequence reads inside the cache, every length within its row's blocks) and each
call checks the cache's shape, dtype and layout against the plan.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile

import torch

from ..errors import BackendUnavailableError, ShapeError

__all__ = ["available", "unavailable_reason", "DecodePlan", "rms_norm", "silu_mul", "rope"]

_HERE = os.path.dirname(__file__)
_FLAGS = ["-O3", "-fPIC"]
# tried in order: a compiler without -march=native (some clang builds) or OpenMP (Apple clang)
# still builds the kernels (the OpenMP pragma is then ignored: one thread)
_VARIANTS = [["-march=native", "-fopenmp"], ["-fopenmp"], []]
_FAST = ["-ffast-math"]  # reassociated sums and vectorized expf (libmvec)
_EXACT = ["-ffp-contract=off"]  # torch's rounding: no fused multiply-adds
_SOURCES = [("paged_decode.c", _FAST), ("quant_decode.c", _FAST), ("norm_act.c", _FAST), ("rope.c", _EXACT),
            ("quant_write.c", _EXACT)]
ENABLED = os.environ.get("PAGED_NATIVE", "1") != "0"
_reason = ""


def _cpu_key() -> str:
    """What ``-march=native`` depends on: the CPU's feature flags (so a moved cache is rebuilt)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _build(cc: str) -> str:
    """The library's path in the cache folder, compiled first if it is not there (raises
    subprocess.CalledProcessError with the compiler's stderr when no flag variant builds)."""
    src = b"".join(open(os.path.join(_HERE, f), "rb").read() + " ".join(x).encode() for f, x in _SOURCES)
    flags = repr([cc, _FLAGS, _VARIANTS]).encode()
    key = hashlib.sha256(src + flags + _cpu_key().encode()).hexdigest()[:16]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    out_dir = os.environ.get("PAGED_NATIVE_DIR") or os.path.join(base, "paged-kv")
    lib = os.path.join(out_dir, f"paged_native_{key}.so")
    if os.path.exists(lib):
        return lib
    os.makedirs(out_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=out_dir)  # built aside, renamed into place: atomic
    run = lambda args: subprocess.run(args, check=True, capture_output=True, timeout=120)  # noqa: E731
    try:
        for i, variant in enumerate(_VARIANTS):
            try:
                objs = [os.path.join(tmp, f + ".o") for f, _ in _SOURCES]
                for (f, extra), obj in zip(_SOURCES, objs):  # one object per file: each with its own float rules
                    run([cc, *_FLAGS, *variant, *extra, "-c", os.path.join(_HERE, f), "-o", obj])
                run([cc, "-shared", *variant, *objs, "-o", os.path.join(tmp, "lib.so"), "-lm"])
                break
            except subprocess.CalledProcessError:
                if i == len(_VARIANTS) - 1:
                    raise
        os.replace(os.path.join(tmp, "lib.so"), lib)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return lib


@functools.cache
def _library() -> ctypes.CDLL | None:
    global _reason
    if sys.platform == "win32":
        _reason = "the native kernel is built for Linux and macOS only"
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        _reason = "no C compiler (cc) on PATH; install gcc or clang for the fast CPU decode path"
        return None
    try:
        lib = ctypes.CDLL(_build(cc))
    except (OSError, subprocess.SubprocessError) as e:
        err = getattr(e, "stderr", b"") or b""
        _reason = f"building kernels/native failed: {e} {err.decode(errors='replace')[-400:]}"
        return None
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    for name, args in (("paged_decode_f32", [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64,
                                             f32, ptr, ptr, ptr, i64, ptr, i64]),
                       ("quant_decode_f32", [ptr, i64, i64, ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64,
                                             f32, ptr, i64, ptr, i64]),
                       ("split_write_f32", [ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr]),
                       ("plain_write_f32", [ptr, ptr, ptr, i64, ptr, ptr]),
                       ("rms_norm_f32", [ptr, ptr, f32, i64, i64, ptr]),
                       ("silu_mul_f32", [ptr, i64, i64, ptr]),
                       ("rope_f32", [ptr, i64, i64, ptr, ptr, i64, i64, i64, ptr])):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
    lib.split_write_f32.restype = lib.plain_write_f32.restype = i64
    return lib


def available() -> bool:
    """Whether the compiled kernels are enabled and can run here (builds them on the first call)."""
    return ENABLED and _library() is not None


def unavailable_reason() -> str:
    """Why :func:`available` is False ('' when it is True)."""
    if not ENABLED:
        return "disabled (PAGED_NATIVE=0 in the environment, or kernels.native.ENABLED = False)"
    _library()
    return _reason


def library() -> ctypes.CDLL:
    """The compiled library (BackendUnavailableError when :func:`available` is False)."""
    if not available():
        raise BackendUnavailableError(f"the compiled CPU kernels are unavailable: {unavailable_reason()}")
    return _library()


class DecodePlan:
    """One step's decode rows, checked once; call per layer with ``(q, k_cache, v_cache)``.

    ``tables`` int ``[S, W]`` (block ids), ``lens`` int ``[S]`` (context length per row, query
    included). Invariants after construction: ``0 <= lens[s] <= W * block_size`` and the first
    ``ceil(lens[s] / block_size)`` entries of row ``s`` lie in ``[0, num_blocks)``.
    """

    def __init__(self, tables: torch.Tensor, lens: torch.Tensor, num_blocks: int, block_size: int,
                 scale: float) -> None:
        library()
        self.tables = tables.to(device="cpu", dtype=torch.int64).contiguous()
        self.lens = lens.to(device="cpu", dtype=torch.int64).contiguous()
        s, w = self.tables.shape if self.tables.dim() == 2 else (-1, -1)
        if s != self.lens.numel() or self.lens.dim() != 1:
            raise ShapeError(f"tables {tuple(tables.shape)} and lens {tuple(lens.shape)} need one row per sequence")
        self.num_blocks, self.block_size, self.scale = num_blocks, block_size, float(scale)
        self.t_max = int(self.lens.max()) if s else 0
        if s and (int(self.lens.min()) < 0 or self.t_max > w * block_size):
            raise ShapeError(f"lens must lie in [0, {w * block_size}] for {w} blocks x {block_size} per row")
        if s and self.t_max:
            used = torch.arange(w)[None, :] * block_size < self.lens[:, None]
            ids = self.tables[used]
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
                raise ShapeError(f"block ids must lie in [0, {num_blocks}); got {int(ids.min())}..{int(ids.max())}")
        self._scores = self._norms = torch.empty(0)
        self._offsets = torch.empty(0, dtype=torch.int64)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """``q`` float32 ``[S, Hq, D]`` (any token/head stride, unit stride in D); caches float32
        contiguous ``[num_blocks, block_size, Hkv, D]``. Returns float32 ``[S, Hq, D]``."""
        s, w = self.tables.shape
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if (c.dtype != torch.float32 or c.device.type != "cpu" or not c.is_contiguous() or c.dim() != 4
                    or c.shape[0] != self.num_blocks or c.shape[1] != self.block_size):
                raise ShapeError(f"{name} must be a contiguous float32 CPU tensor [{self.num_blocks}, "
                                 f"{self.block_size}, H, D]; got {c.dtype} {tuple(c.shape)} on {c.device}")
        hkv, d = k_cache.shape[2], k_cache.shape[3]
        if v_cache.shape != k_cache.shape:
            raise ShapeError(f"v_cache {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}")
        if (q.dtype != torch.float32 or q.device.type != "cpu" or q.dim() != 3 or q.shape[0] != s
                or q.shape[2] != d or q.shape[1] % hkv or q.stride(2) != 1):
            raise ShapeError(f"q must be float32 [{s}, k x {hkv}, {d}] on CPU with unit stride in D; "
                             f"got {q.dtype} {tuple(q.shape)} strides {q.stride()}")
        hq = q.shape[1]
        out = torch.empty(s, hq, d)
        t = max(1, self.t_max)
        if self._scores.numel() < s * hq * t:  # scratch: per row slot offsets, scores and norms
            self._offsets = torch.empty(s * t, dtype=torch.int64)
            self._scores, self._norms = torch.empty(s * hq * t), torch.empty(s * hq)
        library().paged_decode_f32(
            q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
            self.tables.data_ptr(), w, self.lens.data_ptr(), s, hq, hkv, d, self.block_size, self.scale,
            self._scores.data_ptr(), self._norms.data_ptr(), self._offsets.data_ptr(), t, out.data_ptr(),
            torch.get_num_threads())
        return out


def _rows_f32(name: str, x: torch.Tensor) -> None:
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or not x.is_contiguous():
        raise ShapeError(f"{name} must be a contiguous 2-D float32 CPU tensor; got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x^2, -1) + eps))`` per row of ``x`` ``[rows, dim]`` (float32, CPU)."""
    _rows_f32("x", x)
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.shape != (x.shape[1],) \
            or not weight.is_contiguous():
        raise ShapeError(f"weight must be a contiguous float32 CPU tensor [{x.shape[1]}]; got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    out = torch.empty_like(x)
    library().rms_norm_f32(x.data_ptr(), weight.data_ptr(), float(eps), x.shape[0], x.shape[1], out.data_ptr())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` ``[rows, 2n]`` (float32, CPU) -> ``[rows, n]``."""
    _rows_f32("gate_up", gate_up)
    if gate_up.shape[1] % 2:
        raise ShapeError(f"gate_up needs an even width [gate | up]; got {gate_up.shape[1]}")
    n = gate_up.shape[1] // 2
    out = torch.empty(gate_up.shape[0], n)
    library().silu_mul_f32(gate_up.data_ptr(), gate_up.shape[0], n, out.data_ptr())
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``x * cos + roll(x, d/2) * sin_signed`` for ``x`` float32 ``[T, heads, d]`` (any token and
    head stride, unit stride in ``d``; e.g. q and k as a view of a fused projection) and tables
    ``[T, d]``; bit-identical to those torch ops. Returns a contiguous ``[T, heads, d]``."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 3 or x.stride(2) != 1 or x.shape[2] % 2:
        raise ShapeError(f"x must be float32 [T, heads, even d] on CPU with unit stride in d; got {x.dtype} "
                         f"{tuple(x.shape)} strides {x.stride()}")
    t, h, d = x.shape
    for name, tab in (("cos", cos), ("sin_signed", sin_signed)):
        if tab.dtype != torch.float32 or tab.shape != (t, d) or not tab.is_contiguous() or tab.device.type != "cpu":
            raise ShapeError(f"{name} must be a contiguous float32 CPU tensor [{t}, {d}]; got {tab.dtype} "
                             f"{tuple(tab.shape)}")
    out = torch.empty(t, h, d)
    library().rope_f32(x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin_signed.data_ptr(), t, h, d,
                    out.data_ptr())
    return out
