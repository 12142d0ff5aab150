"""One configuration for both executors (``paged.core.config``): each knob is checked once, in
the part that owns it; KV-format aliases resolve the same in the engine and the simulator; old
spellings are gone; both executors build the same KV manager from the same ``CacheConfig``;
the configs are plain dataclasses (no decorator rewrites their ``__init__``)."""
from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pandas as pd
import pytest
import torch

import paged.core.kv_factory as kv_manager_module  # where build_kv_manager builds the manager
from kernels.format_table import ALIASES, FORMATS, lookup
from paged.core.config import KV_CACHE_DTYPES, CacheConfig, SchedulerConfig
from paged.engine import EngineConfig, LLMEngine
from paged.engine.cache_sizing import kv_bytes_per_block
from paged.errors import ConfigError
from paged.models.loader import load_model
from paged.models.testing import make_tiny_checkpoint
from paged.sim.simulator import SimConfig, Simulator, simulate

ROOT = Path(__file__).resolve().parents[1]
BAD = [  # (knob, a value its part refuses)
    ("block_size", 0), ("block_size", 12), ("block_size", "16"), ("block_size", True),
    ("num_blocks", 0), ("num_blocks", 2.5), ("kv_cache_memory_bytes", -5), ("kv_cache_dtype", "fp7"),
    ("kv_cache_dtype", 8), ("enable_prefix_caching", "yes"), ("hash_fn", "md5"), ("eviction", "mru"),
    ("eviction", "score:decay=2"), ("host_eviction", 3), ("num_cpu_blocks", -1), ("swap_space_gib", -1.0),
    ("swap_space_gib", math.nan), ("swap_mode", "async"), ("swap_compression", "int2"),
    ("host_tier_threshold", 0.0), ("kv_share_with", {1: 1}), ("kv_share_with", [1, 0]),
    ("max_num_batched_tokens", 0), ("max_num_seqs", True), ("max_model_len", "100"),
    ("preemption_mode", "drop"), ("policy", "lifo"), ("watermark", 1.0), ("watermark", math.nan),
    ("priority_aging_steps", 0), ("compaction_threshold", 1.5), ("compaction_interval", 0),
    ("compaction_max_copies", 0), ("enable_block_compaction", 1),
]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("cfg"), "llama", num_layers=2, num_heads=4, num_kv_heads=2)


def _part(knob: str) -> type:
    return CacheConfig if knob in {f.name for f in dataclasses.fields(CacheConfig)} else SchedulerConfig


@pytest.mark.parametrize("knob, bad", BAD)
def test_a_bad_knob_raises_one_message_from_its_part(knob, bad):
    """The part's __post_init__ is the one check: the engine's and the simulator's configs raise
    exactly the part's ConfigError, which names the knob and the value given."""
    with pytest.raises(ConfigError) as e:
        _part(knob)(**{knob: bad})
    msg = str(e.value)
    assert knob in msg and (repr(bad) in msg or str(bad) in msg), msg
    for cls in (EngineConfig, SimConfig):
        with pytest.raises(ConfigError) as e:
            cls(**{knob: bad})
        assert str(e.value) == msg, cls


def test_each_knob_has_one_default_and_both_executors_have_every_knob():
    for part in (CacheConfig, SchedulerConfig):
        default = part()
        for f in dataclasses.fields(part):
            assert f.name in EngineConfig.knob_fields() and f.name in SimConfig.knob_fields()
            assert getattr(EngineConfig(), f.name) == getattr(SimConfig(), f.name) == getattr(default, f.name)
    assert EngineConfig().cache == SimConfig().cache == CacheConfig()
    assert EngineConfig().scheduler == SimConfig().scheduler == SchedulerConfig()


def test_values_are_normalized_once():
    np = pytest.importorskip("numpy")
    c = CacheConfig(block_size=np.int64(32), num_blocks=np.int32(7), kv_cache_dtype=" Half ")
    assert (c.block_size, c.num_blocks, c.kv_cache_dtype) == (32, 7, "fp16")
    assert type(c.block_size) is int and type(c.num_blocks) is int
    s = SchedulerConfig(max_num_seqs=np.int64(3), watermark=np.float32(0.5))
    assert type(s.max_num_seqs) is int and type(s.watermark) is float


@pytest.mark.parametrize("name", [n for n in KV_CACHE_DTYPES if n != "auto"])
def test_kv_cache_dtype_aliases_resolve_the_same_in_both_executors(name):
    want = lookup(name).name
    assert name in FORMATS or ALIASES[name] == want
    assert EngineConfig(kv_cache_dtype=name).kv_cache_dtype == SimConfig(kv_cache_dtype=name).kv_cache_dtype == want
    sim = Simulator(SimConfig(model="smollm2-135m", kv_cache_dtype=name, block_size=32))
    smol = type("Smol", (), dict(num_layers=30, num_kv_heads=3, head_dim=64))
    assert sim.kv_format.name == want
    assert sim.block_bytes == kv_bytes_per_block(smol, 32, want, torch.float16)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("share", [None, {1: 0}])
def test_engine_and_simulator_size_the_same_block(path, kv_cache_dtype, share):
    """'auto' is the model's dtype in both (float32 here); only kv_share_with's owner layers cost bytes."""
    cfg = dict(kv_cache_dtype=kv_cache_dtype, kv_share_with=share, num_blocks=16, block_size=8)
    eng = LLMEngine(load_model(path, dtype=torch.float32), EngineConfig(**cfg))
    sim = Simulator(SimConfig(model=f"{path}/config.json", gpu="a100-40gb", **cfg))
    assert eng.sizing.kv_cache_dtype == sim.kv_format.name == ("fp32" if kv_cache_dtype == "auto" else
                                                                lookup(kv_cache_dtype).name)
    assert eng.sizing.block_bytes == sim.block_bytes
    assert sim.model.kv_layers == (1 if share else 2)


def test_both_executors_build_the_same_kv_manager(path, monkeypatch):
    calls = []
    real = kv_manager_module.KVCacheManager

    def spy(*args, **kw):
        calls.append((args, {k: v for k, v in kw.items() if k != "recorder"}))
        return real(*args, **kw)

    monkeypatch.setattr(kv_manager_module, "KVCacheManager", spy)
    cache = CacheConfig(block_size=8, num_blocks=40, num_cpu_blocks=6, hash_fn="sha256", eviction="lfu",
                        enable_host_tier=True, host_eviction="score:decay=0.99", host_tier_threshold=0.9)
    sched = SchedulerConfig(max_model_len=64, max_num_seqs=4, preemption_mode="swap")
    parts = {**dataclasses.asdict(cache), **dataclasses.asdict(sched)}
    eng = LLMEngine(load_model(path), EngineConfig(**parts))
    sim = Simulator(SimConfig(**parts, model=f"{path}/config.json", gpu="a100-40gb"))
    assert eng.config.cache == sim.config.cache == cache and eng.config.scheduler == sim.config.scheduler == sched
    assert len(calls) == 2 and calls[0] == calls[1]
    assert calls[0][0] == (40, 8) and calls[0][1]["host_eviction"] == "score:decay=0.99"
    assert eng.scheduler.config == sim.scheduler.config
    assert eng.kv.num_cpu_blocks == sim.kv.num_cpu_blocks == 6


def test_the_cpu_pool_is_one_concept(path):
    """num_cpu_blocks or swap_space_gib (GiB), the same formula in both executors; unset, the engine
    mirrors its GPU pool and the simulator takes 4 GiB; neither swap nor the host tier: no pool."""
    loaded = load_model(path, dtype=torch.float32)
    kw = dict(num_blocks=16, block_size=8, preemption_mode="swap")
    sim_kw = dict(model=f"{path}/config.json", gpu="a100-40gb", **kw)
    block = LLMEngine(loaded, EngineConfig(**kw)).sizing.block_bytes
    gib = 5 * block / 2**30
    assert LLMEngine(loaded, EngineConfig(**kw, swap_space_gib=gib)).kv.num_cpu_blocks == 5
    assert Simulator(SimConfig(**sim_kw, swap_space_gib=gib)).kv.num_cpu_blocks == 5
    assert LLMEngine(loaded, EngineConfig(**kw, num_cpu_blocks=3)).kv.num_cpu_blocks == 3
    assert Simulator(SimConfig(**sim_kw, num_cpu_blocks=3)).kv.num_cpu_blocks == 3
    assert LLMEngine(loaded, EngineConfig(**kw)).kv.num_cpu_blocks == 16
    assert Simulator(SimConfig(**sim_kw)).kv.num_cpu_blocks == int(4 * 2**30 // block)
    assert Simulator(SimConfig(**{**sim_kw, "preemption_mode": "recompute"}, swap_space_gib=gib)).kv.num_cpu_blocks == 0
    with pytest.raises(ConfigError, match="not both"):
        CacheConfig(num_cpu_blocks=3, swap_space_gib=1.0)


def test_the_simulator_takes_kv_cache_memory_bytes():
    one = Simulator(SimConfig(model="llama-2-7b", gpu="a100-40gb"))
    sim = Simulator(SimConfig(model="llama-2-7b", gpu="a100-40gb", kv_cache_memory_bytes=int(10.5 * one.block_bytes)))
    assert sim.num_blocks == 10
    with pytest.raises(ConfigError, match="kv_cache_memory_bytes"):
        Simulator(SimConfig(model="llama-2-7b", gpu="a100-40gb", kv_cache_memory_bytes=100))


@pytest.mark.parametrize("old", ["kv_format", "swap_overlap", "swap_space", "kv_cache_memory", "seed"])
@pytest.mark.parametrize("cls", [EngineConfig, SimConfig])
def test_old_spellings_are_gone(cls, old):
    """No deprecated alias lives on: an old name is an unknown setting, listed with the valid ones."""
    assert old not in cls.knob_fields() and not hasattr(cls(), old)
    with pytest.raises(ConfigError, match=f"unknown setting.*{old}.*valid: block_size"):
        cls.check_names({old: 1})


@pytest.mark.parametrize("flag", ["--kv-format", "--swap-overlap", "--seed", "--swap-space", "--kv-cache-memory"])
def test_old_cli_flags_are_gone(capsys, flag):
    from paged.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["simulate", flag, "1"])
    assert f"unrecognized arguments: {flag}" in capsys.readouterr().err


def test_old_grid_keys_are_gone():
    from paged.cli import parse_grid
    from paged.errors import PagedError

    with pytest.raises(PagedError, match="unknown key 'kv_format'"):
        parse_grid(["kv_format=int8,fp16"])


def test_flat_construction_builds_the_parts():
    flat = SimConfig(model="llama-2-7b", block_size=32, policy="priority", swap_mode="overlap")
    assert flat.cache == CacheConfig(block_size=32, swap_mode="overlap")
    assert flat.scheduler == SchedulerConfig(policy="priority")
    assert flat.block_size == flat.cache.block_size == 32
    assert SimConfig(**flat.as_dict()) == flat
    moved = dataclasses.replace(flat, block_size=8)  # what Run.fresh do
    assert moved.block_size == moved.cache.block_size == 8 and moved.policy == moved.scheduler.policy == "priority"
    assert moved.swap_mode == "overlap" and flat.cache.block_size == 32
    normalized = EngineConfig(kv_cache_dtype="fp8", block_size=np_int(64))
    assert normalized.kv_cache_dtype == normalized.cache.kv_cache_dtype == "fp8_e4m3"
    assert type(normalized.block_size) is int
    with pytest.raises(dataclasses.FrozenInstanceError):
        flat.cache.block_size = 64
    with pytest.raises(dataclasses.FrozenInstanceError):
        flat.block_size = 64
    with pytest.raises(ConfigError, match=r"unknown setting\(s\) block_szie; valid: block_size"):
        SimConfig.check_names({"block_szie": 8})
    with pytest.raises(ConfigError, match=r"unknown setting\(s\) block_szie; valid: block_size"):
        simulate(pd.DataFrame({"arrival_time": [0.0], "prompt_tokens": [4], "output_tokens": [2]}),
                 SimConfig(model="llama-2-7b"), block_szie=8)


def np_int(v: int):
    import numpy as np

    return np.int64(v)


def test_no_config_is_built_by_metaprogramming():
    """EngineConfig and SimConfig are plain dataclasses: their ``__init__`` is the one dataclasses
    wrote, and ``composed`` (which rewrote it and added flat/deprecated properties) is gone."""
    import importlib.util

    assert importlib.util.find_spec("paged.core.composed") is None
    for cls in (EngineConfig, SimConfig):
        assert cls.__init__.__qualname__ == f"{cls.__name__}.__init__"
        assert "__create_fn__" in cls.__init__.__code__.co_names or cls.__init__.__module__ != "paged.core.composed"
        assert not [n for n, v in vars(cls).items() if isinstance(v, property)], cls


def test_the_engine_reads_groups_through_their_accessors():
    """No reaching through a scheduler request's payload: ``Groups.of``/``of_seq`` do that."""
    for name in ("llm_engine.py", "recovery.py"):
        src = (ROOT / "paged" / "engine" / name).read_text()
        assert not re.search(r"\.data\.group|scheduler\.requests\[", src), name
