"""The quantization study's metrics against numbers worked out by hand.

Small distributions whose KL divergence, NLL, Δp and agreement are written out in closed form
here (never computed by the code under test): the rows are chosen so that KL(p‖q) and KL(q‖p)
differ, so a reversed divergence fails. ``summarize``'s columns (means, standard errors, the
percentiles numpy interpolates, Δp in percent), the survival curve and the perplexity pipeline
(chunking, scored positions, per-source means) are checked the same way; the last test checks
that the study feeds the base run as ``p`` (the quantized run as ``q``), on a tiny random model.
"""
from __future__ import annotations

import math
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch

from paged.quant.metrics import TokenStats, summarize, survival, token_stats
from paged.quant.perplexity import perplexity
from paged.quant.text import make_chunks, scored_slice

LN = math.log
# (base distribution p, quantized distribution q, target index), one row per scored token
ROWS = [((0.5, 0.3, 0.2), (0.25, 0.25, 0.5), 1),
        ((0.8, 0.1, 0.1), (0.5, 0.25, 0.25), 1),
        ((0.7, 0.2, 0.1), (0.7, 0.2, 0.1), 2)]
# KL(p||q) = sum_i p_i ln(p_i / q_i), written out per row
KL_PQ = [0.5 * LN(0.5 / 0.25) + 0.3 * LN(0.3 / 0.25) + 0.2 * LN(0.2 / 0.5),   # = 0.21801
         0.8 * LN(0.8 / 0.5) + 0.1 * LN(0.1 / 0.25) + 0.1 * LN(0.1 / 0.25),  # = 0.19274
         0.0]
# the reverse, KL(q||p), for the check that the two differ on these rows
KL_QP = [0.25 * LN(0.25 / 0.5) + 0.25 * LN(0.25 / 0.3) + 0.5 * LN(0.5 / 0.2),  # = 0.23928
         0.5 * LN(0.5 / 0.8) + 0.25 * LN(0.25 / 0.1) + 0.25 * LN(0.25 / 0.1),  # = 0.22314
         0.0]


def _logits(dists, shift: float) -> torch.Tensor:
    """float32 rows of log-probabilities plus a constant (softmax does not see it)."""
    return (torch.log(torch.tensor(dists, dtype=torch.float64)) + shift).float()


def test_rows_separate_the_two_directions():
    assert abs(KL_PQ[0] - KL_QP[0]) > 0.02 and abs(KL_PQ[1] - KL_QP[1]) > 0.03
    assert KL_PQ[1] == pytest.approx(0.8 * LN(1.6) + 0.2 * LN(0.4))


def test_token_stats_match_closed_forms():
    base = _logits([r[0] for r in ROWS], shift=3.0)
    q = _logits([r[1] for r in ROWS], shift=-1.5)
    targets = torch.tensor([r[2] for r in ROWS])
    s = token_stats(base, q, targets)
    # float32 logits of the probabilities: 1e-6 relative is float32's rounding, far below the
    # 0.02 that separates KL(p||q) from KL(q||p) here
    np.testing.assert_allclose(s.cat("kld"), KL_PQ, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(s.cat("nll_base"), [-LN(0.3), -LN(0.1), -LN(0.1)], rtol=1e-6)
    np.testing.assert_allclose(s.cat("nll_q"), [-LN(0.25), -LN(0.25), -LN(0.1)], rtol=1e-6)
    np.testing.assert_allclose(s.cat("dp"), [0.25 - 0.3, 0.25 - 0.1, 0.0], atol=1e-6)
    # top-1: row 0's p peaks at 0 and q at 2; rows 1 and 2 agree
    assert s.cat("same_top1").tolist() == [0.0, 1.0, 1.0]


def test_kld_is_never_negative_and_zero_for_equal_rows():
    x = torch.randn(5, 7)
    s = token_stats(x, x.clone(), torch.zeros(5, dtype=torch.long))
    assert s.cat("kld").tolist() == [0.0] * 5 and s.cat("dp").tolist() == [0.0] * 5
    assert s.cat("same_top1").tolist() == [1.0] * 5


def _pooled() -> TokenStats:
    """Four tokens in two parts (what the study pools over chunks)."""
    s = TokenStats()
    for sl in (slice(0, 1), slice(1, 4)):
        part = TokenStats(nll_base=[np.array([1.0, 2.0, 3.0, 4.0])[sl]], nll_q=[np.array([1.5, 2.0, 3.5, 4.0])[sl]],
                          kld=[np.array([0.0, 0.1, 0.2, 0.3])[sl]], same_top1=[np.array([1.0, 0.0, 1.0, 1.0])[sl]],
                          dp=[np.array([0.1, -0.1, 0.2, 0.0])[sl]])
        s.add(part)
    return s


def test_summarize_columns_by_hand():
    m = summarize(_pooled())
    assert m["n_tokens"] == 4
    assert m["ppl_base"] == pytest.approx(math.exp(2.5)) and m["ppl_q"] == pytest.approx(math.exp(2.75))
    # NLL differences 0.5, 0, 0.5, 0: mean 0.25, sample variance 4 x 0.0625 / 3 = 1/12
    assert m["delta_nll"] == pytest.approx(0.25)
    assert m["delta_nll_se"] == pytest.approx(math.sqrt(1 / 12) / 2)
    # KLD 0, .1, .2, .3: mean .15, sample variance (2 x .0225 + 2 x .0025) / 3 = .05 / 3
    assert m["kld_mean"] == pytest.approx(0.15) and m["kld_se"] == pytest.approx(math.sqrt(0.05 / 3) / 2)
    assert m["kld_max"] == pytest.approx(0.3)
    # percentiles with linear interpolation between order statistics: rank q x (n - 1) = 3q
    for col, qq in (("kld_median", 0.5), ("kld_p90", 0.9), ("kld_p95", 0.95), ("kld_p99", 0.99),
                    ("kld_p999", 0.999)):
        assert m[col] == pytest.approx(0.1 * 3 * qq), col   # the values are 0.1 x rank
    assert m["same_top1_pct"] == pytest.approx(75.0)
    assert m["dp_mean_pct"] == pytest.approx(5.0)                           # mean .05
    assert m["dp_rms_pct"] == pytest.approx(100 * math.sqrt(0.06 / 4))       # (.01 + .01 + .04) / 4


def test_summarize_small_inputs():
    assert summarize(TokenStats()) == {"n_tokens": 0}
    one = TokenStats(nll_base=[np.array([2.0])], nll_q=[np.array([3.0])], kld=[np.array([0.4])],
                     same_top1=[np.array([0.0])], dp=[np.array([-0.5])])
    m = summarize(one)
    assert m["n_tokens"] == 1 and math.isnan(m["kld_se"]) and math.isnan(m["delta_nll_se"])
    assert m["kld_mean"] == m["kld_median"] == m["kld_p999"] == pytest.approx(0.4)
    assert m["dp_rms_pct"] == pytest.approx(50.0) and m["delta_nll"] == pytest.approx(1.0)


def test_survival_curve_by_hand():
    # first divergences 0, 2, 5, 5 of a 5-token horizon (5 = never diverged)
    t, alive = survival(np.array([0, 2, 5, 5]), 5)
    assert t.tolist() == [0, 1, 2, 3, 4, 5]
    assert alive.tolist() == [1.0, 0.75, 0.75, 0.5, 0.5, 0.5]
    t, alive = survival(np.array([], dtype=int), 3)
    assert alive.tolist() == [1.0, 1.0, 1.0, 1.0]


# ---- perplexity pieces: chunking, the scored positions, the averages ---------------------------
def test_scored_positions_follow_llama_perplexity():
    for ctx in (8, 9, 512):
        sl = scored_slice(ctx)
        assert (sl.start, sl.stop) == (ctx // 2, ctx - 1) and len(range(ctx)[sl]) == ctx - 1 - ctx // 2
    assert len(range(512)[scored_slice(512)]) == 255


class _FakeLLM:
    """Stands in for paged.LLM: the log-probability of prompt position k is -k / 10 whatever
    the token, so every chunk of 8 scores positions 5, 6, 7 at NLL 0.5, 0.6, 0.7."""

    def __init__(self) -> None:
        self.tokenizer = None
        self.engine = NS(max_model_len=64, config=NS(kv_cache_dtype="int8"))
        self.prompts: list[list[int]] = []

    def generate(self, prompts, params):
        assert params.prompt_logprobs == 0 and params.max_tokens == 1
        self.prompts += prompts
        return [NS(prompt_logprobs=[None] + [{t: -k / 10} for k, t in enumerate(p) if k]) for p in prompts]


def test_perplexity_averages_by_hand():
    llm = _FakeLLM()
    texts = {"x": list(range(100, 120)), "y": list(range(200, 208))}   # 20 tokens: 2 chunks of 8; 8: 1
    df = perplexity(llm, texts, context_length=8).set_index("source")
    assert llm.prompts == [list(range(100, 108)), list(range(108, 116)), list(range(200, 208))]
    assert df.loc["x"].n_chunks == 2 and df.loc["x"].n_tokens == 6 and df.loc["y"].n_tokens == 3
    assert df.loc["all"].n_chunks == 3 and df.loc["all"].n_tokens == 9
    for src in ("x", "y", "all"):
        assert df.loc[src].nll_mean == pytest.approx(0.6) and df.loc[src].ppl == pytest.approx(math.exp(0.6))
        assert df.loc[src].kv_cache_dtype == "int8" and df.loc[src].context_length == 8
    # NLLs 0.5, 0.6, 0.7 per chunk: sample variance 2k x 0.01 / (3k - 1), standard error / sqrt(3k)
    assert df.loc["y"].nll_se == pytest.approx(math.sqrt(0.02 / 2) / math.sqrt(3))
    assert df.loc["all"].nll_se == pytest.approx(math.sqrt(0.06 / 8) / math.sqrt(9))


def test_chunks_replace_the_first_token_with_bos_when_asked():
    tok = NS(add_bos=True, bos_token_id=1, encode=lambda text, add_special_tokens=False: [ord(c) for c in text])
    chunks = make_chunks({"t": "abcdefghij"}, tok, 4)
    assert [c.ids for c in chunks] == [(1, 98, 99, 100), (1, 102, 103, 104)]   # 10 // 4 = 2 chunks
    assert [c.ids for c in make_chunks({"t": "abcdefghij"}, tok, 4, bos=False)][0] == (97, 98, 99, 100)


# ---- the study passes the base run as p ---------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("transformers")
    from paged.models import load_model
    from paged.models.testing import make_tiny_checkpoint
    return load_model(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama", head_dim=32))


def test_study_scores_the_quantized_run_against_the_base(tiny):
    """Each format's row carries the base run's perplexity as ``ppl_base`` and its own as
    ``ppl_q`` (swapping the two runs would swap them, and reverse the KL divergence)."""
    from paged.quant import study
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (64,), generator=g).tolist()
    df = study(tiny, formats=["int4"], texts={"r": ids}, context_lengths=(64,), divergence_tokens=0,
               progress=False)
    df = df[df.source == "all"].set_index("format")
    base, q = df.loc["fp32"], df.loc["int4"]
    assert base.kld_mean == 0.0 and base.ppl_q == base.ppl_base
    assert q.ppl_base == pytest.approx(base.ppl_q, rel=1e-12) and q.ppl_q != q.ppl_base
    assert q.kld_mean > 0 and q.n_tokens == 64 - 1 - 32
