"""Cost model of swap transfers: sum without overlap, max + pipeline fill with it, fewer link
bytes with compression (the same ratio as the engine's host blocks)."""
from __future__ import annotations

import pytest
import torch

from paged.errors import ConfigError
from paged.sim.cost_model import CostModel, StepShape, swap_bytes_ratio
from paged.sim.simulator import SimConfig, build_cost_model
from paged.sim.specs import get_model


def _cm(**kw):
    return CostModel("llama-2-70b", "a100-80gb", tensor_parallel=4, kv_block_size=16, **kw)


def _decode(swap_bytes=0.0):
    return StepShape.make([1] * 32, [800] * 32, swap_bytes=swap_bytes)


@pytest.mark.parametrize("gib", [0.01, 0.5, 8.0])
def test_overlap_is_max_plus_fill_and_sync_is_sum(gib):
    sync, over = _cm(), _cm(swap_overlap=True)
    link = gib * 2 ** 30 / (sync.gpu.pcie_bandwidth * sync.pcie_efficiency)
    base = sync.step_time(_decode())
    t_sync = sync.step_time(_decode(gib * 2 ** 30))
    assert t_sync - base == pytest.approx(link, rel=1e-9)
    b = over.breakdown(_decode())
    gpu = b.linear + b.attention + b.comm
    want = b.overhead + max(gpu, link) + min(gpu, link) / 80
    assert over.step_time(_decode(gib * 2 ** 30)) == pytest.approx(want, rel=1e-9)
    assert base <= over.step_time(_decode(gib * 2 ** 30)) <= t_sync


def test_compression_shrinks_link_time_and_defaults_are_unchanged():
    plain, fp8, int4 = _cm(), _cm(swap_compression="fp8"), _cm(swap_compression="int4")
    s = _decode(2 ** 30)
    extra = {name: m.step_time(s) - m.step_time(_decode()) for name, m in
             (("none", plain), ("fp8", fp8), ("int4", int4))}
    assert extra["int4"] < extra["fp8"] < extra["none"]
    assert swap_bytes_ratio(None, 128) == 1.0
    assert swap_bytes_ratio("int4", 128, "int8") == 1.0  # an already quantized cache is not recompressed
    cfg = SimConfig(model="llama-2-70b", tensor_parallel=4)
    assert build_cost_model(cfg, get_model("llama-2-70b")).step_time(s) == pytest.approx(plain.step_time(s))
    with pytest.raises(ConfigError, match="swap_compression"):
        _cm(swap_compression="int2")
    with pytest.raises(ConfigError, match="swap_compression"):  # checked before the quantized-cache shortcut
        swap_bytes_ratio("int2", 128, "int8")


@pytest.mark.parametrize("codec", ["fp8", "int4"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_ratio_matches_the_engines_host_blocks(codec, head_dim):
    from paged._kernels import kernels
    from paged.engine.swap import SwapExecutor
    dev = [kernels.allocate_kv_cache(4, 16, 2, head_dim, dtype=torch.float16)]
    sw = SwapExecutor.build(dev, 4, compression=codec)
    assert sw.host_block_bytes() / sw.device_block_bytes() == pytest.approx(
        swap_bytes_ratio(codec, head_dim, "fp16", 16), rel=1e-12)


def test_swap_benchmark_runs_small():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "swap.py"
    spec = importlib.util.spec_from_file_location("bench_swap", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.run(blocks=2, layers=2, compute=16, rounds=1)
    assert [(r["compression"], r["mode"]) for r in rows] == [(c, m) for c in ("none", "fp8", "int4")
                                                           for m in ("sync", "overlap")]
    assert all(r["step_ms"] > 0 and r["moved_mb"] > 0 for r in rows)


def test_simulated_host_pool_holds_more_compressed_blocks():
    from paged.sim.simulator import Simulator
    n = {c: Simulator(SimConfig(model="llama-2-70b", tensor_parallel=4, preemption_mode="swap", swap_space_gib=1.0,
                                swap_compression=c)).kv.num_cpu_blocks for c in (None, "fp8", "int4")}
    assert n["int4"] == pytest.approx(n[None] / swap_bytes_ratio("int4", 128), rel=1e-3)
    assert n[None] < n["fp8"] < n["int4"]
