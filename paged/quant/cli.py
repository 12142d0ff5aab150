"""``python -m paged quant``: the KV quantization study from the shell (CSV / JSON out)."""
from __future__ import annotations

import argparse
import json
import os
import sys

_SHOW = ["context_length", "source", "format", "bits_per_value", "tokens_per_gib", "kld_mean", "kld_p99",
         "delta_nll", "same_top1_pct", "first_div_median"]


def add_parser(sub) -> None:
    q = sub.add_parser("quant", allow_abbrev=False, help="KV quantization error (llama-perplexity's KL protocol) per format")
    q.add_argument("--model", default="smollm2", help="embedded default, a .gguf file or an HF directory")
    q.add_argument("--formats", default=None,
                   help="comma-separated, e.g. int8,int4,int8/int4,int4_g64+rot,int4_kivi (default: all)")
    q.add_argument("--ctx", default="512", help="context lengths, comma-separated (e.g. 512,2048)")
    q.add_argument("--text", action="append", default=None, metavar="FILE",
                   help="score this text file (repeatable) instead of the shipped texts")
    q.add_argument("--max-chunks", type=int, default=2, help="chunks per text and context (0 = all)")
    q.add_argument("--divergence-tokens", type=int, default=32, help="greedy horizon (0 skips)")
    q.add_argument("--csv", default=None, help="write the full table as CSV")
    q.add_argument("--json", action="store_true", help="print the table as JSON records")
    q.add_argument("--no-progress", action="store_true")
    q.set_defaults(func=cmd_quant)
    c = sub.add_parser("quant-calibrate", allow_abbrev=False, help="fit the per-layer tables of split KV formats on the calibration text")
    c.add_argument("--model", default="smollm2", help="embedded default, a .gguf file or an HF directory")
    c.add_argument("--formats", required=True,
                   help="split formats, comma-separated, e.g. 'kivi3+pre+alloc+q8/cb3+rot@sink4@win32'")
    c.add_argument("--block-size", default="32", help="block sizes the key widths are fitted for (e.g. 16,32)")
    c.add_argument("--out", required=True, help="the artefact file (safetensors) to write")
    c.add_argument("--update", action="store_true",
                   help="keep the entries --out already holds (same model and calibration) and add the new ones")
    c.set_defaults(func=cmd_calibrate)


def cmd_quant(args: argparse.Namespace) -> int:
    from pathlib import Path

    from paged.errors import ConfigError
    from paged.quant import study
    try:
        ctxs = tuple(int(c) for c in str(args.ctx).split(",") if c.strip())
    except ValueError:
        raise ConfigError(f"--ctx takes integers separated by commas, e.g. 512,2048; got {args.ctx!r}") from None
    texts = None
    if args.text:
        texts = {}
        for f in args.text:
            p = Path(f)
            if not p.is_file():
                raise ConfigError(f"--text {f}: no such file")
            texts[p.stem] = p.read_text()
    formats = [f for f in args.formats.split(",") if f.strip()] if args.formats else None
    df = study(args.model, formats=formats, texts=texts, context_lengths=ctxs,
               max_chunks=args.max_chunks or None, divergence_tokens=args.divergence_tokens,
               progress=not args.no_progress)
    if args.csv:
        df.to_csv(args.csv, index=False)
    if args.json:
        json.dump(df.drop(columns=["first_div"]).to_dict(orient="records"), sys.stdout, default=str)
        print()
    else:
        print(df[df.source == "all"][_SHOW].to_string(index=False, float_format=lambda x: f"{x:.4g}"))
        if args.csv:
            print(f"\n{len(df)} rows -> {args.csv}")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from paged.errors import ConfigError
    from paged.quant.artefact import fingerprint, fit
    from paged.quant.calibration import collect, model_tag
    from paged.quant.runs import load
    try:
        sizes = [int(b) for b in str(args.block_size).split(",") if b.strip()]
    except ValueError:
        raise ConfigError(f"--block-size takes integers separated by commas, got {args.block_size!r}") from None
    from kernels.errors import KVFormatError
    from kernels.split_artefact import KVArtefact
    old, lm = None, load(args.model)
    if args.update and os.path.exists(args.out):
        try:  # before the calibration pass: a file that is not an artefact, or another model's, is refused at once
            old = KVArtefact.load(args.out)
            old.check_model(model_tag(lm.config), fingerprint(lm.model))
        except KVFormatError as e:
            raise ConfigError(f"--update {args.out}: {e}") from None
    art = fit(collect(lm), [f for f in args.formats.split(",") if f.strip()], sizes, lm.model)
    if old is not None:
        if (old.source, old.num_tokens) != (art.source, art.num_tokens):
            raise ConfigError(f"{args.out} was fitted on {old.num_tokens} tokens of {old.source!r}, this run on "
                              f"{art.num_tokens} of {art.source!r}; write a new file instead of --update")
        art.entries = {**art.entries, **old.entries}  # what the file holds stays as it is
    art.save(args.out)
    print(f"{args.out}: {art.describe()}")
    return 0
