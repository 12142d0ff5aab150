"""Time budgets that used to be asserted inside unit tests, measured here instead.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/time_budgets.py [--skip quant] [--rounds 1]

A unit test that fails when the machine is busy says nothing about the code, so the suite
checks what these paths do and this script measures what they cost, one row each, beside
the budget the old assertion held them to:

1. the CI-sized KV-quantization study (``paged.quant.study``: int8 and int4 on SmolLM2, ctx 256,
   one chunk of each shipped source, 8 divergence tokens; was ``tests/test_quant.py::
   test_study_ci_sized_run_time``, budget 60 CPU s, 15 s measured then): CPU seconds of every
   thread of this process (what neighbours on a busy box do not inflate) and wall seconds;
2. ``simulate`` on a trace whose middle row asks for 1e11 / 2e8 / 2e7 prompt tokens (was
   ``tests/test_gaps_trace.py::test_huge_rows_are_rejected_before_a_prompt_is_synthesised``,
   budget 5 s): the row is rejected before a prompt is synthesised, so the run costs what
   the two small rows cost whatever the huge one asks for (the test keeps the 200 MiB memory bound).

Times are the best of ``--rounds`` (``benchmarks.harness``).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's kernels, not benchmarks/kernels.py

from benchmarks.harness import best_of, process_s, timed, wall_s  # noqa: E402

SMALL = dict(model="llama-2-7b", gpu="a100-40gb", max_model_len=1024, num_blocks=200)


def quant_study(rounds: int) -> list[tuple[str, float, str, float]]:
    from paged.quant import study
    from paged.quant.runs import load
    lm = load()

    def run():
        df = study(lm, formats=["int8", "int4"], context_lengths=(256,), max_chunks=1, divergence_tokens=8,
                   progress=False)
        assert len(df) == 4 * 3, len(df)   # (fp32 base, fp16 floor, int8, int4) x (3 sources + all)

    both = [timed(lambda: timed(run, wall_s)[0], process_s) for _ in range(rounds)]  # (CPU s, wall s) per round
    cpu, wall = min(c for c, _ in both), min(w for _, w in both)
    return [("quant study, CI-sized (int8, int4; ctx 256)", cpu, "CPU s, all threads", 60.0),
            ("  the same, wall", wall, "s", float("nan"))]


def huge_rows(rounds: int) -> list[tuple[str, float, str, float]]:
    import pandas as pd

    from paged.sim.simulator import SimConfig, simulate
    out = []
    for prompt in (10**11, 2 * 10**8, 2 * 10**7):
        tr = pd.DataFrame({"arrival_time": [0.0, 0.5, 1.0], "prompt_tokens": [100, prompt, 50],
                           "output_tokens": [10, 10, 10**6]})
        res = []
        t = best_of([lambda: res.append(simulate(tr, SimConfig(**SMALL)))], rounds, clock=wall_s)[0][0]
        s = res[-1].summary
        assert s["requests_rejected"] == 2 and s["requests_finished"] == 1, s
        out.append((f"simulate, a {prompt:.0e}-token row rejected", t, "s", 5.0))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--skip", default="", help="comma list of rows to skip: quant,huge")
    a = ap.parse_args(argv)
    skip = set(filter(None, a.skip.split(",")))
    rows = (quant_study(a.rounds) if "quant" not in skip else []) + (huge_rows(a.rounds) if "huge" not in skip else [])
    print(f"{'path':<48} {'measured':>10} {'unit':<20} {'budget':>8} {'of budget':>10}")
    for name, v, unit, budget in rows:
        share = f"{v / budget:.0%}" if budget == budget else ""
        print(f"{name:<48} {v:10.2f} {unit:<20} {'' if budget != budget else f'{budget:g}':>8} {share:>10}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
