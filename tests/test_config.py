"""ModelSpec / GPUSpec presets and KV sizing."""
import json

import pytest

from paged.sim.specs import (GPU_PRESETS, MODEL_PRESETS, ModelSpec, SizingError, get_gpu, get_model,
                          kv_cache_sizing, num_kv_blocks)
from paged.errors import ConfigError


@pytest.mark.parametrize("name,params_b", [("llama-2-7b", 6.74), ("llama-2-13b", 13.0), ("llama-2-70b", 69.0),
                                           ("llama-3-8b", 8.03), ("mistral-7b", 7.24), ("qwen2.5-7b", 7.62),
                                           ("smollm2-135m", 0.135)])
def test_param_counts_match_published(name, params_b):
    assert get_model(name).num_params / 1e9 == pytest.approx(params_b, rel=0.01)


def test_kv_bytes_per_token():
    m = get_model("llama-2-13b")
    assert m.kv_bytes_per_token() == 2 * 40 * 40 * 128 * 2 == 819200  # 800 KiB, as in the vLLM paper
    l3 = get_model("llama-3-8b")
    assert l3.kv_bytes_per_token("fp8") == l3.kv_bytes_per_token("fp16") / 2
    # int8: one fp16 scale per token per head -> 128 + 2 bytes per head per K/V
    assert l3.kv_bytes_per_token("int8") == 2 * 32 * 8 * (128 + 2)
    # int4 with group-32 fp16 scale+zero: 0.5 + 4/32 bytes per element
    assert l3.kv_bytes_per_token("int4") == pytest.approx(2 * 32 * 8 * 128 * 0.625)
    # tensor parallel splits kv heads; fewer kv heads than GPUs are replicated
    assert get_model("llama-2-70b").kv_bytes_per_token(tensor_parallel=4) == 2 * 80 * 2 * 128 * 2
    assert get_model("llama-2-70b").kv_bytes_per_token(tensor_parallel=16) == 2 * 80 * 1 * 128 * 2
    with pytest.raises(ConfigError, match="unknown kv format"):
        m.kv_bytes_per_token("fp7")


def test_sizing_llama13b_a100_40gb():
    s = kv_cache_sizing("llama-13b", "a100-40gb", block_size=16)
    # the vLLM paper's Fig. 1: 26 GB of weights, roughly 10-12 GB for the KV cache
    assert 24e9 < s.weight_bytes < 27e9
    assert 9e9 < s.kv_bytes < 13e9
    assert s.num_blocks * s.bytes_per_block <= s.kv_bytes
    assert s.num_tokens == s.num_blocks * 16
    assert num_kv_blocks("llama-13b", "a100-40gb", 32) == s.kv_bytes // (s.bytes_per_block * 2)
    # fp8 doubles the capacity
    assert num_kv_blocks("llama-13b", "a100-40gb", 16, kv_format="fp8") in (2 * s.num_blocks, 2 * s.num_blocks + 1)


def test_sizing_errors_say_what_to_change():
    with pytest.raises(SizingError, match="tensor_parallel"):
        kv_cache_sizing("llama-2-70b", "a100-80gb")
    assert num_kv_blocks("llama-2-70b", "a100-80gb", tensor_parallel=4) > 0
    with pytest.raises(ConfigError, match="utilization"):
        kv_cache_sizing("llama-2-7b", "a100-80gb", gpu_memory_utilization=1.5)


def test_presets_and_lookup():
    assert {"a100-40gb", "a100-80gb", "h100-sxm", "h200", "l4"} <= set(GPU_PRESETS)
    assert get_gpu("A100-80GB").hbm_bandwidth == 2039e9
    assert get_gpu("h100-sxm").hbm_bandwidth == 3352e9
    assert get_model("Llama-2-7B") is MODEL_PRESETS["llama-2-7b"]
    with pytest.raises(ConfigError, match="unknown model"):
        get_model("gpt-5")
    with pytest.raises(ConfigError, match="unknown GPU"):
        get_gpu("tpu")
    with pytest.raises(ConfigError, match="multiple"):
        ModelSpec("bad", 2, 64, 6, 4, 128, 100)


def test_from_hf_config(tmp_path):
    cfg = {"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
           "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
           "max_position_embeddings": 8192, "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = ModelSpec.from_hf_config(tmp_path)
    ref = get_model("smollm2-135m")
    assert m.num_params == ref.num_params and m.kv_bytes_per_token() == ref.kv_bytes_per_token()
    assert get_model(str(tmp_path / "config.json")).num_layers == 30
    with pytest.raises(ConfigError, match="lacks"):
        ModelSpec.from_hf_config({"hidden_size": 3})


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "fp32", "fp8_e4m3", "fp8_e5m2", "int8", "int4"])
def test_kv_bytes_agree_with_the_kernels_layout(fmt):
    """The simulator sizes the cache exactly as the engine's kernels lay it out."""
    kernels = pytest.importorskip("kernels")
    for name in ("llama-3-8b", "smollm2-135m", "qwen2.5-7b"):
        m = get_model(name)
        per_layer = kernels.bytes_per_token(fmt, m.num_kv_heads, m.head_dim)
        assert m.kv_bytes_per_token(fmt) == m.num_layers * per_layer


def test_h200_capacity_is_what_the_driver_reports():
    """nvidia-smi shows 143,771 MiB on an H200 ("141 GB"); 141e9 bytes would drop ~9 GiB of KV cache.
    The other presets follow the same convention (A100: 40,960 / 81,920 MiB)."""
    MiB = 1024**2
    assert get_gpu("h200").hbm_bytes == pytest.approx(143771 * MiB, rel=0.005)
    assert get_gpu("a100-40gb").hbm_bytes == 40960 * MiB and get_gpu("a100-80gb").hbm_bytes == 81920 * MiB
    h200 = kv_cache_sizing("llama-2-70b", "h200", tensor_parallel=2)
    assert h200.budget_bytes == pytest.approx(0.9 * 143771 * MiB, rel=0.005)


@pytest.mark.parametrize("name,tp", [("llama-2-13b", 3), ("qwen2.5-7b", 8), ("llama-2-70b", 3), ("mistral-7b", 6)])
def test_tensor_parallel_must_split_heads_evenly(name, tp):
    """vLLM refuses these; silently flooring kv_heads // tp undercounted KV bytes per GPU (13B at tp=3:
    13 of 13.3 heads) and the cost model used fractional heads."""
    from paged.sim.cost_model import CostModel

    with pytest.raises(ConfigError, match=f"tensor_parallel={tp} does not split"):
        get_model(name).kv_bytes_per_token(tensor_parallel=tp)
    with pytest.raises(ConfigError, match="choose one of"):
        kv_cache_sizing(name, "a100-80gb", tensor_parallel=tp)
    with pytest.raises(ConfigError):
        CostModel(name, "a100-80gb", tensor_parallel=tp)


def test_tensor_parallel_even_splits_and_replicated_kv_heads():
    assert get_model("qwen2.5-7b").kv_bytes_per_token(tensor_parallel=4) == 2 * 28 * 1 * 128 * 2
    assert get_model("llama-3-70b").kv_bytes_per_token(tensor_parallel=32) == 2 * 80 * 1 * 128 * 2  # replicated
    assert get_model("llama-2-13b").kv_bytes_per_token(tensor_parallel=5) == 2 * 40 * 8 * 128 * 2
