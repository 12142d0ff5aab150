"""paged.studies.preemption: swap vs recompute costs from the cost model, simulated modes; its
figures (paged.viz.preemption)."""

from __future__ import annotations

import pandas as pd
import pytest

from paged.sim.specs import get_gpu, get_model
from paged.studies import preemption as R
from paged.viz import preemption as RV


def test_cost_table_prices_bytes_over_pcie_and_hbm() -> None:
    c = R.cost_table("llama-2-70b", "a100-80gb", (1024, 4096), tensor_parallel=4)
    per_tok = get_model("llama-2-70b").kv_bytes_per_token("fp16", 4)
    assert per_tok == 2 * 80 * 2 * 128 * 2  # 2 of the 8 KV heads per GPU
    assert c["kv_bytes_per_gpu"].tolist() == [1024 * per_tok, 4096 * per_tok]
    g = get_gpu("a100-80gb")
    assert c["hbm_read_s"].iloc[0] == pytest.approx(1024 * per_tok / g.hbm_bandwidth)
    assert c["swap_out_and_in_s"].iloc[0] >= 2 * 1024 * per_tok / g.pcie_bandwidth  # at most full PCIe speed
    assert c["hbm_GBps"].iloc[0] / c["pcie_GBps"].iloc[0] == pytest.approx(2039 / 32)
    assert (c["recompute_s"].diff().dropna() > 0).all()  # more tokens, more prefill
    assert len(RV.cost_figure(c).data) == 3


def test_simulated_modes_finish_the_trace() -> None:
    df = R.simulate_modes(num_requests=40, num_blocks=300)
    assert df["mode"].tolist() == ["recompute", "swap"] and (df["finished"] == 40).all()
    assert df.loc[df["mode"] == "recompute", "swapped_blocks"].iloc[0] == 0


def test_modes_figure_marks_preemptions() -> None:
    st = pd.DataFrame({"step": [1, 2, 3], "num_used_blocks": [4, 5, 3], "num_preempted": [0, 1, 0]})
    fig = RV.modes_figure({"reference": st.assign(num_preempted=0), "swap": st})
    assert len(fig.data) == 3 and list(fig.data[2].x) == [2]


def test_pressure_prompts_are_distinct_and_seeded() -> None:
    a, b = R.pressure_prompts(3, 10, seed=1), R.pressure_prompts(3, 10, seed=1)
    assert a == b and len({tuple(p) for p in a}) == 3 and all(len(p) == 10 for p in a)
