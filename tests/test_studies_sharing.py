"""paged.studies.sharing.sharing_study on a tiny random Llama: the table's shape and invariants
(base row has zero error, memory scales with owner layers, the real engine fits
num_layers / num_owners times the blocks), and the study's layer-skipping prefill equals a
full forward pass."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from paged.errors import ConfigError  # noqa: E402
from paged.models import load_model  # noqa: E402
from paged.models.testing import make_tiny_checkpoint  # noqa: E402
from paged.studies import sharing  # noqa: E402

TEXTS = {"a": [(i * 7) % 250 + 1 for i in range(200)]}


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny5"), "llama", num_layers=5)
    return load_model(path, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def table(lm):
    return sharing.sharing_study(lm, TEXTS, context_length=32, max_chunks=2, ks=(1, 2), divergence_tokens=4,
                                 engine_budget=1 << 20)


def test_table(table, lm):
    L = lm.config.num_layers
    assert list(table["kind"].value_counts().sort_index()) == [1, 4, 4]  # base, k_pairs (2 orders x 2), pairs
    base = table[table["kind"] == "base"].iloc[0]
    assert base["kld_mean"] == 0 and base["delta_nll"] == 0 and base["same_top1_pct"] == 100
    assert base["first_div_median"] == 4 and base["memory_saved_pct"] == 0
    pairs = table[table["kind"] == "pair"]
    assert list(pairs["pair"]) == [0, 1, 2, 3]
    assert all(pairs[c].between(0, 1).all() for c in ("js_head", "js_headavg", "js_shared"))
    assert (pairs["k_rel_err"] > 0).all() and (pairs["v_rel_err"] > 0).all()
    assert (pairs["kld_mean"] > 0).all()  # a random model is not trained for sharing
    two = table[table["k"] == 2]
    assert (two["num_cache_layers"] == L - 2).all()
    assert (two["kv_bytes_per_token"] * L == base["kv_bytes_per_token"] * (L - 2)).all()
    # the real engine at the same byte budget: blocks grow as num_layers / num_owners
    ratio = two["engine_num_blocks"] / base["engine_num_blocks"]
    assert ((ratio - L / (L - 2)).abs() < 0.05).all() and (table["engine_cache_bytes"] <= 1 << 20).all()
    assert table["n_tokens"].nunique() == 1 and -1 <= sharing.similarity_rank_correlation(table) <= 1


def test_skipping_prefill_equals_full_forward(lm):
    ids = torch.tensor(TEXTS["a"][:24])
    base = sharing.SharedKVAttention(lm.config.num_layers)
    _, inputs = sharing._base_run(lm.model, ids, base)
    share = {3: 2}
    short = sharing._prefill(lm.model, ids, sharing.SharedKVAttention(5, share), 3, (base, inputs))
    full = sharing._prefill(lm.model, ids, sharing.SharedKVAttention(5, share))
    torch.testing.assert_close(short, full, atol=1e-6, rtol=0)


def test_bad_arguments(lm):
    with pytest.raises(ConfigError, match="pairs"):
        sharing.sharing_study(lm, TEXTS, context_length=32, pairs=[4])
    with pytest.raises(ConfigError, match="orders"):
        sharing.sharing_study(lm, TEXTS, context_length=32, orders=("random",))
    with pytest.raises(ConfigError, match="every k"):
        sharing.sharing_study(lm, TEXTS, context_length=32, pairs=[0, 1], ks=(3,))
