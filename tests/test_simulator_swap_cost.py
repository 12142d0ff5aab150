"""The simulator sizes its CPU swap pool and prices swaps from bytes per *block*.

block bytes = kv_bytes_per_token x block_size; CPU blocks = swap_space_gib (GiB) x GiB // block
bytes; a step that moves k blocks over PCIe costs k x block bytes / (pcie_bandwidth x
pcie_efficiency) on top of its compute. Catches dropping `x block_size` from the
simulator's block bytes (the CPU pool grows block_size-fold and swaps get 16x cheaper).
"""
from __future__ import annotations

import numpy as np
import pytest

from paged.sim.cost_model import CostModel, StepShape
from paged.sim.simulator import SimConfig, Simulator, build_cost_model
from paged.sim.specs import GiB, get_gpu, get_model
from paged.sim.workload import synthetic_trace

SMALL = dict(model="llama-2-7b", gpu="a100-40gb", max_model_len=1024)


def test_cpu_pool_is_swap_space_over_block_bytes():
    per_token = get_model("llama-2-7b").kv_bytes_per_token("fp16")
    assert per_token == 2 * 32 * 32 * 128 * 2          # K and V x layers x heads x head_dim x fp16
    for bs, gib in ((8, 0.5), (16, 4.0), (32, 1.0)):
        sim = Simulator(SimConfig(**SMALL, block_size=bs, swap_space_gib=gib, preemption_mode="swap"))
        assert sim.kv.num_cpu_blocks == int(gib * GiB // (per_token * bs))
    sim = Simulator(SimConfig(**SMALL, block_size=8, swap_space_gib=0.5, preemption_mode="swap"))
    assert sim.kv.num_cpu_blocks == 128                 # 0.5 GiB / (0.5 MiB x 8)
    assert Simulator(SimConfig(**SMALL, block_size=8)).kv.num_cpu_blocks == 0   # recompute: no pool


def test_swap_time_is_block_bytes_over_the_link():
    cost = CostModel("llama-2-7b", "a100-40gb")
    gpu = get_gpu("a100-40gb")
    shape = dict(q=np.array([1.0, 1.0]), ctx=np.array([100.0, 300.0]), num_sampled=2)
    base = cost.step_time(StepShape(**shape))
    block = cost.kv_bytes_per_token * 16
    for k in (1, 5, 40):
        t = cost.step_time(StepShape(**shape, swap_bytes=k * block))
        assert t - base == pytest.approx(k * block / (gpu.pcie_bandwidth * cost.pcie_efficiency), rel=1e-9)
        t = cost.step_time(StepShape(**shape, copy_bytes=k * block))
        assert t - base == pytest.approx(2 * k * block / cost.effective_bandwidth, rel=1e-9)


class Recording(CostModel):
    """A CostModel that remembers every step shape it priced."""

    shapes: list = []

    def step_time(self, s: StepShape) -> float:
        Recording.shapes.append(s)
        return CostModel.step_time(self, s)


def test_simulated_swaps_are_priced_per_block():
    cfg = SimConfig(**SMALL, num_blocks=150, preemption_mode="swap", block_size=16, swap_space_gib=1.0)
    base = build_cost_model(cfg, get_model(cfg.model))
    Recording.shapes = []
    rec = Recording(base.model, base.gpu, kv_format=base.kv_format, kv_block_size=base.kv_block_size)
    sim = Simulator(cfg, cost_model=rec)
    res = sim.run(synthetic_trace("sharegpt", 40, trace_seed=0, max_model_len=1024))
    assert res.summary["requests_finished"] == 40
    kv = sim.kv
    moved = kv.num_swapped_out_blocks + kv.num_swapped_in_blocks
    assert moved > 0, "the pool was meant to be too small"
    block_bytes = get_model("llama-2-7b").kv_bytes_per_token("fp16") * 16
    assert sum(s.swap_bytes for s in Recording.shapes) == moved * block_bytes
    assert sum(s.copy_bytes for s in Recording.shapes) == kv.num_cow_copies * block_bytes
    assert all(s.swap_bytes % block_bytes == 0 for s in Recording.shapes)
