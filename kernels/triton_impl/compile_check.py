"""Compile every Triton kernel for NVIDIA targets without a GPU (Triton ships ``ptxas``).

Catches what the interpreter forgives (shapes an MLIR op will not broadcast, ``tl.dot`` size
limits, dtype mismatches) on a machine with no GPU::

    TRITON_INTERPRET=0 python -m kernels.triton_impl.compile_check [--arch 80 90] [--quick]

Each case is (kernel, argument types, constexprs); the first failure is raised with its case.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Iterator

from ..format_table import (CODE_CB, CODE_E4M3, CODE_E5M2, CODE_INT4, CODE_INT4_KIVI, CODE_INT8, CODE_KIVI,
                            CODE_PLAIN, INT4_CODES)

# (format code, data pointer type, scale pointer type) for every KV format
_FORMATS = [(CODE_PLAIN, "*fp16", "*fp16"), (CODE_PLAIN, "*bf16", "*bf16"), (CODE_PLAIN, "*fp32", "*fp32"),
            (CODE_E4M3, "*u8", "*fp32"), (CODE_E5M2, "*u8", "*fp32"), (CODE_INT8, "*i8", "*fp16"),
            (CODE_INT4, "*u8", "*fp16"), (CODE_INT4_KIVI, "*u8", "*fp16")]
_NO_WRITE_KERNEL = (CODE_INT4_KIVI,)  # int4_kivi writes with torch ops (kernels.kivi_cache)


def cases(quick: bool = False) -> Iterator[tuple[str, object, dict, dict]]:
    """Every kernel specialisation worth compiling: all formats, dot dtypes and tile shapes."""
    from .attention import decode_merge_kernel, decode_split_kernel, prefill_kernel
    from .write import copy_blocks_kernel, write_kv_kernel

    for fmt, data, scale in _FORMATS:
        plain_q = {"*fp16": "*fp16", "*bf16": "*bf16", "*fp32": "*fp32"}.get(data)
        q_types = (plain_q,) if fmt == CODE_PLAIN else (("*fp16",) if quick else ("*fp16", "*bf16"))
        for q in q_types:
            dot = {"*fp16": 1, "*bf16": 2, "*fp32": 0}[q]
            for d, group in ((128, 8),) if quick else ((128, 4), (64, 1)):
                ng = d // 32 if fmt in INT4_CODES else 1
                kivi = fmt == CODE_INT4_KIVI  # staging rows in the model dtype, int32 block -> slot map
                ptrs = dict(q_ptr=q, k_ptr=data, v_ptr=data, ks_ptr=scale, vs_ptr=scale, kz_ptr=scale, vz_ptr=scale,
                            kst_ptr=q if kivi else data, map_ptr="*i32" if kivi else data, bt_ptr="*i32",
                            sl_ptr="*i32", qsl_ptr="*i32", mid_o_ptr="*fp32", mid_lse_ptr="*fp32", out_ptr=q,
                            sm_scale="fp32", bt_stride="i32", tokens_per_split="i32", nsplit="i32")
                gp = max(16, 1 << (group - 1).bit_length())
                yield (f"decode fmt={fmt} data={data} q={q} d={d} g={group}", decode_split_kernel, ptrs,
                       dict(HQ=8 * group, H=8, D=d, NG=ng, BS=16, GROUP=group, GP=gp, BLOCK_N=64,
                            BLOCK_D=d, FMT=fmt, DOT=dot))
                gp = 1 << (group - 1).bit_length()
                yield (f"prefill fmt={fmt} data={data} q={q} d={d} g={group}", prefill_kernel, ptrs,
                       dict(HQ=8 * group, H=8, D=d, NG=ng, BS=16, GROUP=group, GP=gp, BLOCK_Q=max(1, 64 // gp),
                            BLOCK_N=64, BLOCK_D=d, FMT=fmt, DOT=dot))
        if fmt in _NO_WRITE_KERNEL:
            continue
        bf16 = data == "*bf16"
        wdata = "*i16" if bf16 else data
        for src in ("*bf16",) if quick else ("*fp16", "*bf16", "*fp32"):
            ng = 128 // 32 if fmt == CODE_INT4 else 1
            yield (f"write fmt={fmt} data={data} src={src}", write_kv_kernel,
                   dict(key_ptr=src, value_ptr=src, slot_ptr="*i32", k_ptr=wdata, v_ptr=wdata, ks_ptr=scale,
                        vs_ptr=scale, kz_ptr=scale, vz_ptr=scale),
                   dict(H=8, D=128, NG=ng, NGP=ng, HGP=16 if fmt == CODE_INT4 else 64, BLOCK_D=128, FMT=fmt, BF16=bf16))
    yield from _split_cases(quick)
    for q in ("*fp16", "*bf16", "*fp32"):
        yield (f"merge q={q}", decode_merge_kernel,
               dict(mid_o_ptr="*fp32", mid_lse_ptr="*fp32", out_ptr=q, lse_ptr="*fp32", nsplit="i32"),
               dict(D=128, SP=8, BLOCK_D=128))
    for t in ("*i32", "*u8"):
        yield (f"copy {t}", copy_blocks_kernel, dict(ptr=t, map_ptr="*i64"), dict(ROW=4096, BLOCK=1024))


def _split_cases(quick: bool) -> Iterator[tuple[str, object, dict, dict]]:
    """Split formats (kernels.split): KIVI keys (compact or fp16 step/zero, RoPE on read) or exact
    keys, codebook values (rotated or not), with a sink and window or KIVI staging only; exact rows
    fp16 or ``@krows``/``@vrows`` codes (8 bits: one byte per code; 6 and 3: codes straddle bytes)."""
    from .split_attention import split_decode_kernel, split_prefill_kernel
    configs = [  # (name, KFMT, VFMT, COMPACT, PRE, ROT, WIN, STAGED, HAS_SINK, KROWS, VROWS)
        ("kvq3", CODE_KIVI, CODE_CB, True, True, True, True, False, True, 16, 16),
        ("kvq3 krows8 vrows6", CODE_KIVI, CODE_CB, True, True, True, True, False, True, 8, 6),
        ("kivi/cb staging", CODE_KIVI, CODE_CB, False, False, False, False, True, False, 16, 16),
        ("fp16/cb window", CODE_PLAIN, CODE_CB, False, False, True, True, False, False, 16, 16),
        ("fp16/cb sink window krows3", CODE_PLAIN, CODE_CB, False, False, True, True, False, True, 3, 16)]
    for name, kf, vf, compact, pre, rot, win, staged, sink, krows, vrows in configs[:2] if quick else configs:
        for q in ("*fp16",) if quick else ("*fp16", "*bf16"):
            dot = {"*fp16": 1, "*bf16": 2}[q]
            k = "*u8" if kf == CODE_KIVI else "*fp16"
            kr, vr = ("*u8" if b < 16 else "*fp16" for b in (krows, vrows))  # exact rows: codes or fp16
            ptrs = dict(q_ptr=q, k_ptr=k, v_ptr="*u8", ks_ptr="*u8" if compact else "*fp16",
                        kz_ptr="*i8" if compact else "*fp16", ksup_ptr="*fp16", vs_ptr="*fp16", kw_ptr="*i32",
                        ko_ptr="*i32", lv_ptr="*fp32", cos_ptr="*fp32", sin_ptr="*fp32", had_ptr="*fp32",
                        sk_ptr=kr, sv_ptr=vr, map_ptr="*i32", xk_ptr=kr, xv_ptr=vr, xmap_ptr="*i32",
                        sks_ptr="*fp16", svs_ptr="*fp16", xks_ptr="*fp16", xvs_ptr="*fp16",
                        bt_ptr="*i32", sl_ptr="*i32", qsl_ptr="*i32", mid_o_ptr="*fp32",
                        mid_lse_ptr="*fp32", out_ptr=q, sm_scale="fp32", bt_stride="i32", tokens_per_split="i32",
                        nsplit="i32", SINK="i32", WINDOW="i32")
            common = dict(HQ=24, H=8, D=64, BS=32, RK=24 if kf == CODE_KIVI else 64, RV=24, VBITS=3, VG=64,
                          BLOCK_N=64, BLOCK_D=64, KFMT=kf, VFMT=vf, COMPACT=compact, PRE=pre, ROT=rot, WIN=win,
                          STAGED=staged, HAS_SINK=sink, KROWS=krows, VROWS=vrows, DOT=dot)
            yield (f"split decode {name} q={q}", split_decode_kernel, ptrs, dict(common, GROUP=3, GP=16))
            yield (f"split prefill {name} q={q}", split_prefill_kernel, ptrs, dict(common, GROUP=3, GP=4, BLOCK_Q=16))


def compile_all(archs: tuple[int, ...] = (80, 90), quick: bool = False, log=print) -> int:
    """Compile every case for every arch to a cubin; return the number compiled."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("compile_check needs TRITON_INTERPRET unset (interpreted kernels cannot be compiled)")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    n = 0
    for arch in archs:
        for name, fn, types, consts in cases(quick):
            sig = {arg: "constexpr" if arg in consts else types[arg] for arg in fn.arg_names}
            const = {arg: consts[arg] for arg in fn.arg_names if arg in consts}
            t0 = time.perf_counter()
            try:
                triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", arch, 32))
            except Exception as e:  # report which specialisation broke
                raise RuntimeError(f"sm_{arch} {name}: {type(e).__name__}: {e}") from e
            n += 1
            log(f"sm_{arch} {name}: ok ({time.perf_counter() - t0:.1f}s)")
    return n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    p.add_argument("--quick", action="store_true", help="one specialisation per kernel and format")
    a = p.parse_args()
    print(f"compiled {compile_all(tuple(a.arch), a.quick)} kernels")


if __name__ == "__main__":
    main()
