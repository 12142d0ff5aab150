"""When does CPU offload pay? Simulated studies of the seed's swap claims for a 70B model on A100s.

- :func:`offload_study`: swap *preemption* (a preempted request's blocks go to the host and back)
  vs recompute, sync or overlapped, uncompressed or fp8/int4, under memory pressure, on the simulator
  (the engine's scheduler and KV manager). Saturating arrivals give throughput, Poisson TBT/TTFT.
- :func:`streaming_study`: KV *streaming* (FlexGen-style, what the seed's "prefetch the next layer's
  blocks, overlap, compress" describes): a decode batch larger than the device cache keeps the
  surplus KV on the host and streams it every step (:class:`~paged.sim.cost_model.CostModel`); the
  best batch per variant gives its throughput, its step time the TBT.

The seed claims "an asynchronous swap pipeline with prefetch, overlap and compression gives 2-3x
throughput on A100" and "CPU offloading only for throughput-first, latency-tolerant offline work"
(PCIe 4.0 x16 ~32 GB/s vs HBM ~2 TB/s). :func:`verdicts` states what our numbers say;
:func:`claim_table` puts the seed's numbers beside ours, with conditions, one row per claim.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd

from paged.sim.cost_model import CostModel, StepShape, swap_bytes_ratio
from paged.sim.specs import get_model, kv_cache_sizing
from paged.sweeps import sweep

__all__ = ["VARIANTS", "claim_table", "offload_study", "streaming_study", "verdicts"]

# (label, preemption_mode, swap_mode, swap_compression)
VARIANTS: tuple[tuple[str, str, str, str | None], ...] = (
    ("recompute", "recompute", "sync", None),
    ("swap sync", "swap", "sync", None),
    ("swap sync fp8", "swap", "sync", "fp8"),
    ("swap sync int4", "swap", "sync", "int4"),
    ("swap overlap", "swap", "overlap", None),
    ("swap overlap fp8", "swap", "overlap", "fp8"),
    ("swap overlap int4", "swap", "overlap", "int4"),
)


def offload_study(model: str = "llama-2-70b", gpu: str = "a100-80gb", tensor_parallel: int = 2,
                  workload: str = "sharegpt", num_requests: int = 1000,
                  pressures: Sequence[float] = (1.0, 0.5, 0.25), latency_load: float | None = 0.9,
                  swap_space_gib: float = 64.0, seed: int = 0, jobs: int = 1) -> pd.DataFrame:
    """Recompute vs swap preemption (sync/overlap x none/fp8/int4) per memory pressure and load. ``pressures``:
    fractions of the KV blocks that fit (``kv_cache_sizing``) given to the pool. Each pressure runs saturated
    (``rate = inf``, all requests at t=0: throughput) and, with ``latency_load``, at that fraction of
    recompute's saturated request rate (Poisson arrivals: TBT/TTFT of a loaded but not overloaded server).
    Ratios are against recompute and against synchronous uncompressed swap at the same pressure and rate."""
    sizing = kv_cache_sizing(model, gpu, 16, tensor_parallel=tensor_parallel)
    fit = sizing.num_blocks
    base = dict(model=model, gpu=gpu, tensor_parallel=tensor_parallel, workload=workload,
                num_requests=num_requests, trace_seed=seed, prompt_seed=seed, enable_prefix_caching=False,
                swap_space_gib=swap_space_gib)

    def points(rate_of):
        return [dict(base, rate=float(rate_of(p)), num_blocks=max(1, int(fit * p)), preemption_mode=mode,
                     swap_mode=ov, swap_compression=comp, _variant=label, _pressure=p)
                for p in pressures for label, mode, ov, comp in VARIANTS]
    pts = points(lambda p: float("inf"))
    df = sweep("simulate", pts, jobs=jobs, store=False, progress=False, on_error="raise")
    if latency_load:
        sat = {pt["_pressure"]: r for pt, r in zip(pts, df["throughput_req_s"]) if pt["_variant"] == "recompute"}
        more = points(lambda p: latency_load * sat[p])
        df, pts = pd.concat([df, sweep("simulate", more, jobs=jobs, store=False, progress=False,
                                          on_error="raise")], ignore_index=True), pts + more
    df.insert(0, "variant", [p["_variant"] for p in pts])
    df.insert(1, "kv_fraction", [p["_pressure"] for p in pts])
    ratio = [swap_bytes_ratio(p["swap_compression"], get_model(model).head_dim) for p in pts]
    df["link_gb"] = df["num_swapped_blocks"].to_numpy() * sizing.bytes_per_block * np.array(ratio) / 1e9
    for ref, col in (("recompute", "vs_recompute"), ("swap sync", "vs_swap_sync")):
        for m in ("throughput_tok_s", "tbt_p50_s", "tbt_p99_s", "ttft_p50_s"):
            df[m.removesuffix("_s").removesuffix("_tok") + f"_{col}"] = _vs(df, ["kv_fraction", "rate"], ref, m)
    cols = ["variant", "kv_fraction", "rate", "num_kv_blocks", "throughput_tok_s", "throughput_vs_recompute",
            "throughput_vs_swap_sync", "tbt_p50_s", "tbt_p99_s", "tbt_p50_vs_recompute", "tbt_p99_vs_recompute",
            "tbt_p99_vs_swap_sync", "ttft_p50_s", "ttft_p99_s", "ttft_p50_vs_recompute", "num_preemptions",
            "num_swapped_blocks", "link_gb", "mean_batch_size", "duration_s"]
    out = df[cols].reset_index(drop=True)
    out.attrs["config"] = dict(base, blocks_that_fit=fit, latency_load=latency_load)
    return out


def _vs(df: pd.DataFrame, keys: list[str], ref: str, col: str, num: str | None = None) -> np.ndarray:
    """Each row's ``num`` (default ``col``) over ``col`` of the ``variant == ref`` row with the same ``keys``."""
    base = df[df["variant"] == ref].set_index(keys)[col]
    return df[num or col].to_numpy() / base.reindex(pd.MultiIndex.from_frame(df[keys])).to_numpy()


def streaming_study(model: str = "llama-2-70b", gpu: str = "a100-80gb", tensor_parallel: int = 2,
                    contexts: Sequence[int] = (512, 1024, 2048, 4000), kv_fractions: Sequence[float] = (1.0, 0.25),
                    max_batch: int = 512, block_size: int = 16) -> pd.DataFrame:
    """Decode throughput and TBT with KV streamed from the host, per device KV share, context length and
    variant. ``B_dev`` = sequences of ``ctx`` tokens whose KV fits on the device (``kv_fraction`` of the sizing,
    less a double buffer for one layer's streamed KV); a batch ``B > B_dev`` streams ``(B - B_dev) x ctx``
    tokens' KV per step over the link. Each variant's best batch in ``1..max_batch`` (max tokens/s) is reported
    with its TBT, and the TBT at twice the device batch (``tbt_2x_s``: how steeply latency grows past the best
    point); ``device only`` caps B at B_dev. Ratios are against ``device only`` at the same context and KV
    share."""
    m = get_model(model)
    sizing = kv_cache_sizing(m, gpu, block_size, tensor_parallel=tensor_parallel)
    rows = []
    variants = [("device only", False, None), ("stream sync", False, None), ("stream sync int4", False, "int4"),
                ("stream overlap", True, None), ("stream overlap fp8", True, "fp8"),
                ("stream overlap int4", True, "int4")]
    for frac in kv_fractions:
        kv_tokens = sizing.num_tokens * frac
        for ctx in contexts:
            for label, ov, comp in variants:
                cm = CostModel(m, gpu, tensor_parallel=tensor_parallel, kv_block_size=block_size, swap_overlap=ov,
                               swap_compression=comp)

                def at(b: int):
                    dev = kv_tokens / ctx
                    if b > dev:
                        dev = (kv_tokens - 2 * (b - dev) * ctx / m.num_layers) / ctx  # double-buffered layer
                    host = max(0.0, (b - dev) * ctx)
                    shape = StepShape.make([1] * b, [ctx] * b, swap_bytes=host * cm.kv_bytes_per_token)
                    return dev, host, (cm.step_time(shape) if dev >= 1 else None)
                best = None
                b_dev = int(kv_tokens // ctx)
                for b in range(1, (b_dev if label == "device only" else max_batch) + 1):
                    dev, host, t = at(b)
                    if t is None:
                        break
                    if best is None or b / t > best["throughput_tok_s"]:
                        best = dict(kv_fraction=frac, context=ctx, variant=label, batch=b, device_seqs=int(dev),
                                    host_seqs=b - int(dev), tbt_s=t, throughput_tok_s=b / t,
                                    streamed_gb_per_step=host * cm.kv_bytes_per_token * cm.swap_bytes_ratio / 1e9)
                if best is not None:
                    t2 = at(2 * b_dev)[2] if label != "device only" else None
                    best["tbt_2x_s"] = float("nan") if t2 is None else t2
                    rows.append(best)
    df = pd.DataFrame(rows)
    key = ["kv_fraction", "context"]
    df["throughput_vs_device"] = _vs(df, key, "device only", "throughput_tok_s")
    df["tbt_vs_device"] = _vs(df, key, "device only", "tbt_s")
    df["tbt_2x_vs_device"] = _vs(df, key, "device only", "tbt_s", "tbt_2x_s")
    df.attrs["config"] = dict(model=model, gpu=gpu, tensor_parallel=tensor_parallel, kv_tokens=sizing.num_tokens,
                              link_gb_s=CostModel(m, gpu).gpu.pcie_bandwidth / 1e9)
    return df


def _vs_seed(best: float) -> str:
    """How a best throughput ratio reads against the seed's "2-3x"."""
    return f"{'below' if best < 2.0 else 'within' if best <= 3.0 else 'above'} the seed's 2-3x"


def verdicts(offload: pd.DataFrame | None = None, streaming: pd.DataFrame | None = None) -> list[str]:
    """One line per seed claim, with the numbers of the given study frames; every judgement in a
    line is computed from those numbers (``_vs_seed``; a p99 TBT within 5% counts as no cost)."""
    tol = 1.05  # a p99 TBT within 5% of the reference counts as "no latency cost"
    out = []
    if offload is not None:
        sat = offload[np.isinf(offload["rate"])]
        best = sat.loc[sat["throughput_vs_swap_sync"].idxmax()]
        over = sat[sat["variant"] == "swap overlap int4"]["throughput_vs_recompute"]
        out.append(f"swap preemption: overlap+int4 vs sync swap at most {best['throughput_vs_swap_sync']:.3f}x "
                   f"({best['variant']}, kv_fraction {best['kv_fraction']}); vs recompute "
                   f"{over.min():.2f}-{over.max():.2f}x: {_vs_seed(over.max())}")
        lat = offload[~np.isinf(offload["rate"])]
        if len(lat):
            sw = lat[lat["variant"] == "swap sync"]
            ov = lat[lat["variant"] == "swap overlap int4"]["tbt_p99_vs_swap_sync"]
            worst = sw["tbt_p99_vs_recompute"].max()
            out.append(f"latency (loaded, Poisson): swap sync p99 TBT {sw['tbt_p99_vs_recompute'].min():.2f}-"
                       f"{worst:.2f}x recompute's, p50 "
                       f"{sw['tbt_p50_vs_recompute'].min():.2f}-{sw['tbt_p50_vs_recompute'].max():.2f}x; overlap+int4 "
                       f"p99 {ov.min():.3f}-{ov.max():.3f}x sync swap's: swap preemption "
                       + ("costs no p99 latency here" if worst <= tol else f"adds up to {worst:.2f}x p99 latency"))
    if streaming is not None:
        st = streaming[streaming["variant"] == "stream overlap int4"]
        i = st["throughput_vs_device"].idxmax()
        full = st[st["kv_fraction"] == st["kv_fraction"].max()]["throughput_vs_device"]
        out.append(f"KV streaming, overlap+int4: {st['throughput_vs_device'].min():.2f}-"
                   f"{st['throughput_vs_device'].max():.2f}x device-only throughput (best "
                   f"{st.loc[i, 'throughput_vs_device']:.2f}x at kv_fraction {st.loc[i, 'kv_fraction']}, ctx "
                   f"{st.loc[i, 'context']}: {_vs_seed(st.loc[i, 'throughput_vs_device'])}; {full.min():.2f}-"
                   f"{full.max():.2f}x with the largest KV pool: {_vs_seed(full.max())}) at "
                   f"{st['tbt_vs_device'].min():.2f}-{st['tbt_vs_device'].max():.2f}x TBT")
        sy = streaming[streaming["variant"] == "stream sync int4"]
        j = sy["throughput_vs_device"].idxmax()
        tbt_sync, tbt_over = sy.loc[j, "tbt_vs_device"], st["tbt_vs_device"].max()
        out.append(f"KV streaming without overlap: at most {sy.loc[j, 'throughput_vs_device']:.2f}x (int4) at "
                   f"{tbt_sync:.1f}x TBT, overlapped at most {tbt_over:.2f}x TBT: "
                   + ("synchronous offload fits only latency-tolerant offline work (the seed's claim holds)"
                      if tbt_sync > 2.0 else "synchronous offload keeps TBT within 2x (the seed's 'offline only' "
                      "is not needed here)"))
    return out


def _conditions(config: dict) -> str:
    """A study's config as words for a table cell ('model llama-2-70b, gpu a100-80gb, ...'), not a dict repr."""
    return ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in config.items())


def claim_table(offload: pd.DataFrame | None = None, streaming: pd.DataFrame | None = None,
                engine: pd.DataFrame | None = None) -> pd.DataFrame:
    """The seed's swap claims beside our numbers (given study frames), with conditions."""
    rows = []
    seed_tp = "2-3x throughput on A100 (async swap pipeline: prefetch, overlap, FP8/4-bit compression)"
    if engine is not None:
        e = engine.set_index("variant")["throughput_vs_recompute"]
        best = e.drop("recompute").max()
        rows.append(dict(claim=seed_tp, ours=f"{best:.2f}x best swap variant vs recompute; overlap vs sync "
                         f"{e.get('swap overlap', np.nan) / e.get('swap sync', np.nan):.2f}x",
                         where="real engine, CPU (copies synchronous: overlap cannot help)",
                         conditions=_conditions(engine.attrs.get("config", {}))))
    if offload is not None:
        sat = offload[np.isinf(offload["rate"])]
        ov = sat[sat["variant"] == "swap overlap int4"]
        rows.append(dict(claim=seed_tp, ours=f"{ov['throughput_vs_recompute'].min():.2f}-"
                         f"{ov['throughput_vs_recompute'].max():.2f}x vs recompute, "
                         f"{ov['throughput_vs_swap_sync'].max():.3f}x vs sync swap",
                         where="simulated, swap preemption", conditions="saturated ShareGPT, KV pool "
                         f"{sorted(set(sat['kv_fraction']))} of what fits; {_conditions(offload.attrs.get('config', {}))}"))
    if streaming is not None:
        st = streaming[streaming["variant"] == "stream overlap int4"]
        for frac, g in st.groupby("kv_fraction"):
            rows.append(dict(claim=seed_tp, ours=f"{g['throughput_vs_device'].min():.2f}-"
                             f"{g['throughput_vs_device'].max():.2f}x vs device-only at "
                             f"{g['tbt_vs_device'].min():.2f}-{g['tbt_vs_device'].max():.2f}x TBT",
                             where="simulated, KV streamed from the host every decode step",
                             conditions=f"kv_fraction {frac}, ctx {sorted(g['context'])}, "
                             f"{_conditions(streaming.attrs.get('config', {}))}"))
        sy = streaming[streaming["variant"] == "stream sync int4"]
        j = sy["throughput_vs_device"].idxmax()
        rows.append(dict(claim="CPU offloading only for throughput-first, latency-tolerant offline work",
                         ours=f"sync streaming: {sy.loc[j, 'throughput_vs_device']:.2f}x at "
                         f"{sy.loc[j, 'tbt_vs_device']:.1f}x TBT; overlapped: TBT "
                         f"{st['tbt_vs_device'].min():.2f}-{st['tbt_vs_device'].max():.2f}x at its best batch",
                         where="simulated, KV streaming", conditions="holds without overlap, not with it"))
    if offload is not None:
        lat = offload[~np.isinf(offload["rate"])]
        if len(lat):
            sw = lat[lat["variant"] == "swap sync"]["tbt_p99_vs_recompute"]
            rows.append(dict(claim="CPU offloading only for throughput-first, latency-tolerant offline work",
                             ours=f"swap preemption p99 TBT {sw.min():.2f}-{sw.max():.2f}x recompute's",
                             where="simulated, swap preemption", conditions="Poisson at 90% of recompute's "
                             "saturated rate; swap costs no latency"))
    return pd.DataFrame(rows, columns=["claim", "ours", "where", "conditions"])
