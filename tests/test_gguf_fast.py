"""The fast GGUF path (paged.models.gguf_loader.FastGGUFReader + torch dequantization) reads exactly
what gguf's own reader and dequantizer read: same metadata, same tensor bytes, bit-identical
weights, a tokenizer giving identical ids; files it does not handle go to gguf.GGUFReader."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from paged.models import embedded_gguf_path
from paged.models.gguf_loader import FastGGUFReader, _dequantize, gguf_config, open_gguf
from paged.models.tokenizer import tokenizer_from_gguf

gguf = pytest.importorskip("gguf")

TEXTS = ["Hello world! The quick brown fox.", "In 2024, 12 cats ate 345 fish.", "<|im_start|>user\nHi<|im_end|>",
         " leading space", "Ünïcödé wörds, \ttabs and   runs of spaces\n\nnew lines", "x 2024 y12 -- 'quotes'?!"]


@pytest.fixture(scope="module")
def readers():
    p = embedded_gguf_path()
    return open_gguf(p), open_gguf(p, fast=False)


def test_embedded_file_reads_the_same(readers) -> None:
    fast, ref = readers
    assert isinstance(fast, FastGGUFReader) and isinstance(ref, gguf.GGUFReader)
    assert list(fast.fields) == [k for k in ref.fields if not k.startswith("GGUF.")]
    for k, f in fast.fields.items():
        assert f.contents() == ref.fields[k].contents(), k
    assert fast.data_offset == ref.data_offset
    assert [t.name for t in fast.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(fast.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type and a.shape.tolist() == b.shape.tolist(), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert a.n_bytes == b.n_bytes and a.data_offset == b.data_offset, a.name
        assert np.array_equal(a.data, b.data), a.name
    assert gguf_config(fast) == gguf_config(ref)


def test_tokenizers_give_identical_ids(readers) -> None:
    fast, ref = (tokenizer_from_gguf(r) for r in readers)
    assert fast.vocab_size == ref.vocab_size == 49152
    assert (fast.bos_token_id, fast.eos_token_id, fast.add_bos) == (ref.bos_token_id, ref.eos_token_id, ref.add_bos)
    assert fast.chat_template == ref.chat_template
    for text in TEXTS:
        ids = fast.encode(text)
        assert ids == ref.encode(text), text
        assert fast.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("qname", ["Q4_0", "Q4_1", "Q8_0"])
def test_torch_dequantize_is_bit_identical(qname: str) -> None:
    from gguf.quants import dequantize, quantize
    qtype = gguf.GGMLQuantizationType[qname]
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((6, 96)) * rng.uniform(0.01, 3.0, (6, 1))).astype(np.float32)
    x[2, :32] = 0.0  # an all-zero block (scale 0)
    q = quantize(x, qtype)

    class T:  # the reader tensor fields _dequantize reads
        data, tensor_type, shape = q, qtype, np.array([96, 6], dtype=np.uint64)

    got = _dequantize(T)
    want = dequantize(q, qtype)
    assert got.dtype == torch.float32 and tuple(got.shape) == (6, 96)
    assert np.array_equal(got.numpy().view(np.uint32), want.astype(np.float32).view(np.uint32))


def test_big_endian_file_falls_back_to_gguf_reader(tmp_path) -> None:
    path = tmp_path / "be.gguf"
    wr = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG)
    wr.add_block_count(1)
    wr.add_tensor("token_embd.weight", np.ones((4, 8), dtype=np.float32))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    with pytest.raises(ValueError):
        FastGGUFReader(str(path))
    r = open_gguf(path)
    assert isinstance(r, gguf.GGUFReader) and r.fields["llama.block_count"].contents() == 1
