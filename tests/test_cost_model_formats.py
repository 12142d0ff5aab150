"""The roofline cost model prices KV reads at the bytes of the KV format it is given.

A memory-bound decode step reads every cached token's K and V once per layer, so its attention
time is ``tokens x KV bytes per token / effective bandwidth``; the bytes per token of each format
are written out here from its layout (Llama-2-7B: 32 layers, 32 KV heads, head_dim 128), not
read from the code under test. A compute-bound prefill does not depend on the format.
"""
from __future__ import annotations

import pytest

from paged.sim.cost_model import CostModel, StepShape

LAYERS, KV_HEADS, HEAD_DIM = 32, 32, 128
# K and V per layer and KV head, per token
BYTES_PER_TOKEN = {
    "fp16": LAYERS * KV_HEADS * 2 * (HEAD_DIM * 2),                  # 2-byte elements: 524,288
    "fp8_e4m3": LAYERS * KV_HEADS * 2 * (HEAD_DIM * 1),              # 1-byte codes, scale per head (not per token)
    "int8": LAYERS * KV_HEADS * 2 * (HEAD_DIM * 1 + 2),              # + one fp16 scale per token
    "int4": LAYERS * KV_HEADS * 2 * (HEAD_DIM // 2 + HEAD_DIM // 32 * 4),  # packed nibbles + fp16 scale, zero per 32
}
A100_BW = 2039e9 * 0.8         # a100-80gb HBM x the default mbu
DECODE = StepShape.make([1] * 32, [4000] * 32)   # 32 sequences, 4,001 tokens each read
PREFILL = StepShape.make([2048], [0])


@pytest.mark.parametrize("fmt", list(BYTES_PER_TOKEN))
def test_decode_attention_reads_the_formats_bytes(fmt):
    cm = CostModel("llama-2-7b", "a100-80gb", kv_format=fmt)
    assert cm.kv_bytes_per_token == BYTES_PER_TOKEN[fmt]
    attention = cm.breakdown(DECODE).attention
    assert attention == pytest.approx(32 * 4001 * BYTES_PER_TOKEN[fmt] / A100_BW, rel=1e-9)
    assert cm.step_time(DECODE) == pytest.approx(cm.breakdown(DECODE).total, rel=1e-12)


def test_smaller_formats_make_decode_cheaper_and_leave_prefill_alone():
    cms = {f: CostModel("llama-2-7b", "a100-80gb", kv_format=f) for f in BYTES_PER_TOKEN}
    dec = {f: cm.step_time(DECODE) for f, cm in cms.items()}
    assert dec["int4"] < dec["fp8_e4m3"] < dec["int8"] < dec["fp16"]
    fp16, fp8 = cms["fp16"].breakdown(DECODE), cms["fp8_e4m3"].breakdown(DECODE)
    assert fp8.attention == pytest.approx(fp16.attention / 2, rel=1e-12)          # half the bytes
    assert fp8.linear == fp16.linear and fp8.overhead == fp16.overhead               # weights are not the KV
    pre = {f: cm.breakdown(PREFILL).attention for f, cm in cms.items()}              # compute bound: FLOPs only
    assert len(set(pre.values())) == 1


def test_paged_kernel_penalty_applies_to_the_formats_bytes():
    eff = 1 / 1.24   # block 16: the paged kernel's share of contiguous bandwidth (cost_model docstring)
    for fmt in ("fp16", "fp8_e4m3"):
        cm = CostModel("llama-2-7b", "a100-80gb", kv_format=fmt, kv_block_size=16)
        assert cm.breakdown(DECODE).attention == pytest.approx(32 * 4001 * BYTES_PER_TOKEN[fmt] / eff / A100_BW,
                                                               rel=1e-9)


def test_simulator_prices_steps_in_its_kv_format():
    from paged.sim.simulator import SimConfig, Simulator
    t = {f: Simulator(SimConfig(model="llama-2-7b", gpu="a100-80gb", kv_cache_dtype=f, paged_kernel_penalty=False))
         .cost.breakdown(DECODE).attention for f in ("fp16", "fp8")}
    assert t["fp8"] == pytest.approx(t["fp16"] / 2, rel=1e-12)
    assert t["fp16"] == pytest.approx(32 * 4001 * BYTES_PER_TOKEN["fp16"] / A100_BW, rel=1e-9)
