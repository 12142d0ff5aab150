"""paged.engine.swap: the one device <-> host block mover (sync reference, overlap schedule,
compressed host blocks). Lossless modes keep greedy outputs identical; compressed swap's
restored K/V error stays within its codec's bound."""
from __future__ import annotations

import pytest
import torch

from paged._kernels import kernels
from paged.engine.llm import LLM
from paged.engine.sampling import SamplingParams
from paged.engine.swap import NullStreams, SwapExecutor, runs
from paged.engine.swap_codec import CODECS
from paged.errors import ConfigError
from paged.models import load_model
from paged.models.testing import make_tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
NB, BS, H, D = 12, 4, 2, 64


def _layers(n_layers=2, nb=NB, dtype=torch.float32, fmt="auto", seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_layers):
        layer = kernels.allocate_kv_cache(nb, BS, H, D, fmt, dtype=dtype)
        if not layer.kv_format.quantized:
            layer.k.copy_(torch.randn(layer.k.shape, generator=g).to(dtype))
            layer.v.copy_(torch.randn(layer.v.shape, generator=g).to(dtype))
        out.append(layer)
    return out


def test_runs_coalesce_consecutive_ids():
    assert runs([3, 4, 5, 9, 10, 2]) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]
    assert runs([]) == []


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_roundtrip_lossless_is_bit_exact(mode):
    dev = _layers()
    ref = [(layer.k.clone(), layer.v.clone()) for layer in dev]
    host = [kernels.allocate_kv_cache(6, BS, H, D, dtype=torch.float32) for _ in dev]
    sw = SwapExecutor.build(dev, 6, mode=mode, host_layers=host)
    sw.swap_out([(7, 2), (3, 0), (4, 1)])
    for layer in dev:  # the device blocks may be reused at once
        layer.k[[7, 3, 4]] = 0
        layer.v[[7, 3, 4]] = 0
    sw.swap_in([(0, 10), (1, 11), (2, 5)])
    sw.fence()
    for layer, (k, v) in zip(dev, ref):
        assert torch.equal(layer.k[[10, 11, 5]], k[[3, 4, 7]])
        assert torch.equal(layer.v[[10, 11, 5]], v[[3, 4, 7]])
    assert sw.bytes_out == sw.bytes_in == 3 * sw.host_block_bytes() == 3 * sw.device_block_bytes()


def test_bad_ids_change_nothing():
    dev = _layers()
    host = [kernels.allocate_kv_cache(4, BS, H, D, dtype=torch.float32) for _ in dev]
    sw = SwapExecutor.build(dev, 4, mode="overlap", host_layers=host)
    with pytest.raises(kernels.ShapeError, match=r"\[0, 4\)"):
        sw.swap_out([(1, 0), (2, 4)])
    assert all(not h.k.any() for h in host) and sw.bytes_out == 0
    with pytest.raises(ConfigError, match="swap_mode"):
        SwapExecutor(dev, host, mode="async")
    with pytest.raises(ConfigError, match="already quantized"):
        SwapExecutor.build(_layers(fmt="int8"), 4, compression="int4")


class FakeStreams(NullStreams):
    """Records stream operations in order: events are ("ev", stream, n)."""

    kind = "fake"

    def __init__(self):
        self.log, self.n, self.cur = [], 0, "main"

    def side(self, which):
        fake = self

        class Ctx:
            def __enter__(self):
                fake.cur = which
                fake.log.append(("enter", which))

            def __exit__(self, *exc):
                fake.cur = "main"
                fake.log.append(("exit", which))
        return Ctx()

    def side_waits_main(self, which):
        self.log.append(("wait_main", which))

    def side_waits(self, which, event):
        if event is not None:
            self.log.append(("side_waits", which, event))

    def record(self, which):
        assert self.cur == which, "events are recorded on the stream that did the work"
        self.n += 1
        ev = ("ev", which, self.n)
        self.log.append(("record", ev))
        return ev

    def main_waits(self, event):
        self.log.append(("main_waits", event))


def test_overlap_schedule_fences_in_order():
    dev = _layers()
    host = [kernels.allocate_kv_cache(6, BS, H, D, dtype=torch.float32) for _ in dev]
    fs = FakeStreams()
    sw = SwapExecutor(dev, host, mode="overlap", streams=fs)
    sw.swap_out([(1, 0), (2, 1)])
    log = fs.log
    assert log[0] == ("wait_main", "out")          # blocks are final before the gather
    read = log[log.index(("enter", "out")) + 1][1]  # first event after the gather: device reads done
    assert ("main_waits", read) in log             # the device blocks are reusable after that
    done = log[log.index(("exit", "out")) - 1][1]  # host copies done
    assert done != read
    fs.log = []
    sw.swap_in([(1, 5), (3, 6)])                   # host block 1 was written by the swap-out
    assert fs.log[0] == ("wait_main", "in")
    assert ("side_waits", "in", done) in fs.log    # read host block 1 only after its copy
    layer_events = [e[1] for e in fs.log if e[0] == "record"][:2]
    fs.log = []
    wrapped = sw.fenced(lambda i, q, k, v: q, [0, 1])
    wrapped(0, 1, 2, 3)
    assert fs.log == [("main_waits", layer_events[0])]  # layer 0 waits only for its own blocks
    wrapped(1, 1, 2, 3)
    assert fs.log[-1] == ("main_waits", layer_events[1])
    fs.log = []
    sw.fence()
    assert fs.log == []                            # nothing left pending
    sw.swap_out([(4, 3)])                          # host block 3 is still read by the swap-in
    assert any(e[0] == "side_waits" and e[1] == "out" for e in fs.log)


def test_prefetch_serves_swap_in_and_is_dropped_when_the_host_block_is_rewritten():
    dev = _layers()
    ref = [(layer.k.clone(), layer.v.clone()) for layer in dev]
    host = [kernels.allocate_kv_cache(6, BS, H, D, dtype=torch.float32) for _ in dev]
    fs = FakeStreams()
    sw = SwapExecutor(dev, host, mode="overlap", streams=fs)
    sw.swap_out([(1, 0), (2, 1), (3, 4)])
    done = [e for e in fs.log if e[0] == "record"][-1][1]
    fs.log = []
    sw.prefetch([4, 0, 1, 9])                      # 9 is no host block: ignored
    assert ("side_waits", "in", done) in fs.log    # the prefetch reads host blocks after their copy
    assert sorted(sw._prefetched) == [0, 1, 4]
    sw.swap_out([(5, 1)])                          # host block 1 gets new content: its copy is stale
    assert sorted(sw._prefetched) == [0, 4]
    sw.swap_in([(4, 8), (1, 9), (0, 10)])
    sw.fence()
    assert sw.num_prefetch_hits == 2 and not sw._prefetched
    for layer, (k, v) in zip(dev, ref):
        assert torch.equal(layer.k[[8, 9, 10]], k[[3, 5, 1]]) and torch.equal(layer.v[[8, 9, 10]], v[[3, 5, 1]])
    sync = SwapExecutor(dev, host)
    sync.prefetch([0])
    assert not sync._prefetched                    # sync mode: no prefetch


def test_sync_mode_is_the_kernels_reference():
    dev = _layers()
    sw = SwapExecutor.build(dev, 4, host_layers=[kernels.allocate_kv_cache(4, BS, H, D, dtype=torch.float32)
                                                  for _ in dev])
    assert not sw._scheduled and sw.fenced("attn", [0, 1]) == "attn"


@pytest.mark.parametrize("codec", ["fp8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compressed_roundtrip_error_within_codec_bound(codec, dtype):
    dev = _layers(dtype=dtype, seed=3)
    for layer in dev:  # outliers and a zero block: scales must handle both
        layer.k[2, 0, 0, 0] = 40.0
        layer.v[5] = 0
    ref = [(layer.k.float().clone(), layer.v.float().clone()) for layer in dev]
    sw = SwapExecutor.build(dev, 8, mode="overlap", compression=codec)
    pairs = [(b, i) for i, b in enumerate([2, 5, 6, 7])]
    sw.swap_out(pairs)
    sw.swap_in([(i, b) for b, i in pairs])
    sw.fence()
    ids = [b for b, _ in pairs]
    for layer, (k, v) in zip(dev, ref):
        for got, want in ((layer.k[ids].float(), k[ids]), (layer.v[ids].float(), v[ids])):
            err = (got - want).abs()
            if codec == "fp8":  # 3 mantissa bits: half an ulp = 2^-4 relative; subnormals: scale * 2^-10
                scale = want.abs().amax(dim=(1, 3), keepdim=True) / 448
                bound = want.abs() * 2 ** -4 + scale * 2 ** -10
            else:  # half a step per group of 32, plus fp16 rounding of scale and zero (2^-11 relative)
                g = want.reshape(*want.shape[:-1], D // 32, 32)
                step = (g.amax(-1) - g.amin(-1)) / 15
                slack = 16 * 2 ** -11 * (step * 15 + g.amin(-1).abs())
                bound = (step / 2 + slack).repeat_interleave(32, dim=-1)
            # the restored value is rounded to the cache dtype (bf16: 2^-8 relative)
            bound = bound + (want.abs() * 2 ** -8 if dtype == torch.bfloat16 else 1e-6)
            assert (err <= bound * (1 + 1e-5) + 1e-7).all(), float((err - bound).max())
        assert not layer.v[5].any()  # an all-zero block comes back exactly
    ratio = sw.device_block_bytes() / sw.host_block_bytes()
    want_ratio = {("fp8", torch.float32): 4 * D / (D + 4 / BS), ("int4", torch.float32): 4 * D / (D / 2 + 8)}
    if (codec, dtype) in want_ratio:
        assert ratio == pytest.approx(want_ratio[(codec, dtype)], rel=1e-6)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama", num_heads=4, num_kv_heads=2))


def _run(model, prompts, **cfg):
    llm = LLM(model=model, **cfg)
    outs = llm.generate(prompts, GREEDY)
    return [o.outputs[0].token_ids for o in outs], llm


def test_greedy_outputs_identical_sync_overlap_under_swap_pressure(tiny):
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (21, 17, 25, 19, 23, 15)]
    ref, _ = _run(tiny, prompts, num_blocks=256, block_size=4)
    pressure = dict(num_blocks=14, block_size=4, preemption_mode="swap", max_num_batched_tokens=24)
    sync, a = _run(tiny, prompts, **pressure)
    over, b = _run(tiny, prompts, swap_mode="overlap", **pressure)
    assert sync == over == ref
    assert a.engine.runner.swap.bytes_out > 0 and b.engine.runner.swap.bytes_out == a.engine.runner.swap.bytes_out
    assert b.engine.runner.swap.num_prefetch_hits > 0  # the overlap run swapped some blocks in from prefetches
    _, c = _run(tiny, prompts, swap_mode="overlap", swap_compression="int4", **pressure)
    sw = c.engine.runner.swap  # lossy: outputs may differ (paged.studies.swap_error measures by how much)
    assert sw.bytes_in > 0 and sw.host_block_bytes() < sw.device_block_bytes()


def test_overlap_with_host_tier_and_swap_preemption_is_lossless(tiny):
    """Tier copies and swaps share the executor (and the CPU pool): overlap == sync == no tier."""
    import random
    from paged.engine.sampling import SamplingParams
    rng = random.Random(0)
    prefixes = [[rng.randrange(256) for _ in range(12)] for _ in range(4)]
    waves = [[prefixes[p] + [rng.randrange(256) for _ in range(rng.randrange(1, 6))] for p in w]
             for w in ([0, 1], [2, 3], [0, 1], [2, 3], [0, 2])]
    cfg = dict(block_size=4, num_blocks=9, max_num_batched_tokens=64, max_model_len=64, max_num_seqs=2,
               preemption_mode="swap", num_cpu_blocks=8)

    def run(**kw):
        eng = LLM(model=tiny, **cfg, **kw).engine
        outs = []
        for i, wave in enumerate(waves):
            for j, p in enumerate(wave):
                eng.add_request(f"{i}.{j}", p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
            while eng.has_unfinished_requests():
                st = eng.step()
                outs += [(o.request_id, o.outputs[0].token_ids) for o in st.finished]
        return sorted(outs), eng.runner.swap
    base, _ = run()
    sync, a = run(enable_host_tier=True)
    over, b = run(enable_host_tier=True, swap_mode="overlap")
    assert base == sync == over
    assert b.bytes_in == a.bytes_in > 0


def test_engine_config_rejects_unknown_swap_settings(tiny):
    with pytest.raises(ConfigError, match="swap_mode"):
        LLM(model=tiny, num_blocks=8, swap_mode="fast")
    with pytest.raises(ConfigError, match="swap_compression"):
        LLM(model=tiny, num_blocks=8, swap_compression="int2")
    assert set(CODECS) == {"fp8", "int4"}


# The CUDA check of the overlap path (side streams, pinned host layers, greedy sync == overlap) is
# benchmarks/gpu_checks.py: it needs a GPU, and the collected suite runs on CPU with no skips.
