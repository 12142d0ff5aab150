"""The swap studies at smoke size: compressed-swap error on the real engine (tiny random Llama),
offload vs recompute and KV streaming on the simulator (70B on A100s)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from paged.studies.offload import VARIANTS, claim_table, offload_study, streaming_study, verdicts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("transformers")
    from paged.models import load_model
    from paged.models.testing import make_tiny_checkpoint
    return load_model(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama", num_heads=4, num_kv_heads=2,
                                           head_dim=32))


def test_swap_error_study_measures_only_the_codec(tiny):
    from paged.studies.swap_error import swap_error_study
    g = torch.Generator().manual_seed(0)
    texts = {"r": torch.randint(0, 256, (6 * 64,), generator=g).tolist()}
    df = swap_error_study(tiny, texts=texts, num_requests=6, context_length=64, block_size=4, greedy_tokens=32,
                          max_num_batched_tokens=16)  # check_lossless: uncompressed == never swapped
    assert set(df["compression"]) == {"none", "fp8", "int4"}
    after = df[df["scope"] == "after_swap"].set_index("compression")
    assert after.loc["none", "num_requests_swapped"] > 0 and after.loc["fp8", "n_tokens"] > 0
    assert 0 < after.loc["fp8", "kld_mean"] < after.loc["int4", "kld_mean"] < 0.1
    assert after.loc["none", "host_block_bytes"] > after.loc["fp8", "host_block_bytes"] \
        > after.loc["int4", "host_block_bytes"]
    assert (after["swapped_out_bytes"] > 0).all()


@pytest.fixture(scope="module")
def off():
    return offload_study(num_requests=60, pressures=(0.25,), latency_load=None)


def test_offload_study_overlap_never_slower_at_saturation(off):
    df = off
    assert list(df["variant"]) == [v[0] for v in VARIANTS]
    t = df.set_index("variant")["throughput_tok_s"]
    assert df.loc[df["variant"] == "recompute", "throughput_vs_recompute"].item() == 1.0
    assert t["swap overlap"] >= t["swap sync"] and t["swap overlap int4"] >= t["swap sync int4"]
    assert df["num_swapped_blocks"].iloc[1:].gt(0).all()
    assert verdicts(df)[0].startswith("swap preemption")


def test_streaming_study_orders_the_variants():
    df = streaming_study(contexts=(1024,), kv_fractions=(0.25,), max_batch=64).set_index("variant")
    r = df["throughput_vs_device"]
    assert r["device only"] == 1.0
    assert r["stream overlap int4"] > r["stream overlap fp8"] > r["stream overlap"] > r["stream sync"] >= 1.0
    assert np.isnan(df.loc["device only", "tbt_2x_s"]) and df.loc["stream sync", "tbt_2x_vs_device"] > 1
    assert "KV streaming" in verdicts(streaming=df.reset_index())[0]


def test_engine_swap_study_and_claim_table(tiny, off):
    from paged.studies.preemption import engine_swap_study
    df = engine_swap_study(tiny, num_requests=6, prompt_len=24, max_tokens=16, block_size=4, max_num_seqs=4)
    v = df.set_index("variant")
    assert v.loc["swap sync", "num_preemptions"] > 0 and v.loc["swap sync", "swapped_blocks"] > 0
    assert v.loc[["recompute", "swap sync", "swap overlap"], "same_outputs"].all()  # lossless variants
    assert v.loc["swap overlap int4", "link_mb"] < v.loc["swap overlap", "link_mb"]
    st = streaming_study(contexts=(1024,), kv_fractions=(0.25,), max_batch=64)
    table = claim_table(off, st, df)
    assert list(table.columns) == ["claim", "ours", "where", "conditions"] and len(table) == 4
