"""The logits filter against hand computations: top-p boundary, top-k ties, both, temperature.

Probabilities are dyadic fractions (0.5, 0.25, 0.125, 3/32, ...) so that softmax and its
cumulative sum are exact in float32 and the boundary `mass before >= top_p` is tested
at equality.
"""
from __future__ import annotations

import math

import pytest
import torch

from paged.engine.sampling import filter_logits

INF = float("inf")


def kept(x: torch.Tensor) -> list[int]:
    return [i for i, v in enumerate(x.tolist()) if v != -INF]


def logits_of(probs) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs], dtype=torch.float32)


DYADIC = [0.5, 0.25, 0.125, 0.09375, 0.03125]   # cumulative 0.5, 0.75, 0.875, 0.96875, 1


@pytest.mark.parametrize("top_p, expected", [
    (0.5, [0]),            # token 0 alone reaches 0.5 exactly: nothing else is needed
    (0.5000001, [0, 1]),   # just above: token 1 is needed
    (0.75, [0, 1]),        # mass before token 2 is exactly 0.75: dropped
    (0.76, [0, 1, 2]),
    (0.875, [0, 1, 2]),    # mass before token 3 is exactly 0.875
    (0.96875, [0, 1, 2, 3]),
    (0.97, [0, 1, 2, 3, 4]),
    (1e-6, [0]),           # the most likely token always stays
    (1.0, [0, 1, 2, 3, 4]),
])
def test_top_p_keeps_the_smallest_prefix_reaching_top_p(top_p, expected):
    """Catches `drop = cum > top_p` (drops the token that crosses top_p: at 0.76 it keeps
    [0, 1]) and `cum - probs > top_p` (keeps token 1 at top_p = 0.5)."""
    x = filter_logits(logits_of(DYADIC), 1.0, 0, top_p)
    assert kept(x) == expected
    assert torch.equal(x[expected], logits_of(DYADIC)[expected])  # survivors unchanged


def test_top_p_works_on_sorted_order_not_index_order():
    probs = [0.09375, 0.25, 0.03125, 0.5, 0.125]
    assert kept(filter_logits(logits_of(probs), 1.0, 0, 0.75)) == [1, 3]
    assert kept(filter_logits(logits_of(probs), 1.0, 0, 0.8)) == [1, 3, 4]


def test_top_k_keeps_ties_at_the_kth_value():
    x = torch.tensor([1.0, 3.0, 2.0, 2.0, 0.5])
    assert kept(filter_logits(x, 1.0, 1, 1.0)) == [1]
    assert kept(filter_logits(x, 1.0, 2, 1.0)) == [1, 2, 3]   # both 2.0s tie for 2nd place
    assert kept(filter_logits(x, 1.0, 3, 1.0)) == [1, 2, 3]
    assert kept(filter_logits(x, 1.0, 4, 1.0)) == [0, 1, 2, 3]
    for disabled in (0, -1, 5, 9):
        assert kept(filter_logits(x, 1.0, disabled, 1.0)) == [0, 1, 2, 3, 4]


def test_top_k_then_top_p_on_the_renormalised_survivors():
    """top_k = 3 keeps 0.5, 0.25, 0.125, renormalised to 4/7, 2/7, 1/7; top_p then works on
    those. At top_p 0.55, 4/7 = 0.571 suffices alone, while on the full distribution 0.5
    does not: catches top-p applied before top-k or to unnormalised probabilities."""
    x = logits_of(DYADIC)
    assert kept(filter_logits(x, 1.0, 0, 0.55)) == [0, 1]
    assert kept(filter_logits(x, 1.0, 3, 0.55)) == [0]
    assert kept(filter_logits(x, 1.0, 3, 0.6)) == [0, 1]
    assert kept(filter_logits(x, 1.0, 3, 0.86)) == [0, 1, 2]   # mass before the third: 6/7 = 0.857
    assert kept(filter_logits(x, 1.0, 0, 0.9)) == [0, 1, 2, 3]
    assert kept(filter_logits(x, 1.0, 3, 0.9)) == [0, 1, 2]    # k caps what p would keep
    assert kept(filter_logits(torch.tensor([3.0, 2.0, 2.0, 1.0]), 1.0, 2, 0.5)) == [0]  # ties, then p


def test_temperature_scales_before_filtering():
    """probs [0.5, 0.3, 0.2]: at T = 0.5 they become p^2 / sum = 0.658, 0.237, 0.105; at
    T = 2, sqrt(p) / sum = 0.415, 0.322, 0.263. top_p 0.6 keeps 1, 2, 2 tokens at
    T = 0.5, 1, 2; top_p 0.75 keeps 2 at T = 1 but 3 at T = 2."""
    x = logits_of([0.5, 0.3, 0.2])
    assert torch.allclose(filter_logits(x, 0.5, 0, 1.0), x / 0.5)
    assert torch.allclose(torch.softmax(filter_logits(x, 0.5, 0, 1.0), -1),
                          torch.tensor([0.25, 0.09, 0.04]) / 0.38)
    assert [kept(filter_logits(x, t, 0, 0.6)) for t in (0.5, 1.0, 2.0)] == [[0], [0, 1], [0, 1]]
    assert [kept(filter_logits(x, t, 0, 0.75)) for t in (1.0, 2.0)] == [[0, 1], [0, 1, 2]]
