"""The oneDNN-packed linear (paged/models/packed.py) and the once-per-pass RoPE: same results
as the plain torch ops, batch-invariant rows, re-packed when the weight changes."""
import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from paged.models import packed  # noqa: E402
from paged.models.config import ModelConfig  # noqa: E402
from paged.models.rope import RotaryEmbedding  # noqa: E402

needs_onednn = pytest.mark.skipif(not packed.available(), reason="torch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear_and_is_batch_invariant(bias):
    g = torch.Generator().manual_seed(0)
    lin = packed.PackedLinear(96, 200, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(200, 96, generator=g) * 0.1)
        if bias:
            lin.bias.copy_(torch.randn(200, generator=g))
    x = torch.randn(300, 96, generator=g)
    with torch.inference_mode():
        full = lin(x)
        torch.testing.assert_close(full, F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
        for m in (1, 2, 5, 16, 17, 64, 299):  # a row's result does not depend on its batch
            assert torch.equal(lin(x[:m]), full[:m]), m
        assert lin(x[:0]).shape == (0, 200)


@needs_onednn
def test_packed_weight_follows_in_place_writes_and_the_switch():
    lin = packed.PackedLinear(8, 4, bias=False)
    x = torch.randn(3, 8)
    with torch.inference_mode():
        first = lin(x)
        with torch.no_grad():
            lin.weight.mul_(2)
        torch.testing.assert_close(lin(x), 2 * first)  # re-packed after the in-place write
        packed.ENABLED = False
        try:
            assert torch.equal(lin(x), F.linear(x, lin.weight))
        finally:
            packed.ENABLED = True


def test_non_float32_inputs_take_the_plain_path():
    lin = packed.PackedLinear(8, 4, bias=False).to(torch.bfloat16)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(lin(x), F.linear(x, lin.weight))


def test_rope_rotate_once_per_pass_is_bit_identical():
    cfg = ModelConfig(architecture="llama", vocab_size=32, hidden_size=64, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=16, intermediate_size=64, max_position_embeddings=64)
    rope = RotaryEmbedding(cfg, 64)
    pos = torch.tensor([0, 5, 9, 63])
    q, k = torch.randn(4, 4, 16), torch.randn(4, 2, 16)
    q_ref, k_ref = rope(pos, q, k)
    qk = rope.rotate(torch.cat([q, k], 1), rope.tables(pos))
    assert torch.equal(qk[:, :4], q_ref) and torch.equal(qk[:, 4:], k_ref)


def test_rmsnorm_float32_cpu_paths_equal_the_formula(monkeypatch):
    """torch's one-op rms_norm: the formula's bits; the compiled one (kernels.native): its value
    (the sum of squares reassociated)."""
    from kernels import native
    from paged.models.llama import RMSNorm
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=g))
    for rows, scale in ((1, 1.0), (16, 7.0), (257, 0.01)):
        x = torch.randn(rows, 576, generator=g) * scale
        with torch.no_grad():
            ref = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
            assert native.available()
            torch.testing.assert_close(norm(x), ref, atol=1e-6, rtol=1e-6)
            monkeypatch.setattr(native, "ENABLED", False)
            assert torch.equal(norm(x), ref)
            monkeypatch.undo()
