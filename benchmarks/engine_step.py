"""One decode step at equal batch: our engine vs transformers, same model, no padding.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/engine_step.py [--batch 16] [--prompt 128] [--rounds 6]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/engine_step.py --profile   # top ops of our step
    ... --unpacked --torch-only   # also ours with plain F.linear / without kernels.native

``--batch`` prompts of ``--prompt`` random token ids each (seeded, equal length: no padding on
either side). Ours: ``LLMEngine.step()`` after the prefill step (scheduling, batch building,
forward, sampling and bookkeeping all counted). transformers: ``model(next_ids,
past_key_values=cache)`` plus a greedy argmax, the same work. The two run in interleaved rounds
of ``--steps`` decode steps each, so a busy neighbour on this shared machine slows both alike;
the table gives the median per-step ratio over rounds and its range (the noise). Times are this
thread's CPU time (OMP_NUM_THREADS=1 keeps the work on it); wall time is shown beside.
"Same tokens" compares every greedy token of every decode step.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.harness import cpu_and_wall as _clock, interleave, spread  # noqa: E402
from paged.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from paged.engine.sampling import SamplingParams  # noqa: E402
from paged.models import load_model  # noqa: E402


class Ours:
    def __init__(self, loaded, prompts: list[list[int]], max_tokens: int) -> None:
        n = len(prompts)
        cfg = EngineConfig(max_num_batched_tokens=max(2048, n * len(prompts[0])), record_events=False,
                           max_num_seqs=max(256, n))
        self.engine = LLMEngine(loaded, cfg)
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.ids = [f"r{i}" for i in range(n)]
        for rid, p in zip(self.ids, prompts):
            self.engine.add_request(rid, p, sp)
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self._take(self.engine.step())  # the prefill step

    def _take(self, out) -> None:
        for i, rid in enumerate(self.ids):
            if rid in out.new_tokens:
                self.tokens[i].append(out.new_tokens[rid])

    def steps(self, k: int) -> tuple[float, float]:
        c0, w0 = _clock()
        for _ in range(k):
            self._take(self.engine.step())
        c1, w1 = _clock()
        return c1 - c0, w1 - w0


class SwitchedOff(Ours):
    """Ours with a process-wide ``ENABLED`` switch off during its own steps, measured in the same
    rounds: ``paged.models.packed`` (plain ``F.linear``) or ``kernels.native`` (decode rows gather
    K/V and call SDPA; norms, SiLU and RoPE are torch ops)."""

    def __init__(self, module, *args) -> None:
        self.module = module
        super().__init__(*args)

    def steps(self, k: int) -> tuple[float, float]:
        self.module.ENABLED = False
        try:
            return super().steps(k)
        finally:
            self.module.ENABLED = True


class HF:
    def __init__(self, hf, prompts: list[list[int]]) -> None:
        self.hf = hf
        with torch.inference_mode():
            out = hf(input_ids=torch.tensor(prompts), use_cache=True)
        self.cache = out.past_key_values
        self.next = out.logits[:, -1].argmax(-1)
        self.tokens = [[int(t)] for t in self.next]

    def steps(self, k: int) -> tuple[float, float]:
        c0, w0 = _clock()
        with torch.inference_mode():
            for _ in range(k):
                out = self.hf(input_ids=self.next[:, None], past_key_values=self.cache, use_cache=True)
                self.next = out.logits[:, -1].float().argmax(-1)
                for row, t in zip(self.tokens, self.next.tolist()):
                    row.append(t)
        c1, w1 = _clock()
        return c1 - c0, w1 - w0


def load_hf():
    import transformers
    from paged.models import embedded_gguf_path
    p = embedded_gguf_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(p), gguf_file=os.path.basename(p), dtype=torch.float32).eval()


def profile(ours: Ours, k: int) -> None:
    from torch.profiler import ProfilerActivity, profile as prof
    ours.steps(2)
    with prof(activities=[ProfilerActivity.CPU]) as p:
        ours.steps(k)
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    n = sum(e.count for e in p.key_averages())
    print(f"aten/python ops recorded per step: {n / k:.0f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=4, help="decode steps per round and system")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="profile our decode steps and stop")
    ap.add_argument("--unpacked", action="store_true",
                    help="also run ours with plain F.linear (paged.models.packed.ENABLED = False)")
    ap.add_argument("--torch-only", action="store_true",
                    help="also run ours with the compiled CPU kernels off (kernels.native.ENABLED = False)")
    a = ap.parse_args(argv)
    g = torch.Generator().manual_seed(a.seed)
    prompts = torch.randint(100, 10000, (a.batch, a.prompt), generator=g).tolist()
    loaded = load_model("smollm2")
    total = a.rounds * a.steps + 4
    ours = Ours(loaded, prompts, total + 8)
    if a.profile:
        profile(ours, a.steps)
        return 0
    from kernels import native
    hf = HF(load_hf(), prompts)
    variants = [("ours (LLMEngine.step)", ours)]
    if a.unpacked:
        from paged.models import packed
        variants.append(("ours, plain F.linear (packed off)", SwitchedOff(packed, loaded, prompts, total + 8)))
    if a.torch_only:
        variants.append(("ours, torch ops only (native off)", SwitchedOff(native, loaded, prompts, total + 8)))
    systems = [hf] + [v for _, v in variants]
    for s in systems:
        s.steps(1)  # warm-up
    got = interleave({j: (lambda s=s: s.steps(a.steps)) for j, s in enumerate(systems)}, a.rounds)
    rows = [[got[j][r] for j in range(len(systems))] for r in range(a.rounds)]  # [round][system] (cpu, wall)
    ms = lambda xs: 1e3 * statistics.median(xs) / a.steps  # noqa: E731
    print(f"decode step, batch {a.batch}, context {a.prompt}..{a.prompt + total}, SmolLM2 fp32, "
          f"torch threads {torch.get_num_threads()}, {a.rounds} interleaved rounds x {a.steps} steps; "
          f"compiled CPU kernels: {'on' if native.available() else 'unavailable (' + native.unavailable_reason() + ')'}")
    print(f"{'system':<40} {'cpu ms/step':>11} {'wall ms/step':>12}")
    names = ["transformers forward + argmax"] + [n for n, _ in variants]
    for j, name in enumerate(names):
        print(f"{name:<40} {ms([r[j][0] for r in rows]):11.1f} {ms([r[j][1] for r in rows]):12.1f}")
    for j, (name, _) in enumerate(variants, start=1):
        mid, lo, hi = spread([r[j][0] / r[0][0] for r in rows])
        wall = [r[j][1] / r[0][1] for r in rows]
        print(f"{name} / transformers per step (cpu): median {mid:.3f}, "
              f"range {lo:.3f}-{hi:.3f} over rounds; wall median {statistics.median(wall):.3f}")
    n = min(len(ours.tokens[0]), len(hf.tokens[0]))
    for name, v in variants:
        same = sum(x == y for x, y in zip(v.tokens, hf.tokens))
        print(f"same greedy tokens, {name} vs transformers: {same}/{a.batch} sequences over {n} tokens each")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
