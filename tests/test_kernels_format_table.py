"""One KV-format table (kernels/format_table.py) sizes blocks for the engine, the simulator and the
allocator alike; format codes are spelled once."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import kernels
from kernels import format_table
from paged.engine.cache_sizing import kv_bytes_per_block as _kv_bytes_per_block
from paged.sim.simulator import SimConfig, Simulator
from paged.sim.specs import KV_FORMATS, ModelSpec, get_kv_format

ROOT = Path(__file__).resolve().parents[1]
# SmolLM2-135M's attention shape: 30 layers, 3 KV heads of 64
SMOL = ModelSpec("smol-test", num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3,
                 intermediate_size=1536, vocab_size=49152)
SMOL_CFG = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64)
BLOCK_SIZES = (1, 16, 32, 256)


@pytest.mark.parametrize("fmt", sorted(format_table.FORMATS))
def test_engine_and_simulator_size_a_block_identically(fmt):
    for bs in BLOCK_SIZES:
        engine = _kv_bytes_per_block(SMOL_CFG, bs, fmt, torch.float16)
        assert SMOL.kv_bytes_per_token(fmt, block_size=bs) * bs == engine, (fmt, bs)
    sim = Simulator(SimConfig(model="smollm2-135m", gpu="a100-80gb", kv_cache_dtype=fmt, block_size=32))
    assert sim.block_bytes == sim.sizing.bytes_per_block == _kv_bytes_per_block(SMOL_CFG, 32, fmt, torch.float16)


@pytest.mark.parametrize("fmt", sorted(format_table.FORMATS))
def test_the_table_is_what_the_allocator_allocates(fmt):
    """nbytes = tokens x bytes_per_token + the fixed per-layer parts (fp8 head scales, int4_kivi staging)."""
    nb, bs, h = 5, 8, 3
    for d in (16, 64):  # head_dim 16: one int4 group of 16 (the default group is min(32, head_dim))
        layer = kernels.allocate_kv_cache(nb, bs, h, d, fmt, dtype=torch.float16, num_staging_blocks=2
                                          if format_table.FORMATS[fmt].k_per_channel else None)
        fixed = 0
        if layer.staging is not None:
            fixed = layer.staging.nbytes()
        elif layer.kv_format.scale == "head":
            fixed = 2 * h * 4
        assert layer.nbytes() - fixed == nb * bs * kernels.bytes_per_token(fmt, h, d, block_size=bs), d


def test_int4_kivi_in_the_simulator():
    assert "int4_kivi" in KV_FORMATS and get_kv_format("kivi").name == "int4_kivi"
    # per-channel K scales (4 bytes per channel per block-head) are spread over the block
    assert SMOL.kv_bytes_per_token("int4_kivi", block_size=1) > SMOL.kv_bytes_per_token("int4_kivi", block_size=256)
    assert SMOL.kv_bytes_per_token("int4_kivi", block_size=16) == 30 * kernels.bytes_per_token("int4_kivi", 3, 64)


def test_format_codes_are_named():
    """The FMT_* constexprs are the table's codes, and no kernel source compares a code with a literal."""
    common = pytest.importorskip("kernels.triton_impl.common")
    for name, fmt in format_table.FORMATS.items():
        const = {0: common.FMT_PLAIN, 1: common.FMT_E4M3, 2: common.FMT_E5M2, 3: common.FMT_INT8,
                 4: common.FMT_INT4, 5: common.FMT_INT4_KIVI}[fmt.code]
        assert const.value == fmt.code, name
    magic = re.compile(r"\b(FMT|fmt|fmt\.code|kv_format\.code)\s*(==|!=|in|not in)\s*\(?\d")
    sources = [*(ROOT / "kernels").rglob("*.py"), ROOT / "benchmarks" / "kernels.py"]
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in sources
            for i, line in enumerate(p.read_text().splitlines(), 1) if magic.search(line)]
    assert not hits, hits


def test_the_table_imports_without_torch():
    code = ("import sys; import kernels.format_table, paged.sim.specs; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_bad_names_and_groups_say_what_to_change():
    with pytest.raises(kernels.KVFormatError, match="int4_kivi"):
        format_table.lookup("int3")
    with pytest.raises(kernels.ShapeError, match="divide head_dim 80"):
        format_table.bytes_per_token("int4", 8, 80)
    from paged.errors import ConfigError
    with pytest.raises(ConfigError, match="divide head_dim 80"):
        ModelSpec("odd", 2, 640, 8, 8, 1024, 100).kv_bytes_per_token("int4")


@pytest.mark.parametrize("alias", sorted(format_table.FRONT))
def test_front_formats_are_sized_alike_by_the_engine_and_the_simulator(alias):
    """The split formats of the study's front, by alias, at their block size (32)."""
    bs = format_table.FRONT_BLOCK_SIZE
    engine = _kv_bytes_per_block(SMOL_CFG, bs, alias, torch.float16)
    assert SMOL.kv_bytes_per_token(alias, block_size=bs) * bs == engine
    assert format_table.lookup(alias).name == format_table.FRONT[alias]
    sim = Simulator(SimConfig(model="smollm2-135m", gpu="a100-80gb", kv_cache_dtype=alias, block_size=bs))
    assert sim.block_bytes == engine
