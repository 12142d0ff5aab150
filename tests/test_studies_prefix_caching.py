"""paged.studies.prefix_caching: verified hits under a colliding hash, eviction sweep; its figures
(paged.viz.prefix) from tables."""

from __future__ import annotations

import pandas as pd

from paged.studies import prefix_caching as P
from paged.viz import prefix as PV


def test_constant_hash_collision_is_rejected_by_token_check() -> None:
    df = P.collision_demo(block_size=4).set_index("request")
    assert df.loc["B", "hash index returns block"] is not None  # the key matched another request's block
    assert df.loc["B", "hash-only cache would reuse"] == "yes (wrong KV)"
    assert df.loc["B", "verified lookup reuses"] == "0 block(s)"
    assert df.loc["C", "verified lookup reuses"] == "1 block(s)"


def test_eviction_sweep_hit_rate_grows_with_the_pool() -> None:
    sw = P.eviction_sweep((160, 1280), num_requests=60, num_prefixes=4, prefix_tokens=256)
    assert (sw["finished"] == 60).all()
    assert sw["hit_rate"].iloc[0] < sw["hit_rate"].iloc[1]
    assert len(PV.eviction_figure(sw).data) == 1


def test_figures_from_tables() -> None:
    t = pd.DataFrame({"setting": ["off", "on"], "prefill_tokens_computed": [200, 120], "hit_tokens": [0, 80],
                      "hit_rate": [0.0, 0.4]})
    fig = PV.caching_figure(t)
    assert list(fig.data[0].y) == [200, 120] and list(fig.data[1].y) == [0, 80]


class _Tok:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def test_shared_prompt_requests_cycle_system_prompts() -> None:
    ps = P.shared_prompt_requests(_Tok(), 4, 2)
    n0 = len(P.SYSTEM_PROMPTS[0])
    assert ps[0][:n0] == ps[2][:n0] and ps[0][:n0] != ps[1][:n0]
