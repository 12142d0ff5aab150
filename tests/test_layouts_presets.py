"""Today's KV layouts sized exactly: bytes per token and per request at 4k and 128k tokens.

Every expected figure is written out from the model's config.json numbers (see
``paged/sim/presets_modern.py``): layers x values per token x bytes, pages x page bytes. A
request's pool bytes count whole pages (blocks of 16 tokens of one group's layers, padding layers
included); its content bytes count only what the real layers hold.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from paged.core.kv_groups import FULL, SLIDING, STATE, make_layout
from paged.errors import ConfigError
from paged.sim.specs import ModelSpec, get_model, kv_cache_sizing

K4, K128 = 4096, 131072
BS = 16


def kinds(layout):
    return [(g.kind, g.num_layers) for g in layout.groups]


# ---- MLA -------------------------------------------------------------------------------------

def test_mla_deepseek_v3_is_one_latent_per_layer_never_split():
    m = get_model("deepseek-v3")
    per_token = 61 * (512 + 64) * 2  # 61 layers x (kv_lora_rank + qk_rope_head_dim) x bf16
    assert per_token == 70_272       # the "~70 KB per token"
    assert m.kv_bytes_per_token() == per_token
    assert m.kv_bytes_per_token(tensor_parallel=8) == per_token  # the latent is whole on every GPU
    assert m.kv_bytes_per_token("fp8") == 61 * 576 * 1
    layout = m.kv_layout(tensor_parallel=8)
    assert kinds(layout) == [(FULL, 61)] and not layout.is_hybrid
    assert layout.page_bytes == BS * 61 * 576 * 2 == 1_124_352
    assert layout.request_bytes(K4) == 256 * 1_124_352 == K4 * per_token
    assert layout.request_bytes(K128) == 8192 * 1_124_352 == 9_210_691_584
    # beside a GQA model of the same era at tensor parallel 8: Llama-3-70B, 8 KV heads split 8 ways
    llama = get_model("llama-3-70b")
    assert llama.kv_bytes_per_token() == 80 * 2 * 8 * 128 * 2 == 327_680
    assert llama.kv_bytes_per_token(tensor_parallel=8) == 80 * 2 * 1 * 128 * 2 == 40_960
    # sizing uses the whole latent per GPU
    assert kv_cache_sizing(m, "h200", tensor_parallel=8).bytes_per_block == 1_124_352


def test_mla_refuses_scaled_formats():
    with pytest.raises(ConfigError, match="plain formats"):
        get_model("deepseek-v3").kv_bytes_per_token("int8")


# ---- sliding window (every layer) ---------------------------------------------------------------

def test_sliding_window_every_layer_mistral_7b_v01():
    # mistralai/Mistral-7B-v0.1 config.json: 32 layers, 8 KV heads, head_dim 128, sliding_window 4096
    m = get_model("mistral-7b-v0.1")
    assert (m.num_layers, m.num_kv_heads, m.head_dim, m.sliding_window, m.max_model_len) == (32, 8, 128, 4096, 32768)
    per_layer = 2 * 8 * 128 * 2
    assert m.kv_bytes_per_token() == 32 * per_layer == 131_072
    layout = m.kv_layout()
    assert kinds(layout) == [(SLIDING, 32)] and layout.is_hybrid
    page = BS * 32 * per_layer
    assert layout.page_bytes == page == 2_097_152
    # 4k tokens: the next query sees positions 1..4096, so token 0 may go, but its block stays
    assert layout.request_pages(K4) == 256
    assert layout.content_bytes(K4) == 32 * 4095 * per_layer
    # 128k tokens: skipped = 131072 - 4096 + 1 = 126977 tokens -> 7936 whole blocks freed
    assert layout.request_pages(K128) == 8192 - 126977 // 16 == 256
    assert layout.request_bytes(K128) == 256 * page == 536_870_912
    assert layout.content_bytes(K128) == 32 * 4095 * per_layer  # flat once past the window
    # the whole request: 256 pages at 4k (536,870,912 bytes), still 256 at 128k; every layer full: 64x more
    assert layout.request_bytes(K4) == layout.request_bytes(K128) == 256 * 2_097_152
    assert get_model("mistral-7b").kv_layout().request_bytes(K128) == 8192 * 2_097_152


def test_all_sliding_model_is_simulated(capsys):
    """``python -m paged simulate --model mistral-7b-v0.1`` runs on the anchored pool and frees
    every page at the end; the pages it held never exceed what the windows need."""
    import json
    from paged.cli import main
    from paged.sim.config import SimConfig
    from paged.sim.simulator import Simulator
    from paged.sim.workload import synthetic_trace

    assert main(["simulate", "--model", "mistral-7b-v0.1", "--gpu", "a100-80gb", "--num-requests", "12",
                 "--workload", "sharegpt", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests_finished"] == 12 and out["num_blocks_in_use_at_end"] == 0
    # long prompts sharing a 4,800-token prefix, no memory pressure: the hits found from the right (the
    # window before the hit point) are the hits of the same model with every layer full, on fewer pages
    from paged.studies.layouts import every_layer_full
    trace = synthetic_trace("sharegpt", 16, num_prefixes=1, prefix_tokens=4800, max_model_len=8192)
    runs = {}
    for m in ("mistral-7b-v0.1", every_layer_full("mistral-7b-v0.1")):
        sim = Simulator(SimConfig(model=m, gpu="a100-80gb", num_blocks=1200, max_model_len=8192))
        runs[sim.layout.is_hybrid] = res = sim.run(trace)
        sim.kv.check_invariants()
        assert res.summary["num_blocks_in_use_at_end"] == 0
    sliding, full = runs[True], runs[False]
    assert sliding.summary["prefix_cache_hit_tokens"] == full.summary["prefix_cache_hit_tokens"] == 15 * 4800
    assert sliding.steps["num_used_blocks"].max() < full.steps["num_used_blocks"].max()


# ---- local / global hybrids -----------------------------------------------------------------------

def test_local_global_gemma_3_27b():
    m = get_model("gemma-3-27b")
    per_layer = 2 * 16 * 128 * 2  # 8192
    assert m.kv_bytes_per_token() == 62 * per_layer == 507_904
    layout = m.kv_layout()
    # 62 layers, (i + 1) % 6 == 0 global: 10 global, 52 local -> groups of 10 (vLLM's rule), 8 padding layers
    assert layout.layers_per_group == 10 and layout.num_padding_layers == 8
    assert kinds(layout) == [(FULL, 10)] + [(SLIDING, 9)] * 4 + [(SLIDING, 8)] * 2
    page = BS * 10 * per_layer
    assert layout.page_bytes == page == 1_310_720
    # 4k: global 256 blocks; local: skipped 4096 - 1024 + 1 = 3073 -> 192 blocks freed, 64 kept, x 6 groups
    assert layout.request_pages(K4) == 256 + 6 * (256 - 3073 // 16) == 640
    assert layout.request_bytes(K4) == 640 * page == 838_860_800
    assert layout.content_bytes(K4) == per_layer * (10 * 4096 + 52 * 1023)
    # 128k: global 8192 blocks; local skipped 130049 -> 8128 freed, 64 kept
    assert layout.request_pages(K128) == 8192 + 6 * (8192 - 130049 // 16) == 8576
    assert layout.request_bytes(K128) == 8576 * page == 11_240_734_720
    assert layout.content_bytes(K128) == per_layer * (10 * K128 + 52 * 1023)
    # against every layer global (vLLM's --disable-hybrid-kv-cache-manager): 62 x 128k x 8192 bytes
    assert replace(m, layer_pattern="").kv_layout().request_bytes(K128) == 62 * K128 * per_layer
    assert 62 * K128 * per_layer / layout.request_bytes(K128) > 5.9


def test_alternating_gpt_oss_120b():
    m = get_model("gpt-oss-120b")
    per_layer = 2 * 8 * 64 * 2  # 2048
    assert m.kv_bytes_per_token() == 36 * per_layer == 73_728
    layout = m.kv_layout()
    assert kinds(layout) == [(FULL, 18), (SLIDING, 18)] and layout.num_padding_layers == 0
    page = BS * 18 * per_layer
    assert layout.page_bytes == page == 589_824
    # window 128: skipped at 4096 = 3969 -> 248 blocks freed, 8 kept
    assert layout.request_pages(K4) == 256 + (256 - 3969 // 16) == 264
    assert layout.request_bytes(K4) == 264 * page == 155_713_536
    assert layout.request_pages(K128) == 8192 + (8192 - (K128 - 127) // 16) == 8200
    assert layout.request_bytes(K128) == 8200 * page == 4_836_556_800
    assert layout.content_bytes(K128) == per_layer * (18 * K128 + 18 * 127)
    # tensor parallel 8 splits the 8 KV heads: 1 per GPU
    assert m.kv_layout(tensor_parallel=8).page_bytes == BS * 18 * 2 * 1 * 64 * 2


# ---- fixed state per request ------------------------------------------------------------------------

def test_fixed_state_qwen3_next_80b():
    m = get_model("qwen3-next-80b-a3b")
    state = ((2 * 16 * 128 + 32 * 128) * (4 - 1) + 32 * 128 * 128) * 2  # conv + recurrent, bf16
    assert state == 1_097_728 == m.state_bytes_per_layer
    per_layer = 2 * 2 * 256 * 2  # full attention: 2 KV heads x head_dim 256
    assert m.kv_bytes_per_token() == 12 * per_layer == 24_576  # only the 12 attention layers grow
    layout = m.kv_layout()
    assert kinds(layout) == [(FULL, 12), (STATE, 12), (STATE, 12), (STATE, 12)]
    page = BS * 12 * per_layer
    assert layout.page_bytes == page == 393_216
    state_pages = -(-(12 * state) // page)
    assert state_pages == 34  # 33.5 pages rounded up
    assert layout.request_pages(K4) == 256 + 3 * 34 == 358
    assert layout.request_bytes(K4) == 358 * page == 140_771_328
    assert layout.request_pages(K128) == 8192 + 3 * 34 == 8294
    assert layout.request_bytes(K128) == 8294 * page == 3_261_333_504
    assert layout.content_bytes(K4) == 12 * K4 * per_layer + 36 * state
    assert layout.content_bytes(K128) - layout.content_bytes(K4) == 12 * (K128 - K4) * per_layer  # state is flat
    # tensor parallel 2 splits the heads and the DeltaNet state
    assert m.kv_layout(tensor_parallel=2).groups[1].state_bytes == state // 2


# ---- presets beside LLaMA -----------------------------------------------------------------------------

@pytest.mark.parametrize("name, by_hand", [
    ("qwen2.5-72b", 80 * 2 * 8 * 128 * 2),     # 327,680: GQA, 8 KV heads
    ("deepseek-v3", 61 * (512 + 64) * 2),      # 70,272: MLA latent
    ("gemma-3-27b", 62 * 2 * 16 * 128 * 2),    # 507,904 while a token is inside every window
    ("gpt-oss-120b", 36 * 2 * 8 * 64 * 2),     # 73,728 likewise
    ("qwen3-next-80b-a3b", 12 * 2 * 2 * 256 * 2),  # 24,576: attention layers only
])
def test_preset_bytes_per_token(name, by_hand):
    assert get_model(name).kv_bytes_per_token() == by_hand


def test_moe_presets_take_the_model_cards_parameter_counts():
    assert get_model("deepseek-v3").weight_bytes() == 671_000_000_000  # FP8: one byte per weight
    assert get_model("gpt-oss-120b").matmul_params_per_token == 5_100_000_000
    assert abs(get_model("qwen2.5-72b").num_params / 72.7e9 - 1) < 0.01  # the card's 72.7B from the shapes


# ---- bad input ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, match", [
    (dict(layer_pattern="WX", sliding_window=8), "only F, W and S"),
    (dict(layer_pattern="WF"), "sliding_window"),
    (dict(layer_pattern="SF"), "state_bytes_per_layer"),
    (dict(layer_pattern="S", state_bytes_per_layer=8), "state layers only"),
    (dict(kv_lora_rank=512), "both kv_lora_rank and qk_rope_head_dim"),
])
def test_bad_layout_fields_say_what_to_change(kw, match):
    with pytest.raises(ConfigError, match=match):
        ModelSpec("bad", 4, 64, 4, 4, 128, 100, **kw)


def test_make_layout_checks_its_input():
    with pytest.raises(ConfigError, match="unknown layer kinds"):
        make_layout(["full", "local"], 16, 16)
    with pytest.raises(ConfigError, match="window"):
        make_layout(["full", "sliding"], 16, 16)
    # 1.5x rule: 12 sliding + 13 full pad to groups of 13 (vLLM's gpt-oss-20b + eagle example)
    layout = make_layout(["sliding"] * 12 + ["full"] * 13, 16, 16, window=128)
    assert layout.layers_per_group == 13 and kinds(layout) == [(FULL, 13), (SLIDING, 12)]
