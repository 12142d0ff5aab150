"""The compiled split write (kernels/native/quant_write.c) stores exactly what the torch reference
(kernels.split.write_split) stores: the same code bytes, scales, exact rows and staging rows."""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels.native import quant_write

from test_kernels_split import _layer
from test_native_quant import SPLIT


def _state(layer):
    """Every tensor a write may change."""
    out = {n: getattr(layer, n) for n in ("k", "v", "k_scale", "v_scale", "k_zero", "k_super")}
    for pool in ("staging", "sink"):
        p = getattr(layer, pool)
        if p is not None:
            out.update({f"{pool}.k": p.k, f"{pool}.v": p.v, f"{pool}.map": p.map_host})
    return {n: t.clone() for n, t in out.items() if t is not None}


def _writes(g, lens, tabs, bs, h, d, extreme=False):
    """Each sequence: a prompt in two pieces, then one token per call (a batch of all sequences),
    with a padding slot (-1) in every fourth call."""
    seqs = [(torch.randn(L + 40, h, d, generator=g) * 2, torch.randn(L + 40, h, d, generator=g)) for L in lens]
    if extreme:  # fp16 rounding edges: subnormals, ties, overflow to inf
        for k, _ in seqs:
            k[:, 0, :8] = torch.tensor([1e-7, 3e-8, 2.98e-8, 6.1e-5, 65519.0, 65520.0, 7e4, -1e-6])
    slot = lambda tb, p: tb[p // bs] * bs + p % bs  # noqa: E731
    for (k, v), L, tb in zip(seqs, lens, tabs):
        for a, b in ((0, L // 2), (L // 2, L)):
            yield k[a:b], v[a:b], torch.tensor([slot(tb, p) for p in range(a, b)]), torch.arange(a, b)
    for i in range(40):
        pos = [L + i for L in lens]
        k = torch.stack([s[0][p] for s, p in zip(seqs, pos)])
        v = torch.stack([s[1][p] for s, p in zip(seqs, pos)])
        sl = torch.tensor([slot(tb, p) for tb, p in zip(tabs, pos)])
        if i % 4 == 3:
            sl[1] = -1
        yield k, v, sl, torch.tensor(pos)


def count_native_writes(monkeypatch) -> list[int]:
    """A list that gets, per call of the compiled split write, the number of tokens it took."""
    taken: list[int] = []
    real = quant_write.write_split

    def counted(*a):
        rest = real(*a)
        taken.append(a[1].shape[0] - (0 if rest is None else rest.numel()))
        return rest
    monkeypatch.setattr(quant_write, "write_split", counted)
    return taken


@pytest.mark.parametrize("name", SPLIT + ["fp16/cb3+rot@win16", "kivi3/cb2"])
def test_native_split_write_is_bit_identical_to_the_reference(name, monkeypatch):
    g = torch.Generator().manual_seed(5)
    bs, h, d, nb = 8, 2, 64, 40
    ref, nat = _layer(name, nb=nb, bs=bs, h=h, d=d, slots=nb), _layer(name, nb=nb, bs=bs, h=h, d=d, slots=nb)
    assert quant_write.supports(nat)
    taken = count_native_writes(monkeypatch)
    lens, tabs = [5, 17, 30], [[0, 1, 2, 3, 4, 5, 6, 7, 8], [10, 11, 12, 13, 14, 15, 16, 17, 18], list(range(20, 29))]
    for k, v, sl, pos in _writes(g, lens, tabs, bs, h, d, extreme=name.startswith("fp16")):
        kernels.write_kv(k, v, ref, sl.int(), positions=pos, backend="torch")
        kernels.write_kv(k, v, nat, sl.int(), positions=pos, backend="native")
        a, b = _state(ref), _state(nat)
        for n in a:
            assert torch.equal(a[n].view(torch.uint8) if a[n].is_floating_point() else a[n],
                               b[n].view(torch.uint8) if b[n].is_floating_point() else b[n]), n
    assert sum(taken) >= 80, "the compiled write took too few of the tokens"  # most decode tokens (120)
    assert 0 in taken  # the prompts' writes (new blocks, seals) went to the reference


def test_native_write_declines_what_it_does_not_take():
    layer = _layer("kivi3/cb3", nb=8, bs=8, h=2, d=64, slots=8)
    k = torch.randn(1, 2, 64)
    before = _state(layer)
    rest = quant_write.write_split(layer, k, k, torch.tensor([3]), None)  # block 0 not staged yet
    assert rest.tolist() == [0]
    assert all(torch.equal(before[n], t) for n, t in _state(layer).items())
    assert not quant_write.supports(kernels.allocate_kv_cache(4, 8, 2, 64, "int8", dtype=torch.float32))


@pytest.mark.parametrize("name,dtype", [("int8", torch.float32), ("int4", torch.float32), ("int4_kivi", torch.float32),
                                        ("int4_kivi", torch.float16)])
def test_native_plain_write_is_bit_identical_to_the_reference(name, dtype, monkeypatch):
    g = torch.Generator().manual_seed(9)
    bs, h, d, nb = 8, 2, 64, 40
    ref, nat = (kernels.allocate_kv_cache(nb, bs, h, d, name, dtype=dtype) for _ in range(2))
    assert quant_write.supports_plain(nat)
    taken = []
    real = quant_write.write_plain
    def counted(*a):
        rest = real(*a)
        taken.append(a[1].shape[0] - (0 if rest is None else rest.numel()))
        return rest
    monkeypatch.setattr(quant_write, "write_plain", counted)
    lens, tabs = [5, 17, 30], [[0, 1, 2, 3, 4, 5, 6, 7, 8], [10, 11, 12, 13, 14, 15, 16, 17, 18], list(range(20, 29))]
    for k, v, sl, _ in _writes(g, lens, tabs, bs, h, d):
        k, v = k.to(dtype), v.to(dtype)
        v[0, 0, :4] = torch.tensor([0.5, -0.5, 1.5, 2.5])  # ties of torch.round (half to even)
        kernels.write_kv(k, v, ref, sl.int(), backend="torch")
        kernels.write_kv(k, v, nat, sl.int(), backend="native")
        a, b = _state(ref), _state(nat)
        for n in a:
            assert torch.equal(a[n].view(torch.uint8) if a[n].is_floating_point() else a[n],
                               b[n].view(torch.uint8) if b[n].is_floating_point() else b[n]), n
    assert sum(taken) >= 80
