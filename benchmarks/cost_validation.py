"""The cost model's linear part against vidur's measured operator profiles (docs/cost_model.md).

    .venv/bin/python benchmarks/cost_validation.py                      # the shipped subset (data/vidur)
    .venv/bin/python benchmarks/cost_validation.py --vidur PATH/TO/vidur # every GPU, model and tp vidur holds
    .venv/bin/python benchmarks/cost_validation.py --vidur PATH --refit  # refit KERNEL_COSTS first

Per (GPU, model, tensor parallel): points, and for the closed-form roofline (``CostModel``
defaults) and the per-kernel model (``linear="kernels"``) the geometric-median error
``exp(median |ln(pred/meas)|) - 1`` and the smallest and largest ratio pred/meas. ``fit`` marks
the profiles the kernel figures were fitted on (Llama-2-7B and -70B); the rest are held out.
Profiles whose MLP is not gated (phi-2) are listed as skipped. Where the folder holds vidur's
``data/profiling/network/{a100,h100}_dgx/all_reduce.csv``, a second table holds the closed form's
all-reduce against them. Seconds: about 10 on the full set.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if sys.path and sys.path[0] == str(ROOT / "benchmarks"):  # run as a script: benchmarks/kernels.py
    sys.path[0] = str(ROOT)  # would shadow the kernels package

import pandas as pd  # noqa: E402

from paged.sim import cost_validation as cv  # noqa: E402
from paged.sim.kernel_costs import KERNEL_COSTS  # noqa: E402
from paged.sim.specs import get_gpu  # noqa: E402

FIT_MODELS = ("Llama-2-7b-hf", "Llama-2-70b-hf")


def main(argv: list[str] | None = None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vidur", default=str(ROOT / "data" / "vidur"), help="vidur checkout (or data/vidur)")
    ap.add_argument("--refit", action="store_true", help="refit each GPU's KernelCosts on Llama-2-7B/70B first")
    ap.add_argument("--by-model", action="store_true", help="one row per model (all tp) instead of per tp")
    ap.add_argument("--csv", help="also write the table here")
    a = ap.parse_args(argv)
    profiles, skipped = [], []
    for gpu, model, path in cv.find_profiles(a.vidur):
        df = cv.read_mlp_profile(path)
        if not df["use_gated_mlp"].astype(bool).all():
            skipped.append(f"{gpu}/{model} (MLP not gated)")
            continue
        profiles.append((gpu, model, df))
    if a.refit:
        for gpu in sorted({g for g, _, _ in profiles}):
            train = [df for g, m, df in profiles if g == gpu and m in FIT_MODELS]
            if train:
                costs, score = cv.fit_kernel_costs(pd.concat(train), gpu)
                KERNEL_COSTS[get_gpu(cv.VIDUR_GPUS[gpu]).name] = costs
                print(f"{gpu}: {costs.with_(source='')!r}  score {score:.3f} (<= 1 meets 5% and 0.8-1.25x)")
    t = cv.error_table(profiles, by_tp=not a.by_model)
    t.insert(2, "fit", t["model"].isin(FIT_MODELS).map({True: "fit", False: "held out"}))
    t.loc[t["model"] == "all", "fit"] = ""
    for gpu in t["gpu"].unique():  # summary rows of the held-out profiles alone
        held = [(g, m, df) for g, m, df in profiles if (gpu == "all" or g == gpu) and m not in FIT_MODELS]
        if held:
            row = cv.error_table(held, by_tp=False).iloc[-1].copy()
            row["gpu"], row["model"], row["fit"] = gpu, "all", "held out"
            t = pd.concat([t, row.to_frame().T], ignore_index=True)
    t["points"] = t["points"].astype(int)
    t["fit"] = t["fit"].fillna("")
    if "tp" in t:
        t["tp"] = [f"{int(v)}" if v == v else "" for v in t["tp"]]
    with pd.option_context("display.width", 200, "display.max_rows", 1000):
        print(t.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    if skipped:
        print("skipped:", ", ".join(skipped))
    ar = cv.allreduce_table(a.vidur)
    if len(ar):
        print("\ntensor-parallel all-reduce: CostModel.comm_seconds per call vs vidur's network/<node>/all_reduce.csv")
        print(ar.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    if a.csv:
        t.to_csv(a.csv, index=False)
    return t


if __name__ == "__main__":
    main()
