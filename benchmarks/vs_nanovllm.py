"""Our block manager and scheduler beside nano-vllm's, measured in one run, as ratios.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/vs_nanovllm.py [--rounds 9] [--quick]

nano-vllm's source is read from ``$NANO_VLLM_SRC`` or ``.cache/nano-vllm`` (a directory holding
its ``nanovllm/`` package; git-ignored, never committed), e.g.::

    mkdir -p .cache/nano-vllm && git -C <nano-vllm checkout> archive HEAD nanovllm | tar -x -C .cache/nano-vllm

Only its ``engine/{sequence,block_manager,scheduler}.py`` are imported (a stub ``nanovllm`` package
keeps its model runner, torch.distributed and flash-attn out). Without it, our rows print alone.

1. miss path per block: a new unique prompt of 31 full blocks + 8 tokens, from lookup to free:
   ours ``find_cached_prefix`` + ``allocate_slots`` (hashes and indexes the full blocks) + ``free``,
   with each hash function; nano-vllm ``can_allocate`` + ``allocate`` + ``hash_blocks`` (what its
   ``postprocess`` does after the prefill) + ``deallocate``. Both pools are warm: every allocation
   reuses a block that still holds an old hash (evicts it). Block size 16 and 256.
2. scheduler decode step per running sequence at 32 / 256 / 1024 running: ours ``schedule()`` +
   ``update()`` (prefix caching on, NullRecorder); nano-vllm ``schedule()`` + ``postprocess()``.
   Block size 16 for both (a block filled and hashed every 16 steps), prompts of 100 tokens.

Times are this thread's CPU time; each figure is the median over ``--rounds`` rounds in which
ours and nano-vllm alternate (so a busy neighbour slows both alike); the spread column is
max/min of the per-round ratio, the noise of this shared machine.
"""
from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import interleave, spread, thread_ns as now  # noqa: E402
from benchmarks.kv_workloads import SchedState, prompt as tokens  # noqa: E402
from paged import KVCacheManager, NullRecorder, Request  # noqa: E402


def load_nano(src: str | None = None):
    """(sequence, block_manager, scheduler) modules of nano-vllm, or None when not available."""
    root = Path(src or os.environ.get("NANO_VLLM_SRC") or ROOT / ".cache" / "nano-vllm")
    if not (root / "nanovllm" / "engine" / "block_manager.py").exists():
        return None
    for name, path in (("nanovllm", root / "nanovllm"), ("nanovllm.engine", root / "nanovllm" / "engine")):
        m = types.ModuleType(name)
        m.__path__ = [str(path)]
        sys.modules[name] = m
    cfg = types.ModuleType("nanovllm.config")
    cfg.Config = object  # only a type hint in the scheduler
    sys.modules["nanovllm.config"] = cfg
    return tuple(importlib.import_module(f"nanovllm.engine.{n}") for n in ("sequence", "block_manager", "scheduler"))


# ---- 1. miss path ----------------------------------------------------------------------
class OursMiss:
    def __init__(self, bs: int, hash_fn: str, num_blocks: int) -> None:
        self.kv = KVCacheManager(num_blocks, bs, enable_prefix_caching=True, hash_fn=hash_fn)
        self.bs, self.n, self.uid = bs, 31 * bs + 8, 0
        self.run(num_blocks // 32)  # warm: every free block now holds a hash

    def run(self, cycles: int) -> float:
        reqs = []
        for _ in range(cycles):
            self.uid += 1
            reqs.append(Request(f"m{self.uid}", tokens(self.uid, self.n), max_tokens=1))
        kv = self.kv
        t0 = now()
        for r in reqs:
            cached = kv.find_cached_prefix(r)
            kv.allocate_slots(r, r.num_tokens - len(cached) * self.bs, cached)
            kv.free(r.request_id)
        return (now() - t0) / (cycles * 32)


class NanoMiss:
    def __init__(self, nano, bs: int, num_blocks: int) -> None:
        seq_mod, bm_mod, _ = nano
        seq_mod.Sequence.block_size = bs
        self.Seq = seq_mod.Sequence
        self.bm = bm_mod.BlockManager(num_blocks, bs)
        self.n, self.uid = 31 * bs + 8, 0
        self.run(num_blocks // 32)

    def run(self, cycles: int) -> float:
        seqs = []
        for _ in range(cycles):
            self.uid += 1
            seqs.append(self.Seq(tokens(self.uid, self.n)))
        bm = self.bm
        t0 = now()
        for s in seqs:
            n = bm.can_allocate(s)
            bm.allocate(s, n)
            s.num_scheduled_tokens = s.num_tokens - s.num_cached_tokens
            bm.hash_blocks(s)
            bm.deallocate(s)
        return (now() - t0) / (cycles * 32)


# ---- 2. scheduler ----------------------------------------------------------------------
class OursSched(SchedState):
    """Ours in steady decode (``benchmarks.kv_workloads.SchedState``, NullRecorder, block 16)."""

    def __init__(self, batch: int, max_steps: int) -> None:
        super().__init__(batch, max_steps, NullRecorder())

    def run(self, steps: int) -> float:
        return self.steps(steps)


class NanoSched:
    PROMPT = 100

    def __init__(self, nano, batch: int, max_steps: int) -> None:
        seq_mod, _, sched_mod = nano
        seq_mod.Sequence.block_size = 16
        total = self.PROMPT + max_steps + 4
        cfg = types.SimpleNamespace(max_num_seqs=batch, max_num_batched_tokens=8192, eos=-1, kvcache_block_size=16,
                                    num_kvcache_blocks=batch * -(-total // 16) + 64)
        self.s = s = sched_mod.Scheduler(cfg)
        sp = types.SimpleNamespace(temperature=0.0, max_tokens=max_steps + 4, ignore_eos=True)
        for i in range(batch):
            s.add(seq_mod.Sequence(tokens(i, self.PROMPT), sp))
        while True:
            seqs, prefill = s.schedule()
            s.postprocess(seqs, [7] * len(seqs), prefill)
            if not prefill and len(seqs) == batch:
                break

    def run(self, steps: int) -> float:
        s = self.s
        t0 = now()
        for _ in range(steps):
            seqs, prefill = s.schedule()
            s.postprocess(seqs, [7] * len(seqs), prefill)
        return (now() - t0) / steps


def _interleave(pairs: dict, rounds: int, work) -> dict:
    """pairs: key -> {system: state}; returns key -> {system: [value per round]}. Every (key,
    system) runs once per round, in an order that reverses every round (so within a key, ours and
    nano-vllm take turns going first)."""
    flat = {(k, name): (lambda k=k, st=st: work(k, st)) for k, systems in pairs.items() for name, st in systems.items()}
    got = interleave(flat, rounds)
    return {k: {name: got[(k, name)] for name in systems} for k, systems in pairs.items()}


def _line(label: str, ours: list[float], ref: list[float] | None, unit: str, scale: float) -> str:
    med = statistics.median(ours) * scale
    if ref is None:
        return f"  {label:<40} {med:9.2f} {unit}"
    mid, lo, hi = spread([o / n for o, n in zip(ours, ref)])
    return (f"  {label:<40} {med:9.2f} {unit}  nano-vllm {statistics.median(ref) * scale:9.2f} {unit}  "
            f"ours/nano {mid:5.2f}  (rounds {lo:.2f}-{hi:.2f})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--quick", action="store_true", help="3 rounds, smaller work")
    ap.add_argument("--run-only", metavar="SYSTEM:BATCH:STEPS",
                    help="set up one scheduler (ours|nano) and run STEPS decode steps, printing nothing: for "
                         "deterministic instruction counts, e.g. valgrind --tool=cachegrind --cache-sim=no ... "
                         "with STEPS=64 minus STEPS=0, divided by 64 x BATCH")
    a = ap.parse_args(argv)
    if a.run_only:
        system, batch, steps = a.run_only.split(":")
        batch, steps = int(batch), int(steps)
        cap = 320  # the same set-up whatever STEPS is (so a difference of two runs is the steps alone)
        if steps > cap - 32:
            raise SystemExit(f"--run-only: at most {cap - 32} steps")
        st = NanoSched(load_nano(), batch, cap) if system == "nano" else OursSched(batch, cap)
        if steps:
            st.run(steps)
        return 0
    rounds, cycles, req_steps = (3, 8, 4096) if a.quick else (a.rounds, 64, 32768)
    nano = load_nano()
    print("nano-vllm:", "not found (set NANO_VLLM_SRC); our rows only" if nano is None else
          Path(sys.modules["nanovllm.engine.block_manager"].__file__).parents[2])
    print("1. miss path, ns per block (31 full blocks + 8 tokens per prompt, warm pools)")
    hashes = ("xxh3_128", "sha256", "builtin")
    for bs in (16, 256):
        systems = {h: OursMiss(bs, h, 2048) for h in hashes}
        if nano is not None:
            systems["nano"] = NanoMiss(nano, bs, 2048)
        got = _interleave({bs: systems}, rounds, lambda k, st: st.run(cycles))[bs]
        for h in hashes:
            print(_line(f"block {bs}, ours ({h})", got[h], got.get("nano"), "µs", 1e-3))
    print("2. scheduler decode step, µs per running sequence (block 16)")
    pairs = {}
    for b in (32, 256, 1024):
        steps = max(16, req_steps // b)
        pairs[b] = {"ours": OursSched(b, steps * rounds + 32)}
        if nano is not None:
            pairs[b]["nano"] = NanoSched(nano, b, steps * rounds + 32)
    got = _interleave(pairs, rounds, lambda b, st: st.run(max(16, req_steps // b)) / b)
    for b in pairs:
        print(_line(f"{b} running", got[b]["ours"], got[b].get("nano"), "µs", 1e-3))
    flat = statistics.median(got[1024]["ours"]) / statistics.median(got[32]["ours"])
    line = f"  flatness 1024/32: ours {flat:.2f}"
    if nano is not None:
        line += f", nano-vllm {statistics.median(got[1024]['nano']) / statistics.median(got[32]['nano']):.2f}"
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
