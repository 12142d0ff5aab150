"""Our KV formats beside llama.cpp's cache types on the same GGUF, text, chunks and tokens.

    python benchmarks/quant_vs_llamacpp.py --part ours  [--chunks 19] [--csv reports/quant_vs_llamacpp_ours.csv]
    python benchmarks/quant_vs_llamacpp.py --part llama --rotation on  --llama-site /tmp/venv-llamacpp/lib/python3.11/site-packages
    python benchmarks/quant_vs_llamacpp.py --part llama --rotation off --llama-site ...
    python benchmarks/quant_vs_llamacpp.py --part table   # the side-by-side table from the CSVs
    python benchmarks/quant_vs_llamacpp.py --part publish # those CSVs -> data/precomputed/05_front, 05_llamacpp

Our split formats (the front) on the same 19 chunks come from ``benchmarks/quant_ablation.py front
--protocol lic19`` (``reports/quant_ablation_front_lic19.csv``); ``--part ours`` adds the study's
earlier formats (int8, int4, KIVI over 32 tokens, int8/int4) on the same chunks.

Protocol (llama-perplexity's): the GPL-3 + Apache-2.0 text of ``data/text/licenses.txt`` as
token ids from our tokenizer, chunks of ``ctx`` tokens, the cache cleared per chunk, the second
half of each chunk scored; KLD against each tool's own base in the same process (ours: an fp32
cache; llama.cpp: its default f16 cache).

llama.cpp (``llama-cpp-python``, built from source: ``CMAKE_ARGS=-DGGML_NATIVE=ON pip install
llama-cpp-python==0.3.36`` in a scratch venv, ~8-20 min on 2 cores; ``--llama-site`` puts its
site-packages at the *end* of ``sys.path``) runs one ``Llama`` per cache type with
``flash_attn=True`` (needed for a quantized V cache). ``--rotation on`` is llama.cpp's default
(PR #21038: Q/K/V rotated by a Hadamard transform when the cache is quantized); ``--rotation
off`` sets ``LLAMA_ATTN_ROT_DISABLE=1`` before llama.cpp is loaded. Every row says which.
Without ``llama_cpp`` the table uses the numbers measured before (ANCHORS.md), labelled ``quoted``.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# `python benchmarks/quant_vs_llamacpp.py` puts benchmarks/ first on sys.path, where
# benchmarks/kernels.py would shadow the `kernels` package
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, str(Path(_HERE).parent))

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402  (the llama-worker part imports neither torch nor paged)

LLAMA_TYPES = ["q8_0/q8_0", "q5_1/q5_1", "q4_1/q4_1", "q4_0/q4_0", "q8_0/q4_0"]
LLAMA_BITS = {"q8_0": 8.5, "q5_1": 6.0, "q4_1": 5.0, "q4_0": 4.5, "f16": 16.0}
# measured before (llama-cpp-python 0.3.36, same GGUF, 19 chunks; ANCHORS.md): rotated / unrotated
QUOTED = {"q8_0/q8_0": (0.00471, 0.00566), "q5_1/q5_1": (0.0213, 0.0369), "q4_1/q4_1": (0.0661, 0.1277),
          "q4_0/q4_0": (0.0738, None)}
# ours: the study's earlier formats and the split formats of the front (engine formats at block 32)
OURS_LAB = ["int8", "int4", "kivi_g32/int4", "int8/int4_g64"]
FRONT_CSV = "reports/quant_ablation_front_lic19.csv"


def licence_ids():
    from paged import quant
    from paged.quant.runs import load
    lm = load()
    return lm, lm.tokenizer.encode(quant.load_texts(["licenses"])["licenses"], add_special_tokens=False)


def ours(ctx: int, chunks: int) -> pd.DataFrame:
    """The study's earlier formats (fp32 base) on the licence chunks."""
    from paged.quant import study
    lm, ids = licence_ids()
    n = min(chunks, len(ids) // ctx)
    old = study(lm, formats=OURS_LAB, texts={"licenses": ids}, context_lengths=(ctx,), max_chunks=n,
                divergence_tokens=0, progress=False)
    old = old[old.source == "all"]
    rows = [{"tool": "ours", "format": r["format"], "bits_per_value": r["bits_per_value"], "kld_mean": r["kld_mean"],
             "kld_se": r["kld_se"], "kld_p99": r["kld_p99"], "same_top1_pct": r["same_top1_pct"],
             "delta_nll": r["delta_nll"], "n_chunks": n, "rotation": "n/a"} for r in old.to_dict(orient="records")]
    return pd.DataFrame(rows)


def llama(ctx: int, chunks: int, rotation: str, site: str | None) -> pd.DataFrame:
    """llama.cpp's cache types; KLD against its f16 cache. llama.cpp runs in a worker process
    without torch (two OpenMP runtimes in one process crash llama.cpp's decode), writing each
    chunk's scored logits per cache type to a scratch file that this process scores and deletes."""
    import subprocess
    import tempfile

    import torch
    from paged.models import embedded_gguf_path
    from paged.quant.metrics import TokenStats, summarize, token_stats
    _, ids = licence_ids()
    n = min(chunks, len(ids) // ctx)
    with tempfile.TemporaryDirectory(prefix="llamacpp-") as tmp:
        np.save(f"{tmp}/ids.npy", np.asarray(ids[:n * ctx], dtype=np.int64))
        env = dict(os.environ, OMP_NUM_THREADS="1")
        if rotation == "off":
            env["LLAMA_ATTN_ROT_DISABLE"] = "1"
        else:
            env.pop("LLAMA_ATTN_ROT_DISABLE", None)
        cmd = [sys.executable, __file__, "--part", "llama-worker", "--ctx", str(ctx), "--chunks", str(n),
               "--gguf", embedded_gguf_path(), "--out", tmp] + (["--llama-site", site] if site else [])
        subprocess.run(cmd, env=env, check=True)
        version = Path(f"{tmp}/version.txt").read_text().strip()
        stats = {kv: TokenStats() for kv in LLAMA_TYPES}
        for c in range(n):
            arr = np.load(f"{tmp}/chunk{c}.npy")  # [1 + types, ctx // 2 - 1, vocab]: base (f16) first
            tgt = torch.tensor(ids[c * ctx + ctx // 2 + 1:(c + 1) * ctx])
            for i, kv in enumerate(LLAMA_TYPES):
                stats[kv].add(token_stats(torch.from_numpy(arr[0]), torch.from_numpy(arr[i + 1]), tgt))
            os.remove(f"{tmp}/chunk{c}.npy")
    rows = []
    for kv in LLAMA_TYPES:
        s = summarize(stats[kv])
        k, v = kv.split("/")
        rows.append({"tool": f"llama.cpp {version}", "format": kv,
                     "bits_per_value": (LLAMA_BITS[k] + LLAMA_BITS[v]) / 2, "kld_mean": s["kld_mean"],
                     "kld_se": s["kld_se"], "kld_p99": s["kld_p99"], "same_top1_pct": s["same_top1_pct"],
                     "delta_nll": s["delta_nll"], "n_chunks": n, "rotation": rotation})
        print(rows[-1], flush=True)
    return pd.DataFrame(rows)


def llama_worker(ctx: int, n: int, gguf: str, out: str) -> None:
    """In a process without torch: per chunk, the scored logits of the f16 base and each type."""
    import llama_cpp
    import llama_cpp.llama_cpp as low
    defaults = low.llama_model_default_params

    def no_repacking():   # as quant_cost_llama: the AMX weight repacking crashes the prefill on AMX CPUs
        params = defaults()
        params.use_extra_bufts = False
        return params
    low.llama_model_default_params = no_repacking   # what Llama() builds its model parameters from
    ids = np.load(f"{out}/ids.npy").tolist()
    types = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q5_1": llama_cpp.GGML_TYPE_Q5_1,
             "q4_1": llama_cpp.GGML_TYPE_Q4_1, "q4_0": llama_cpp.GGML_TYPE_Q4_0}
    kinds = ["f16/f16"] + LLAMA_TYPES
    llms = {}
    for kv in kinds:
        k, v = kv.split("/")
        llms[kv] = llama_cpp.Llama(gguf, n_ctx=ctx, n_batch=ctx, logits_all=True, flash_attn=True,
                                   type_k=types[k], type_v=types[v], verbose=False, n_threads=1)
    Path(f"{out}/version.txt").write_text(llama_cpp.__version__)
    for c in range(n):
        rows = []
        for kv in kinds:
            llm = llms[kv]
            llm.reset()
            llm.eval(ids[c * ctx:(c + 1) * ctx])
            rows.append(np.array(llm.scores[ctx // 2:ctx - 1], dtype=np.float32))
        np.save(f"{out}/chunk{c}.npy", np.stack(rows))
        print(f"llama.cpp chunk {c + 1}/{n}", flush=True)


def table(paths: list[str]) -> str:
    """Markdown: every row of the given CSVs by bits, with llama.cpp's rotated and unrotated rows."""
    frames = [pd.read_csv(p, keep_default_na=False, na_values=[""]) for p in paths if Path(p).is_file()]
    if Path(FRONT_CSV).is_file():
        f = pd.read_csv(FRONT_CSV)
        f = f[(f.source == "all") & (f.part == "both") & f.format.str.contains("|bs", regex=False)]
        frames.append(pd.DataFrame({"tool": "ours (engine format, block 32)",
                                    "format": f.format.str.replace("|bs32", "", regex=False),
                                    "bits_per_value": f.bits, "kld_mean": f.kld_mean, "kld_se": f.kld_se,
                                    "kld_p99": f.kld_p99, "same_top1_pct": f.same_top1_pct, "n_chunks": f.n_chunks,
                                    "rotation": "n/a"}))
    if not any((f.tool.str.startswith("llama.cpp")).any() for f in frames):
        frames.append(pd.DataFrame([{"tool": "llama.cpp (quoted)", "format": kv, "bits_per_value":
                                     (LLAMA_BITS[kv.split('/')[0]] + LLAMA_BITS[kv.split('/')[1]]) / 2,
                                     "kld_mean": val, "rotation": rot}
                                    for kv, pair in QUOTED.items() for val, rot in zip(pair, ("on", "off"))
                                    if val is not None]))
    df = pd.concat(frames)
    df = df[df.format != "fp32"].sort_values(["bits_per_value", "kld_mean"], ascending=[False, True])
    lines = ["| tool | format | llama.cpp rotation | bits/value | KLD | ± SE | p99 | same top-1 % | chunks |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for _, r in df.iterrows():
        cell = lambda x, f: "–" if pd.isna(x) else f.format(x)  # noqa: E731
        lines.append(f"| {r.tool} | {r.format} | {r.get('rotation', 'n/a')} | {r.bits_per_value:.3g} | "
                     f"{cell(r.kld_mean, '{:.4g}')} | {cell(r.get('kld_se'), '{:.2g}')} | "
                     f"{cell(r.get('kld_p99'), '{:.3g}')} | {cell(r.get('same_top1_pct'), '{:.2f}')} | "
                     f"{cell(r.get('n_chunks'), '{:.0f}')} |")
    return "\n".join(lines)


PROTOCOL_CSVS = {p: [f"reports/quant_ablation_{job}_{p}.csv" for job in ("front", "served_rows")]
                 for p in ("lic19", "x512", "x2048")}
PROTOCOL_TEXT = {"lic19": "licences, 19 chunks of 512 (llama.cpp's protocol)", "x512": "kjv + python, 8 + 8 chunks of 512",
                 "x2048": "kjv + python, 2 + 2 chunks of 2,048"}


def publish() -> list[Path]:
    """Notebook 05's precomputed front: our served formats (front aliases, the study's earlier
    formats) on the three protocols, and llama.cpp's cache types with its rotation on and off."""
    from kernels.format_table import FRONT
    from paged.studies import precomputed
    alias = {f"{v}|bs32": k for k, v in FRONT.items()}
    rows = []
    for protocol, csvs in PROTOCOL_CSVS.items():
        f = pd.concat([pd.read_csv(c) for c in csvs], ignore_index=True)
        f = f[(f.source == "all") & (f.part == "both")]
        rows.append(pd.DataFrame({
            "format": f.format.map(lambda n: alias.get(n, n.replace("|bs32", ""))),
            "spelled": f.format.str.replace("|bs32", "", regex=False),
            "group": f.format.map(lambda n: "served front (kvq*)" if n in alias else
                                  "other split formats" if "|bs" in n else "earlier formats"),
            "protocol": protocol, "texts": PROTOCOL_TEXT[protocol], "ctx": f.ctx, "bits_k": f.bits_k,
            "bits_v": f.bits_v, "bits_per_value": f.bits, "kld_mean": f.kld_mean, "kld_se": f.kld_se,
            "kld_p99": f.kld_p99, "same_top1_pct": f.same_top1_pct, "n_chunks": f.n_chunks}))
    front = pd.concat(rows, ignore_index=True)
    front.attrs = {"made_by": [f"OMP_NUM_THREADS=1 python benchmarks/quant_ablation.py {job} --protocol {p}"
                               for job in ("front", "served_rows") for p in PROTOCOL_CSVS]
                   + ["python benchmarks/quant_vs_llamacpp.py --part publish"],
                   "base": "an fp32 cache, same model and tokens",
                   "calibration": "data/text/calibration.txt, disjoint from every evaluated text"}
    llama = pd.concat([pd.read_csv(f"reports/quant_vs_llamacpp_llama_{r}.csv") for r in ("on", "off")],
                      ignore_index=True)
    llama.attrs = {"made_by": [f"python benchmarks/quant_vs_llamacpp.py --part llama --rotation {r} --llama-site ..."
                               for r in ("on", "off")], "base": "llama.cpp's own f16 cache",
                   "protocol": PROTOCOL_TEXT["lic19"]}
    return precomputed.save("05", {"front": front, "llamacpp": llama})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["ours", "llama", "table", "publish", "llama-worker"], required=True)
    ap.add_argument("--gguf", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=19)
    ap.add_argument("--rotation", choices=["on", "off"], default="on",
                    help="llama.cpp's Hadamard rotation of Q/K/V: on (its default) or off (LLAMA_ATTN_ROT_DISABLE=1)")
    ap.add_argument("--llama-site", default=os.environ.get("LLAMA_CPP_SITE"),
                    help="site-packages holding llama_cpp (appended to sys.path)")
    ap.add_argument("--csv", default=None)
    args = ap.parse_args()
    os.makedirs("reports", exist_ok=True)
    if args.part == "table":
        print(table(["reports/quant_vs_llamacpp_ours.csv", "reports/quant_vs_llamacpp_llama_on.csv",
                     "reports/quant_vs_llamacpp_llama_off.csv"]))
        return
    if args.part == "publish":
        print("\n".join(f"-> {p}" for p in publish()))
        return
    if args.llama_site:
        sys.path.append(args.llama_site)
    if args.part == "llama-worker":
        llama_worker(args.ctx, args.chunks, args.gguf, args.out)
        return
    if args.part == "ours":
        df = ours(args.ctx, args.chunks)
        csv = args.csv or "reports/quant_vs_llamacpp_ours.csv"
    else:
        df = llama(args.ctx, args.chunks, args.rotation, args.llama_site)
        csv = args.csv or f"reports/quant_vs_llamacpp_llama_{args.rotation}.csv"
    df.to_csv(csv, index=False)
    print(df.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    print(f"-> {csv}")


if __name__ == "__main__":
    main()
