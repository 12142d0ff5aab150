"""Value checks of block tables run once per set of tables, not once per layer: the layers of
one step pass the same unchanged tensors (the quantized CPU path paid ~90 us per layer call),
and a table changed in place, or a new one, is checked again."""
import pytest
import torch

import kernels
from kernels import api
from kernels.errors import ShapeError


@pytest.fixture
def layer():
    return kernels.allocate_kv_cache(8, 4, 2, 16, "int8", dtype=torch.float32)


def _decode(layer, bt, sl):
    q = torch.randn(bt.shape[0], 2, 16)
    return kernels.paged_decode_attention(q, layer, None, bt, sl, backend="torch")


def test_same_tables_are_checked_once(layer, monkeypatch):
    calls = []
    real = api._check_table_values
    monkeypatch.setattr(api, "_check_table_values", lambda *a: (calls.append(1), real(*a)))
    bt = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    sl = torch.tensor([9, 5], dtype=torch.int32)
    for _ in range(4):  # four layers of one step
        _decode(layer, bt, sl)
    assert len(calls) == 1
    _decode(layer, bt.clone(), sl)  # new tables: checked
    assert len(calls) == 2


def test_tables_changed_in_place_are_checked_again(layer):
    bt = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    sl = torch.tensor([9], dtype=torch.int32)
    _decode(layer, bt, sl)
    bt[0, 1] = 99
    with pytest.raises(ShapeError, match="block_tables"):
        _decode(layer, bt, sl)
    bt[0, 1] = 1
    sl[0] = 13  # past the table's width x block_size
    with pytest.raises(ShapeError, match="seq_lens"):
        _decode(layer, bt, sl)
