"""Prefill/decode apart (paged/fleet/disagg.py): transfer bytes and seconds, SLO attainment by hand."""
import math

import pandas as pd
import pytest

from paged.errors import ConfigError
from paged.fleet.disagg import colocated_slo, kv_transfer_bytes, slo_metrics, transfer_seconds


def test_kv_bytes_exact():
    # Llama-2-13B: 40 layers x 40 KV heads x head_dim 128 x (K and V) x 2 bytes = 819,200 bytes per token
    assert kv_transfer_bytes("llama-2-13b", 2048) == 819_200 * 2048
    assert kv_transfer_bytes("llama-2-13b", 0) == 0


def test_transfer_with_and_without_layerwise_overlap():
    assert transfer_seconds(100.0, 10.0) == pytest.approx(10.0)
    # 10 s of transfer behind a 4 s prefill over 5 layers: 6 s outlast it, plus one layer's 2 s
    assert transfer_seconds(100.0, 10.0, layers=5, prefill_s=4.0, layerwise=True) == pytest.approx(8.0)
    assert transfer_seconds(100.0, 10.0, layers=5, prefill_s=40.0, layerwise=True, latency_s=1.0) == pytest.approx(3.0)


def test_slo_metrics_on_a_hand_built_record():
    df = pd.DataFrame({"arrival_time_s": [0.0, 1.0, 2.0, 3.0], "first_token_s": [0.5, 3.0, 2.5, math.nan],
                       "finish_s": [1.5, 3.5, 12.5, math.nan], "num_output_tokens": [11, 11, 11, 11]})
    m = slo_metrics(df, ttft_slo_s=1.0, tpot_slo_s=0.2)
    # TTFT 0.5, 2.0, 0.5, never; TPOT 0.1, 0.05, 1.0, never -> both only for request 0
    assert (m["ttft_attain"], m["tpot_attain"], m["slo_attain"]) == (0.5, 0.5, 0.25)
    assert m["goodput_rps"] == pytest.approx(1 / 12.5)


def test_colocated_runs_every_request():
    m = colocated_slo(False, num_gpus=2, num_requests=20, rate=2.0, prompt_tokens=512, output_tokens=16)
    assert m["mode"] == "colocated" and 0 < m["slo_attain"] <= 1 and m["goodput_rps"] > 0


@pytest.mark.parametrize("call", [lambda: kv_transfer_bytes("llama-2-13b", -1),
                                  lambda: transfer_seconds(1.0, 0.0),
                                  lambda: transfer_seconds(1.0, 1.0, layers=0),
                                  lambda: slo_metrics(pd.DataFrame({"arrival_time_s": [0.0]}), 0.0, 1.0)])
def test_bad_input(call):
    with pytest.raises(ConfigError):
        call()


def test_disaggregated_pools_serve_every_request_and_pay_the_transfer():
    from paged.fleet.disagg_pools import disagg_study, run_disagg
    from paged.fleet.workloads import shared_prefix_trace
    from paged.sim.config import SimConfig
    tr = shared_prefix_trace(20, 2.0, 1, 512, 0, 16)
    tr["prefix_id"], tr["prefix_tokens"] = -1, 0
    cfg = SimConfig(model="llama-2-13b", enable_prefix_caching=False, enable_chunked_prefill=False)
    df = run_disagg(cfg, tr, 1, 1, bandwidth=1e9, layerwise=False)
    assert df["finish_s"].notna().all() and (df["finish_s"] > df["first_token_s"]).all()
    assert df["transfer_s"].to_numpy() == pytest.approx(kv_transfer_bytes("llama-2-13b", 512) / 1e9)
    out = disagg_study(num_gpus=2, prefill_gpus=(1,), num_requests=20, rate=2.0, prompt_tokens=512, output_tokens=16)
    assert list(out["mode"]) == ["colocated", "colocated_chunked", "disagg_1p1d"]
    with pytest.raises(ConfigError, match="prefill_gpus"):
        disagg_study(num_gpus=2, prefill_gpus=(2,))
