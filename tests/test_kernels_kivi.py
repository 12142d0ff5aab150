"""The ``int4_kivi`` cache format: staging lifecycle, reads against dense SDPA, Triton == reference.

Small shapes on purpose (the Triton kernels run in the interpreter here). Tolerances: Triton vs
reference as in test_kernels_triton.py (both read the same stored codes/staging rows, so only
float32 summation order and the final rounding to ``q.dtype`` differ); reference vs dense SDPA on
the identically dequantized K/V: 2e-5 in float32.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import StagingExhaustedError, allocate_kv_cache, dequantize_kv, quantize_kv
from kernels.kivi import dequantize_k_blocks, quantize_k_blocks
from kernels.reference import gather_kv

H, D = 2, 64


def _backend() -> str | None:
    from kernels.backend import interpreter_enabled, triton_available
    return "interpreter" if triton_available() and interpreter_enabled() else None


BACKEND = _backend()
needs_triton = pytest.mark.skipif(BACKEND is None, reason="needs triton with TRITON_INTERPRET=1")


def _tol(dtype: torch.dtype) -> dict:
    t = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    return dict(atol=t, rtol=t)


def _slots(blocks: list[int], n: int, bs: int, start: int = 0) -> torch.Tensor:
    return torch.tensor([blocks[p // bs] * bs + p % bs for p in range(start, start + n)], dtype=torch.int32)


def _nan_fill(layer: kernels.KVCacheLayer) -> None:
    for t in layer.block_tensors() + [layer.staging.k]:
        if t.dtype.is_floating_point:
            t.fill_(float("nan"))
        else:
            t.fill_(0x7F)


def _poison_unwritten_staging(layer, tables, lens) -> None:
    """NaN into every staged row at or past its sequence's length (must never be read)."""
    bs = layer.block_size
    for s, n in enumerate(lens):
        b = int(tables[s, (n - 1) // bs]) if n else int(tables[s, 0])
        slot = int(layer.staging.map_host[b])
        if slot >= 0:
            layer.staging.k[slot, n % bs if n else 0:] = float("nan")


def _batch(bs: int, lens: list[int], dtype: torch.dtype, seed: int, num_staging: int | None = None):
    """A NaN-filled int4_kivi layer with sequences of ``lens`` tokens in shuffled blocks, written
    alternately in one call and token by token (a prefill then decodes)."""
    g = torch.Generator().manual_seed(seed)
    nblk = [max(1, -(-n // bs)) for n in lens]
    num_blocks = sum(nblk) + 2
    layer = allocate_kv_cache(num_blocks, bs, H, D, "int4_kivi", dtype=dtype, num_staging_blocks=num_staging)
    _nan_fill(layer)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(lens), max(nblk) + 1), -1, dtype=torch.int32)
    tables[:, -1] = 10**6  # padding past the pool: never dereferenced
    ks, vs = [], []
    for s, n in enumerate(lens):
        ids, perm = perm[:nblk[s]], perm[nblk[s]:]
        tables[s, :nblk[s]] = torch.tensor(ids, dtype=torch.int32)
        k, v = torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g)
        k[:, :, 3] += 8.0  # an outlier channel
        if s % 2 == 0:
            kernels.write_kv(k, v, layer, _slots(ids, n, bs))
        else:
            first = n // 2
            kernels.write_kv(k[:first], v[:first], layer, _slots(ids, first, bs))
            for p in range(first, n):
                kernels.write_kv(k[p:p + 1], v[p:p + 1], layer, _slots(ids, 1, bs, p))
        ks.append(k)
        vs.append(v)
    layer.staging.check()
    _poison_unwritten_staging(layer, tables, lens)
    return layer, tables, torch.tensor(lens, dtype=torch.int32), ks, vs, g


def _expected_kv(k: torch.Tensor, v: torch.Tensor, bs: int, dtype: torch.dtype):
    """Dense dequantized K/V as the format defines them: full blocks per channel, the tail in dtype."""
    n = k.shape[0]
    full = (n // bs) * bs
    kd = k.to(dtype).float()
    parts = []
    if full:
        parts.append(dequantize_k_blocks(*quantize_k_blocks(kd[:full].view(full // bs, bs, H, D))).view(full, H, D))
    parts.append(kd[full:])
    return torch.cat(parts), dequantize_kv(quantize_kv(v, "int4"), "int4")


# ---- reads: Triton == reference, reference == dense SDPA ---------------------------------------

CASES = [(1, 3, torch.float16), (8, 1, torch.bfloat16), (16, 3, torch.float16), (8, 3, torch.float32)]


@needs_triton
@pytest.mark.parametrize("bs,group,dtype", CASES, ids=[f"bs{b}-g{g}-{str(d)[6:]}" for b, g, d in CASES])
def test_triton_matches_reference(bs, group, dtype):
    lens = [1, max(1, bs - 1), bs, bs + 1, 2 * bs + 3]
    layer, tables, seq_lens, _, _, g = _batch(bs, lens, dtype, seed=bs * 10 + group)
    q = torch.randn(len(lens), H * group, D, generator=g).to(dtype)
    for splits in (None, 3):
        out, lse = kernels.paged_decode_attention(q, layer, None, tables, seq_lens, backend=BACKEND, return_lse=True,
                                                  num_splits=splits)
        ref, ref_lse = kernels.paged_decode_attention(q, layer, None, tables, seq_lens, backend="torch",
                                                      return_lse=True)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.float(), ref.float(), **_tol(dtype))
        torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)
    q_lens = [1, lens[1], min(3, lens[2]), 0, bs + 1]  # decode, prompt from scratch, chunk after a prefix, idle
    qsl = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32)
    qp = torch.randn(sum(q_lens), H * group, D, generator=g).to(dtype)
    out = kernels.paged_prefill_attention(qp, layer, None, tables, seq_lens, qsl, backend=BACKEND)
    ref = kernels.paged_prefill_attention(qp, layer, None, tables, seq_lens, qsl, backend="torch")
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.float(), **_tol(dtype))


@pytest.mark.parametrize("bs,group", [(1, 1), (8, 3), (16, 1)])
def test_reference_matches_dense_sdpa(bs, group):
    dtype = torch.float32
    lens = [bs - 1 if bs > 1 else 1, bs, bs + 1, 3 * bs + 2]
    layer, tables, seq_lens, ks, vs, g = _batch(bs, lens, dtype, seed=7 + bs)
    q = torch.randn(len(lens), H * group, D, generator=g)
    out = kernels.paged_decode_attention(q, layer, None, tables, seq_lens, backend="torch")
    q_lens = [1, min(2, lens[1]), bs + 1, 3]
    qsl = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32)
    qp = torch.randn(sum(q_lens), H * group, D, generator=g)
    outp = kernels.paged_prefill_attention(qp, layer, None, tables, seq_lens, qsl, backend="torch")
    for s, n in enumerate(lens):
        k, v = _expected_kv(ks[s], vs[s], bs, dtype)
        kt, vt = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        dense = F.scaled_dot_product_attention(q[s][None, :, None], kt, vt, enable_gqa=True)[0, :, 0]
        torch.testing.assert_close(out[s], dense, atol=2e-5, rtol=2e-5)
        m = q_lens[s]
        qs = qp[qsl[s]:qsl[s + 1]].transpose(0, 1)[None]
        mask = torch.arange(n)[None, :] <= torch.arange(n - m, n)[:, None]
        dense = F.scaled_dot_product_attention(qs, kt, vt, attn_mask=mask, enable_gqa=True)[0].transpose(0, 1)
        torch.testing.assert_close(outp[qsl[s]:qsl[s + 1]], dense, atol=2e-5, rtol=2e-5)


def test_per_channel_k_beats_per_token_on_outlier_channels():
    """KIVI's point, measured through the cache: with a few large-magnitude key channels, per-channel
    int4 over a block is far more accurate than per-token int4 (groups of 32 along head_dim)."""
    g = torch.Generator().manual_seed(0)
    t, bs = 256, 16
    k = torch.randn(t, H, D, generator=g)
    outliers = torch.tensor([3, 17, 40, 41])
    k[:, :, outliers] = k[:, :, outliers] * 4 + torch.tensor([15.0, -12.0, 10.0, 20.0])
    layer = allocate_kv_cache(t // bs, bs, H, D, "int4_kivi", dtype=torch.float32)
    kernels.write_kv(k, torch.zeros_like(k), layer, torch.arange(t, dtype=torch.int32))
    per_channel = gather_kv(layer, "k", torch.arange(t // bs)).reshape(t, H, D)
    per_token = dequantize_kv(quantize_kv(k, "int4"), "int4")
    rel = lambda x: float((x - k).pow(2).sum() / k.pow(2).sum())  # noqa: E731
    normal = torch.ones(D, dtype=torch.bool)
    normal[outliers] = False
    rel_n = lambda x: float((x - k)[..., normal].pow(2).sum() / k[..., normal].pow(2).sum())  # noqa: E731
    print(f"K relative MSE, per-channel (block {bs}) {rel(per_channel):.2e} vs per-token int4 {rel(per_token):.2e}; "
          f"normal channels only {rel_n(per_channel):.2e} vs {rel_n(per_token):.2e}")
    assert layer.staging.num_used == 0  # full blocks only: nothing staged
    assert rel(per_channel) < 0.25 * rel(per_token)
    assert rel_n(per_channel) < 0.1 * rel_n(per_token)


# ---- staging lifecycle ------------------------------------------------------------------------

def _state(layer):
    return ([t.clone() for t in layer.block_tensors()], layer.staging.k.clone(), layer.staging.map_host.clone(),
            list(layer.staging.free))


def _same_state(a, b) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a[0], b[0])) and \
        torch.equal(a[1].view(torch.uint8), b[1].view(torch.uint8)) and torch.equal(a[2], b[2]) and a[3] == b[3]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_token_by_token_until_full(dtype):
    bs = 8
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(bs, H, D, generator=g) * 3, torch.randn(bs, H, D, generator=g)
    a = allocate_kv_cache(6, bs, H, D, "int4_kivi", dtype=dtype, num_staging_blocks=3)
    b = allocate_kv_cache(6, bs, H, D, "int4_kivi", dtype=dtype, num_staging_blocks=3)
    _nan_fill(a)
    for p in range(bs):
        kernels.write_kv(k[p:p + 1], v[p:p + 1], a, torch.tensor([3 * bs + p], dtype=torch.int32))
        slot = int(a.staging.map_host[3])
        if p < bs - 1:
            assert slot >= 0 and a.staging.num_used == 1
            assert torch.equal(a.staging.k[slot, :p + 1], k[:p + 1].to(dtype))
            assert (a.staging.k[slot, p + 1:] == 0).all()  # a new life starts zeroed, not NaN
        else:
            assert slot == -1 and a.staging.num_used == 0
        a.staging.check()
    codes, s, z = quantize_k_blocks(k.to(dtype).float()[None])
    assert torch.equal(a.k[3], codes[0]) and torch.equal(a.k_scale[3], s[0]) and torch.equal(a.k_zero[3], z[0])
    kernels.write_kv(k, v, b, torch.arange(3 * bs, 4 * bs, dtype=torch.int32))  # the same block at once
    assert b.staging.num_used == 0
    for x, y in zip(a.block_tensors(), b.block_tensors()):
        assert torch.equal(x[3], y[3])


def test_new_life_and_reopen():
    bs = 4
    g = torch.Generator().manual_seed(2)
    layer = allocate_kv_cache(4, bs, H, D, "int4_kivi", dtype=torch.float32, num_staging_blocks=2)
    k = torch.randn(3 * bs, H, D, generator=g)
    kernels.write_kv(k[:3], k[:3], layer, _slots([1], 3, bs))
    slot = int(layer.staging.map_host[1])
    kernels.write_kv(k[4:6], k[4:6], layer, _slots([1], 2, bs))  # rewritten from offset 0: same slot, zeroed
    assert int(layer.staging.map_host[1]) == slot
    assert torch.equal(layer.staging.k[slot, :2], k[4:6]) and (layer.staging.k[slot, 2:] == 0).all()
    kernels.write_kv(k[:bs], k[:bs], layer, _slots([2], bs, bs))  # sealed at once, no slot
    sealed = gather_kv(layer, "k", torch.tensor([2]))[0]
    kernels.write_kv(k[8:9], k[8:9], layer, _slots([2], 1, bs, 1))  # reopen a sealed block at offset 1
    assert int(layer.staging.map_host[2]) >= 0
    got = gather_kv(layer, "k", torch.tensor([2]))[0]
    assert torch.equal(got[1], k[8]) and torch.equal(got[[0, 2, 3]], sealed[[0, 2, 3]])
    layer.staging.check()


@needs_triton
def test_copy_on_write_of_a_partial_block_then_divergent_writes():
    bs = 8
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(bs, H, D, generator=g), torch.randn(bs, H, D, generator=g)
    ka, kb = torch.randn(bs - 5, H, D, generator=g), torch.randn(bs - 5, H, D, generator=g)
    layers = [allocate_kv_cache(6, bs, H, D, "int4_kivi", num_staging_blocks=3) for _ in range(2)]
    for layer in layers:
        kernels.write_kv(k[:5], v[:5], layer, _slots([1], 5, bs))
        kernels.write_kv(k, v, layer, _slots([0], bs, bs))  # a full block copied along: no staging for it
    kernels.copy_blocks(layers, [(1, 4), (0, 5)], backend=BACKEND)
    for layer in layers:
        sm = layer.staging
        assert sm.map_host[4] >= 0 and sm.map_host[4] != sm.map_host[1] and sm.map_host[5] == -1
        assert torch.equal(sm.k[sm.map_host[4], :5], sm.k[sm.map_host[1], :5])
        sm.check()
    layer = layers[0]
    kernels.write_kv(ka, ka, layer, _slots([1], bs - 5, bs, 5))  # parent and child diverge, both fill up
    kernels.write_kv(kb, kb, layer, _slots([4], bs - 5, bs, 5))
    assert layer.staging.num_used == 0
    direct = allocate_kv_cache(2, bs, H, D, "int4_kivi")
    kernels.write_kv(torch.cat([k[:5], ka]), torch.cat([v[:5], ka]), direct, _slots([0], bs, bs))
    kernels.write_kv(torch.cat([k[:5], kb]), torch.cat([v[:5], kb]), direct, _slots([1], bs, bs))
    for x, y in zip(layer.block_tensors(), direct.block_tensors()):
        assert torch.equal(x[1], y[0]) and torch.equal(x[4], y[1])
    # copy into a staged destination from a sealed source releases its slot
    kernels.copy_blocks(layers[1], [(0, 4)], backend="torch")
    assert layers[1].staging.map_host[4] == -1 and layers[1].staging.num_used == 1


def test_swap_out_and_in_round_trips_exactly():
    bs = 8
    g = torch.Generator().manual_seed(4)
    gpu = allocate_kv_cache(10, bs, H, D, "int4_kivi", dtype=torch.bfloat16, num_staging_blocks=4)
    cpu = allocate_kv_cache(5, bs, H, D, "int4_kivi", dtype=torch.bfloat16, num_staging_blocks=2)
    _nan_fill(gpu)
    k, v = torch.randn(bs + 3, H, D, generator=g), torch.randn(bs + 3, H, D, generator=g)
    kernels.write_kv(k, v, gpu, _slots([2, 5], bs + 3, bs))  # block 2 full, block 5 partial
    before_k = gather_kv(gpu, "k", torch.tensor([2, 5]))
    before_v = gather_kv(gpu, "v", torch.tensor([2, 5]))
    kernels.swap_blocks(gpu, cpu, [(2, 0), (5, 1)])
    assert cpu.staging.map_host.tolist()[:2] == [-1, 0]
    kernels.release_blocks(gpu, [2, 5])  # the manager freed them
    assert gpu.staging.num_used == 0
    # block 5 reused meanwhile
    kernels.write_kv(torch.randn(2, H, D), torch.randn(2, H, D), gpu, _slots([5], 2, bs))
    kernels.swap_blocks([cpu], [gpu], [(0, 7), (1, 8)])
    exact = dict(atol=0, rtol=0, equal_nan=True)  # unwritten V rows are NaN on both sides
    torch.testing.assert_close(gather_kv(gpu, "k", torch.tensor([7, 8])), before_k, **exact)
    torch.testing.assert_close(gather_kv(gpu, "v", torch.tensor([7, 8])), before_v, **exact)
    gpu.staging.check()
    cpu.staging.check()
    # the swapped-in partial block keeps filling and seals like one that never left
    kernels.write_kv(k[:bs - 3], v[:bs - 3], gpu, _slots([8], bs - 3, bs, 3))
    assert gpu.staging.map_host[8] == -1
    codes, _, _ = quantize_k_blocks(torch.cat([k[bs:], k[:bs - 3]]).to(torch.bfloat16).float()[None])
    assert torch.equal(gpu.k[8], codes[0])


def test_release_blocks():
    layer = allocate_kv_cache(6, 4, H, D, "int4_kivi", num_staging_blocks=2)
    x = torch.randn(3, H, D)
    kernels.write_kv(x, x, layer, torch.tensor([4, 12, 13], dtype=torch.int32))
    assert layer.staging.num_used == 2
    kernels.release_blocks(layer, torch.tensor([3, 0, 3]))  # unstaged and repeated ids are fine
    assert layer.staging.num_used == 1 and layer.staging.map_host[3] == -1
    layer.staging.check()
    with pytest.raises(kernels.ShapeError, match="release_blocks"):
        kernels.release_blocks(layer, [6])
    kernels.release_blocks(allocate_kv_cache(2, 4, H, D, "int4"), [0, 1])  # a no-op for other formats


def test_exhaustion_leaves_state_unchanged():
    bs = 4
    g = torch.Generator().manual_seed(5)
    layer = allocate_kv_cache(8, bs, H, D, "int4_kivi", num_staging_blocks=2)
    x = torch.randn(bs, H, D, generator=g)
    kernels.write_kv(x[:2], x[:2], layer, _slots([0], 2, bs))
    kernels.write_kv(x[:1], x[:1], layer, _slots([1], 1, bs))
    snap = _state(layer)
    with pytest.raises(StagingExhaustedError, match="num_staging_blocks"):
        # block 2 opens, block 0 stays
        kernels.write_kv(x[:3], x[:3], layer, torch.tensor([8, 9, 2], dtype=torch.int32))
    assert _same_state(snap, _state(layer))
    with pytest.raises(StagingExhaustedError):
        kernels.copy_blocks(layer, [(0, 5)])
    assert _same_state(snap, _state(layer))
    other = allocate_kv_cache(4, bs, H, D, "int4_kivi", num_staging_blocks=1)
    with pytest.raises(StagingExhaustedError):
        kernels.swap_blocks(layer, other, [(0, 0), (1, 1)])
    assert _same_state(snap, _state(layer)) and other.staging.num_used == 0
    # sealing block 0 frees the slot that block 2 takes in the same write
    kernels.write_kv(x[:3], x[:3], layer, torch.tensor([2, 3, 8], dtype=torch.int32))
    assert layer.staging.map_host[0] == -1 and layer.staging.map_host[2] >= 0
    layer.staging.check()


def test_format_api_and_sizes():
    bs, nb = 16, 10
    layer = allocate_kv_cache(nb, bs, H, D, "int4_kivi", num_staging_blocks=3)
    per_token = kernels.bytes_per_token("int4_kivi", H, D, block_size=bs)
    assert per_token == H * (D // 2 + 4 * 2) + H * (D // 2 + 4 * D // bs)
    assert layer.nbytes() == nb * bs * per_token + 3 * bs * H * D * 2 + nb * 4
    assert allocate_kv_cache(nb, bs, H, D, "int4_kivi").staging.num_slots == nb  # min(num_blocks, 256)
    assert kernels.get_format("kivi").name == "int4_kivi" and "int4_kivi" in kernels.FORMATS
    with pytest.raises(kernels.KVFormatError, match="per channel"):
        quantize_kv(torch.randn(3, H, D), "int4_kivi")
    with pytest.raises(kernels.KVFormatError, match="allocate"):
        kernels.paged_decode_attention(torch.randn(1, H, D), layer.k, layer.v, torch.zeros(1, 1, dtype=torch.int32),
                                       torch.ones(1, dtype=torch.int32), kv_format="int4_kivi")
    with pytest.raises(kernels.KVFormatError, match="num_staging_blocks"):
        allocate_kv_cache(2, 4, H, D, "int4", num_staging_blocks=2)
    with pytest.raises(kernels.ShapeError, match="distinct"):
        kernels.copy_blocks(layer, [(0, 2), (1, 2)])
    with pytest.raises(kernels.ShapeError, match="same format"):
        kernels.swap_blocks(layer, allocate_kv_cache(nb, bs, H, D, "int4"), [(0, 0)])
    assert math.isclose(kernels.bytes_per_token("int4_kivi", 8, 128, block_size=16) /
                        kernels.bytes_per_token("int4", 8, 128), (64 + 16 + 64 + 32) / (2 * (64 + 16)))


def test_empty_staging_pool():
    """num_staging_blocks=0: block size 1 never stages (every write fills its block); larger blocks
    cannot hold a partial block and say so."""
    g = torch.Generator().manual_seed(8)
    layer = allocate_kv_cache(4, 1, H, D, "int4_kivi", num_staging_blocks=0)
    k = torch.randn(3, H, D, generator=g)
    kernels.write_kv(k, k, layer, torch.tensor([2, 0, 3], dtype=torch.int32))
    assert torch.equal(gather_kv(layer, "k", torch.tensor([2, 0, 3]))[:, 0], k.half().float())  # exact: scale 0
    tables, lens = torch.tensor([[2, 0, 3]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    q = torch.randn(1, H, D, generator=g)
    ref = kernels.paged_decode_attention(q, layer, None, tables, lens, backend="torch")
    if BACKEND is not None:
        out = kernels.paged_decode_attention(q, layer, None, tables, lens, backend=BACKEND)
        torch.testing.assert_close(out, ref, **_tol(torch.float32))
    with pytest.raises(StagingExhaustedError):
        kernels.write_kv(k[:1], k[:1], allocate_kv_cache(4, 4, H, D, "int4_kivi", num_staging_blocks=0),
                         lens.new_tensor([0]))


def test_growable_staging_grows_instead_of_failing():
    """A pool made with grow_staging starts small, grows (only adding free slots) when more
    blocks are unfilled at once, and never past one slot per block."""
    layer = kernels.allocate_kv_cache(6, 4, 1, 64, "int4_kivi", dtype=torch.float32, num_staging_blocks=1,
                                      grow_staging=True)
    k = torch.randn(6, 1, 64)
    kernels.write_kv(k, k.clone(), layer, torch.tensor([0, 4, 8, 12, 16, 20]))  # one token into each of 6 blocks
    assert layer.staging.num_slots == 6 and layer.staging.num_used == 6
    layer.staging.check()
    fixed = kernels.allocate_kv_cache(6, 4, 1, 64, "int4_kivi", dtype=torch.float32, num_staging_blocks=1)
    with pytest.raises(kernels.StagingExhaustedError):
        kernels.write_kv(k[:2], k[:2].clone(), fixed, torch.tensor([0, 4]))
    assert fixed.staging.num_used == 0
