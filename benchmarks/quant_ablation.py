"""Ablation of KV-quantization techniques on SmolLM2 (the lab formats of paged.quant.lab).

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python benchmarks/quant_ablation.py JOB [--protocol screen]
        [--decompose] [--csv reports/quant_ablation_JOB.csv]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/quant_ablation.py JOB --greedy 32
    .venv/bin/python benchmarks/quant_ablation.py report reports/quant_ablation_*.csv [--source licenses]

Each job is a list of lab specs, scored with llama-perplexity's KL protocol (ctx 512 or 2048,
second half of each chunk scored) against the fp32 base; rows are appended to the CSV as each
spec finishes. Protocols (``paged.quant.ablation.PROTOCOLS``): ``screen`` = licences 4 chunks +
kjv 2 + python 2 at ctx 512; ``lic19`` = the 19 licence chunks of the llama.cpp comparison;
``x512`` = kjv 8 + python 8 at 512; ``x2048`` = kjv 2 + python 2 at 2048. Everything fitted
(codebooks, channel means and weights) comes from ``data/text/calibration.txt`` (8 chunks of
512 tokens spread over the file), disjoint from every evaluated text.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# run as a script, sys.path[0] is benchmarks/ (whose kernels.py would shadow the kernels package)
sys.path[0] = str(Path(__file__).resolve().parents[1])

from paged.quant import ablation, calibration  # noqa: E402
from paged.quant.lab import EXACT, LabSpec, SideSpec  # noqa: E402
from paged.quant.runs import load  # noqa: E402
from paged.quant.split_cache import Served  # noqa: E402


def S(bits: int, levels: str = "int", **kw) -> SideSpec:
    return SideSpec(bits=bits, levels=levels, **kw)


def _k_techniques(b: int) -> list[LabSpec]:
    """Keys alone (V exact) at ``b`` bits: each switch on top of per-token uniform."""
    ks = [S(b, group=64), S(b, group=64, rot=True), S(b, axis="channel", group=32),
          S(b, axis="channel", group=64), S(b, axis="channel", group=32, pre_rope=True),
          S(b, "sym", rot=True), S(b, "normal", rot=True), S(b, "lloyd", rot=True),
          S(b, "lloyd", rot=True, pre_rope=True), S(b, "lloyd", rot=True, pre_rope=True, center=True),
          S(b, "lloyd", rot=True, pre_rope=True, center=True, weight="fisher"),
          S(b, "lloyd", rot=True, center=True, weight="fisher"), S(b, "lloyd", rot=True, weight="fisher"),
          S(b, "lloyd", pre_rope=True, center=True, weight="std"), S(b, group=64, outliers=1),
          S(b, "lloyd", rot=True, pre_rope=True, center=True, weight="fisher", outliers=1)]
    return [LabSpec(k, EXACT) for k in ks]


def _v_techniques(b: int) -> list[LabSpec]:
    """Values alone (K exact) at ``b`` bits."""
    vs = [S(b, group=64), S(b, group=64, rot=True), S(b, "sym", rot=True), S(b, "normal", rot=True),
          S(b, "lloyd", rot=True), S(b, "lloyd", rot=True, center=True),
          S(b, "lloyd", rot=True, center=True, weight="fisher"), S(b, "lloyd", rot=True, weight="fisher"),
          S(b, "lloyd", rot=True, scale="rms"), S(b, group=64, outliers=1)]
    return [LabSpec(EXACT, v) for v in vs]


def _kivi() -> list[LabSpec]:
    """Keys alone, per channel (KIVI): bits x group, pre-RoPE, codebook levels, compact scales, sink, window."""
    out = [LabSpec(S(b, axis="channel", group=g, pre_rope=True), EXACT) for b in (4, 3, 2) for g in (16, 32, 64)]
    out += [LabSpec(S(3, axis="channel", group=32), EXACT),
            LabSpec(S(3, "lloyd", axis="channel", group=32, pre_rope=True), EXACT),
            LabSpec(S(4, axis="channel", group=32, pre_rope=True, scale_bits=8), EXACT),
            LabSpec(S(3, axis="channel", group=32, pre_rope=True, scale_bits=8), EXACT),
            LabSpec(S(3, axis="channel", group=32, pre_rope=True), EXACT, sink=1),
            LabSpec(S(3, axis="channel", group=32, pre_rope=True), EXACT, sink=4),
            LabSpec(S(3, axis="channel", group=32, pre_rope=True), EXACT, window=16),
            LabSpec(S(3, axis="channel", group=32, pre_rope=True), EXACT, window=64)]
    return out


def _combos() -> list[LabSpec]:
    """Both sides: KIVI pre-RoPE keys with per-channel bits, rotated Lloyd values, windows, sinks."""
    def k(b, **kw):
        return S(b, axis="channel", group=32, pre_rope=True, weight="q", alloc=True, **kw)

    def v(b):
        return S(b, "lloyd", rot=True)
    return [LabSpec(k(4), v(4)), LabSpec(k(4), v(4), window=32), LabSpec(k(4), v(4), window=32, sink=4),
            LabSpec(k(3), v(3), window=32), LabSpec(k(3), v(3), window=64), LabSpec(k(3), v(4), window=32),
            LabSpec(k(4), v(3), window=32), LabSpec(k(2), v(2), window=64),
            LabSpec(k(3, scale_bits=8), v(3), window=32)]


def _kq(b: float, group: int = 32, compact: bool = True) -> SideSpec:
    """KIVI keys before RoPE, per-channel bits (mean ``b``) by query-weighted allocation."""
    return S(b, axis="channel", group=group, pre_rope=True, weight="q", alloc=True, scale_bits=8 if compact else 16)


def _front(block: int) -> list[LabSpec]:
    """Candidates for the front: K bits x V bits x window at one block size, 4 sink tokens."""
    wins = (32, 64) if block == 32 else (16, 32)
    out = [LabSpec(_kq(kb, block), S(vb, "lloyd", rot=True), sink=4, window=w, block=block)
           for w in wins for kb in (2, 3, 4) for vb in (2, 3, 4) if abs(kb - vb) <= 1]
    if block == 32:
        out += [LabSpec(_kq(3), S(3, "lloyd", rot=True), sink=s, window=32) for s in (1, 8)]
        out += [LabSpec(_kq(4, compact=False), S(4, "lloyd", rot=True), sink=4, window=32)]
    return out


def _served() -> list:
    """Engine formats (kernels split formats) for the front, at block sizes 32 and 16."""
    out = []
    for kb, vb in ((2, 2), (2, 3), (3, 2), (3, 3), (3, 4), (4, 3), (4, 4)):
        out.append(Served(f"kivi{kb}+pre+alloc+q8/cb{vb}+rot@sink4@win32", 32))
    for kb, vb in ((2, 2), (2, 3), (3, 2), (3, 3), (4, 4)):
        out.append(Served(f"kivi{kb}+pre+alloc+q8/cb{vb}+rot@sink4@win16", 16))
    out += [Served("kivi3+pre+alloc+q8/cb3+rot@win32", 32), Served("kivi3+pre+alloc+q8/cb3+rot", 32),
            Served("kivi4+pre+alloc+q8/cb4+rot", 32), Served("kivi4+pre+alloc/cb4+rot@sink4@win32", 32)]
    return out


FRONT = ["kivi4+pre+alloc+q8/cb4+rot@sink4@win32", "kivi4+pre+alloc+q8/cb3+rot@sink4@win32",
         "kivi3+pre+alloc+q8/cb4+rot@sink4@win32", "kivi3+pre+alloc+q8/cb3+rot@sink4@win32",
         "kivi3+pre+alloc+q8/cb2+rot@sink4@win32", "kivi2+pre+alloc+q8/cb3+rot@sink4@win32",
         "kivi2+pre+alloc+q8/cb2+rot@sink4@win32"]


def _served_fractional() -> list:
    """A fractional key mean served (``kivi2.5``: half a bit more per key than ``kvq2``), beside
    ``kvq2`` and ``kvq32`` in the same run."""
    return [Served(f"kivi{kb}+pre+alloc+q8/cb2+rot@sink4@win32", 32) for kb in ("2", "2.5", "3")]


def _served_rows() -> list:
    """The lab's <= 3.0-bit format served (`stage_plain`'s symmetric rows): 2.5-bit keys, a 64-token
    window whose key rows are 8-bit and value rows 6-bit codes, the sink's rows coded alike."""
    return [Served("kvq25", 32)]


def _front_full() -> list:
    """The front (engine formats at block 32) and the study's references, for the full protocols."""
    from paged.quant.schemes import parse_scheme
    return [Served(f, 32) for f in FRONT] + [parse_scheme(n) for n in ("int8", "kivi_g32/int4", "int4")]


def _decomp() -> list:
    """K alone and V alone (the other side fp16) of front formats: which side's error dominates."""
    out = []
    for kb, vb in ((2, 2), (3, 3), (4, 4)):
        out += [Served(f"kivi{kb}+pre+alloc+q8/fp16@sink4@win32", 32), Served(f"fp16/cb{vb}+rot@sink4@win32", 32)]
    return out


def _mixed() -> list:
    """Mixed precision by layer sensitivity (lab formats, K 3-bit KIVI + V 3-bit codebook, sink 4,
    window 32): one-layer-at-a-time KLD of ``kivi_g32/int4`` on the calibration text ranks the
    layers; the 6 most sensitive get 4/4 bits, the 6 least 2/2, the mean stays 3."""
    from paged.quant.calibration import calibration_text
    from paged.quant.diagnostics import layer_sensitivity
    lm = load()  # loaded outside inference mode (layer_sensitivity runs under it)
    sens = layer_sensitivity(lm, ["kivi_g32/int4"], texts={"calibration": calibration_text()})
    order = sens.sort_values("kld_mean", ascending=False).layer.tolist()
    print("layer sensitivity (calibration text, most first):", order, flush=True)

    def k(b):
        return S(b, axis="channel", group=32, pre_rope=True, weight="q", alloc=True, scale_bits=8)

    def v(b):
        return S(b, "lloyd", rot=True)
    uniform = LabSpec(k(3), v(3), sink=4, window=32, label="lab k3/v3 @sink4@win32 (uniform)")
    layers = tuple((i, k(4), v(4)) for i in order[:6]) + tuple((i, k(2), v(2)) for i in order[-6:])
    mixed = LabSpec(k(3), v(3), sink=4, window=32, layers=layers,
                    label="lab k3/v3 @sink4@win32, 6 layers 4/4, 6 layers 2/2")
    return [uniform, mixed]


def _frontier() -> list[LabSpec]:
    """<= 3 bits (issue 29): kvq2 in the lab (KIVI 2-bit pre-RoPE keys, per-channel bits, 8-bit
    scale codes; 2-bit rotated codebook values; sink 4, window 32) and the new switches on its keys:
    dense-and-sparse outliers (15 per 32 x 64 group and head, 0.73% of the keys: 0.198 bits, the
    most that keeps the mean <= 3.0), per-head allocation, both; QJL's 1-bit residual on 1-bit keys."""
    v = S(2, "lloyd", rot=True)
    k = _kq(2)
    base = dict(axis="channel", group=32, pre_rope=True, weight="q", alloc=True, scale_bits=8)
    return [LabSpec(k, v, sink=4, window=32, label="lab kvq2"),
            LabSpec(S(2, **base, sparse=15), v, sink=4, window=32),
            LabSpec(S(2, **base, alloc_heads=True), v, sink=4, window=32),
            LabSpec(S(2, **base, alloc_heads=True, sparse=15), v, sink=4, window=32),
            LabSpec(S(1, **base, qjl=64), v, sink=4, window=32)]


def _values_unwindowed() -> list[LabSpec]:
    """<= 3 bits by the values' window (issue 29): the fp16 staging rows (window and the unfilled
    block) cost 0.5 bits per value on their side at 2,048 tokens. `kvq32` in the lab as it is;
    values read exact only in the sink (``v_window=0``), keys keeping the window (3.15 bits); and
    the keys at a 2.7-bit mean of alloc's per-channel bits on top (3.00 bits)."""
    v = S(2, "lloyd", rot=True)
    return [LabSpec(_kq(3), v, sink=4, window=32, label="lab kvq32")] + [
        LabSpec(_kq(b), v, sink=4, window=32, v_window=0) for b in (3, 2.7)]


def _keys_fractional() -> list[LabSpec]:
    """<= 3 bits by the keys' codes (issue 29), both windows kept: `kvq32`'s keys at a fractional
    mean of alloc's per-channel bits, 2.2 (3.00 bits) and 2.5 (3.15 bits); and 2.3-bit keys with a
    16-token values' window (2.99 bits)."""
    v = S(2, "lloyd", rot=True)
    return [LabSpec(_kq(2.2), v, sink=4, window=32), LabSpec(_kq(2.5), v, sink=4, window=32),
            LabSpec(_kq(2.3), v, sink=4, window=32, v_window=16)]


def _values_staged() -> list[LabSpec]:
    """<= 3 bits by the values' window rows (issue 29): kept as finer codes instead of fp16 (the
    sink stays fp16), the bits saved given to the keys' fractional mean. `kvq32`'s keys with the
    window's values in 4-bit codebook codes (the stage's own cost); then at 3.00 bits: window
    values at 4, 3 and 8 bits, keys at 2.55, 2.6 and 2.43."""
    v = S(2, "lloyd", rot=True)

    def cb(b):
        return S(b, "lloyd", rot=True)
    return [LabSpec(_kq(3), v, sink=4, window=32, v_stage=cb(4)),
            LabSpec(_kq(2.55), v, sink=4, window=32, v_stage=cb(4)),
            LabSpec(_kq(2.6), v, sink=4, window=32, v_stage=cb(3)),
            LabSpec(_kq(2.43), v, sink=4, window=32, v_stage=S(8, group=64))]


def _both_staged() -> list[LabSpec]:
    """<= 3 bits by both windows' rows as codes (issue 29): the keys' window rows per token before
    RoPE and rotated, the values' as they are, in uniform codes (fp16 scale and zero per 64 values; the sink stays
    fp16), the keys' fractional mean taking what is saved: 8-bit rows on both sides (keys 2.67),
    6-bit rows on both (keys 2.79), 6-bit value rows alone (keys 2.5); all at 3.00 bits."""
    v = S(2, "lloyd", rot=True)

    def rows(b, side):
        return S(b, group=64, pre_rope=side == "k", rot=side == "k")
    return [LabSpec(_kq(2.67), v, sink=4, window=32, k_stage=rows(8, "k"), v_stage=rows(8, "v")),
            LabSpec(_kq(2.79), v, sink=4, window=32, k_stage=rows(6, "k"), v_stage=rows(6, "v")),
            LabSpec(_kq(2.5), v, sink=4, window=32, v_stage=rows(6, "v"))]


def _wider_staged() -> list[LabSpec]:
    """`kvstage`'s 8-bit window rows on both sides over wider windows (64 and 128 tokens), the keys'
    fractional mean paying for them (2.4 and 1.87 bits): all at 3.00 bits."""
    stages = dict(k_stage=S(8, group=64, pre_rope=True, rot=True), v_stage=S(8, group=64))
    return [LabSpec(_kq(b), S(2, "lloyd", rot=True), sink=4, window=w, **stages)
            for w, b in ((64, 2.4), (128, 1.87))]


def _tuned_staged() -> list[LabSpec]:
    """Around `kvstage_wide`'s 64-token window: a 48-token window (keys 2.53), and the 64-token
    window with the values' rows in 6 bits (keys 2.49): all at 3.00 bits."""
    k_rows, v = S(8, group=64, pre_rope=True, rot=True), S(2, "lloyd", rot=True)
    return [LabSpec(_kq(2.53), v, sink=4, window=48, k_stage=k_rows, v_stage=S(8, group=64)),
            LabSpec(_kq(2.49), v, sink=4, window=64, k_stage=k_rows, v_stage=S(6, group=64))]


def _staged_best() -> list[LabSpec]:
    """The best <= 3.0-bit lab format (`kvstage_tune`'s second) beside the lab's `kvq2` and
    `kvq32`, for side-by-side runs (``--greedy``)."""
    return [_frontier()[0], _values_unwindowed()[0], _tuned_staged()[1]]


def _stage_cost() -> list[LabSpec]:
    """What 8-bit window rows cost against fp16 ones: `kvq32` in the lab (3-bit keys) with its
    window's key and value rows in 8-bit codes (compare `vwin`'s lab kvq32)."""
    return [LabSpec(_kq(3), S(2, "lloyd", rot=True), sink=4, window=32,
                    k_stage=S(8, group=64, pre_rope=True, rot=True), v_stage=S(8, group=64))]


def _stage_plain() -> list[LabSpec]:
    """`staged_best`'s window rows in the forms a kernel reads most simply (what serving it would
    take): key rows after RoPE, not rotated (8-bit uniform, then 8-bit symmetric), value rows 6-bit
    symmetric; fp16 absmax (and zero) per 64 values, keys 2.49 bits as there."""
    v = S(2, "lloyd", rot=True)
    return [LabSpec(_kq(2.49), v, sink=4, window=64, k_stage=S(8, group=64), v_stage=S(6, group=64)),
            LabSpec(_kq(2.49), v, sink=4, window=64, k_stage=S(8, "sym", group=64),
                    v_stage=S(6, "sym", group=64))]


JOBS = {
    "stage_plain": _stage_plain,
    "kvstage": _both_staged,
    "stage_cost": _stage_cost,
    "staged_best": _staged_best,
    "kvstage_tune": _tuned_staged,
    "kvstage_wide": _wider_staged,
    "vstage": _values_staged,
    "kfrac": _keys_fractional,
    "vwin": _values_unwindowed,
    "frontier": _frontier,
    "mixed": _mixed,
    "front": _front_full, "decomp": _decomp,
    "served": _served, "served_frac": _served_fractional, "served_rows": _served_rows,
    "front32": lambda: _front(32), "front16": lambda: _front(16),
    "combo": _combos,
    "kivi": _kivi,
    "k4": lambda: _k_techniques(4), "k3": lambda: _k_techniques(3), "k2": lambda: _k_techniques(2),
    "v4": lambda: _v_techniques(4), "v3": lambda: _v_techniques(3), "v2": lambda: _v_techniques(2),
}


def report(paths: list[str], source: str = "all") -> str:
    """A markdown table of ablation CSVs (one row per spec and part, pooled over ``source``)."""
    import pandas as pd
    df = pd.concat([pd.read_csv(p).assign(csv=Path(p).stem.removeprefix("quant_ablation_")) for p in paths])
    df = df[df.source == source].drop_duplicates(["format", "part", "protocol"], keep="last")
    lines = ["| job | format | part | K bits | V bits | mean bits | KLD | ± SE (tokens) | ± SE (chunks) "
             "| same top-1 % |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for _, r in df.iterrows():
        if "|bs" in r.format:  # engine formats: bits from the format table (the current staging count)
            from paged.quant.split_cache import served_bits
            name, bs = r.format.split("|bs")
            r.bits_k, r.bits_v, r.bits = served_bits(name, int(bs), 3, 64)
        lines.append(f"| {r.csv} | `{r.format}` | {r.part} | {r.bits_k:.3g} | {r.bits_v:.3g} | {r.bits:.3g} | "
                     f"{r.kld_mean:.4g} | {r.kld_se:.2g} | {r.kld_se_chunks:.2g} | {r.same_top1_pct:.2f} |")
    return "\n".join(lines)


def first_divergences(lm, specs: list[LabSpec], cal, prompts: int = 4, tokens: int = 32) -> dict[str, list[int]]:
    """Per spec, the first greedy token (of ``tokens``) where its lab cache parts from fp32's, on
    ``prompts`` 128-token windows of each evaluation text (``benchmarks/quant_greedy.py``'s
    prompts); ``tokens`` means identical throughout. All caches of a prompt decode in one batch."""
    from paged.quant.lab import LabCache
    from paged.quant.runs import chunk_logits, greedy_many, greedy_prompts
    out: dict[str, list[int]] = {s.name: [] for s in specs}
    for prompt in greedy_prompts(lm.tokenizer, prompts):
        caches = [LabCache(s, lm.model, cal) for s in [LabSpec()] + specs]  # LabSpec(): fp32
        first = [int(chunk_logits(lm.model, prompt, c, slice(-1, None)).argmax(-1)) for c in caches]
        ref, *runs = greedy_many(lm.model, caches, first, len(prompt), tokens)
        for s, run in zip(specs, runs):
            out[s.name].append(next((t for t, (a, b) in enumerate(zip(ref, run)) if a != b), tokens))
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "report":  # python benchmarks/quant_ablation.py report CSV... [--source S]
        args = sys.argv[2:]
        src = args[args.index("--source") + 1] if "--source" in args else "all"
        print(report([a for a in args if a.endswith(".csv")], src))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("job", choices=sorted(JOBS))
    ap.add_argument("--protocol", default="screen", choices=sorted(ablation.PROTOCOLS))
    ap.add_argument("--decompose", action="store_true", help="also K-only and V-only rows of each spec")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--greedy", type=int, default=0, metavar="TOKENS",
                    help="instead of the KLD: each spec's greedy first divergence from fp32 over TOKENS")
    args = ap.parse_args()
    lm = load()
    t = time.time()
    cal = calibration.collect(lm)
    print(f"calibration: {cal.num_tokens} tokens of {cal.source} in {time.time() - t:.0f} s", flush=True)
    if args.greedy:
        import statistics
        print(f"| spec | median first divergence (of {args.greedy}) | mean | identical to the end |")
        print("| --- | --- | --- | --- |")
        for name, d in first_divergences(lm, JOBS[args.job](), cal, tokens=args.greedy).items():
            same = sum(x == args.greedy for x in d) / len(d)
            print(f"| `{name}` | {statistics.median(d):.0f} | {statistics.mean(d):.1f} | {100 * same:.0f}% |")
        return
    ev = ablation.Evaluator(lm, ablation.eval_chunks(lm, args.protocol), cal)
    csv = args.csv or f"reports/quant_ablation_{args.job}_{args.protocol}.csv"
    Path(csv).parent.mkdir(parents=True, exist_ok=True)
    ev.table(JOBS[args.job](), csv, decompose=args.decompose, job=args.job, protocol=args.protocol)


if __name__ == "__main__":
    main()
