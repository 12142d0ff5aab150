"""What the quantization study fits comes from data/text/calibration.txt and nothing else, and that
text is held out from every evaluation text (no shared line of 8+ words, no shared 8-word run
inside what calibration reads)."""
from __future__ import annotations

import re

import torch

from paged.quant import calibration as C
from paged.quant.text import SOURCES, load_texts, text_dir

N = 8  # words: a shared run this long is copied text, not a common phrase

# MPL-2.0 (in calibration.txt) reuses a few clauses of Apache-2.0 and GPL-3 (in licenses.txt): its
# definition of "control" and its termination and liability wording. These runs, and only these, are
# shared; none lies in a chunk that collect() reads by default (checked below).
KNOWN_LICENCE_RUNS = {
    "the power, direct or indirect, to cause the direction or management of such entity, whether by contract or "
    "otherwise, or",
    "by some reasonable means prior to 60 days after",
    "by some reasonable means, this is the first time",
    "special, incidental, or consequential damages of any character",
    "goodwill, work stoppage, computer failure or malfunction, or any",
}


def _shared_runs(text: str, other: str) -> list[tuple[int, int, str]]:
    """Maximal runs of ``text`` made of N-word windows that also occur in ``other``:
    (first char, end char, the run's words)."""
    words = list(re.finditer(r"\S+", text))
    grams = set(zip(*(re.findall(r"\S+", other)[i:] for i in range(N))))
    hits = [i for i in range(len(words) - N + 1) if tuple(w.group() for w in words[i:i + N]) in grams]
    runs: list[list[int]] = []
    for i in hits:
        if runs and i <= runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return [(words[a].start(), words[b + N - 1].end(), " ".join(w.group() for w in words[a:b + N])) for a, b in runs]


def test_collect_reads_the_calibration_text_and_feeds_its_chunks(smollm2, monkeypatch):
    """collect() tokenizes calibration.txt (not an evaluation text) and runs the model on chunks of it."""
    encoded: list[str] = []
    fed: list[list[int]] = []
    encode, forward = smollm2.tokenizer.encode, smollm2.model.forward

    def spy_encode(text, *a, **k):
        encoded.append(text)
        return encode(text, *a, **k)

    def spy_forward(x, *a, **k):
        fed.append(x.tolist())
        return forward(x, *a, **k)
    monkeypatch.setattr(smollm2.tokenizer, "encode", spy_encode)
    monkeypatch.setattr(smollm2.model, "forward", spy_forward)
    calib = C.collect(smollm2, context_length=32, max_chunks=2)
    text = (text_dir() / C.CALIBRATION_FILE).read_text()
    assert encoded == [text]
    ids = encode(text, add_special_tokens=False)
    last = len(ids) // 32 - 1
    assert fed == [ids[:32], ids[last * 32:(last + 1) * 32]]  # the first and the last whole chunk
    assert calib.source == C.CALIBRATION_FILE and calib.num_tokens == 64
    assert all(k.shape[0] == 64 for k in calib.v) and all(torch.isfinite(k).all() for k in calib.k_post)


def test_the_calibration_text_shares_no_long_line_with_an_evaluation_text():
    cal = {ln.strip() for ln in C.calibration_text().splitlines() if len(ln.split()) >= N}
    for source, text in load_texts().items():
        shared = cal & {ln.strip() for ln in text.splitlines()}
        assert not shared, f"{SOURCES[source]} shares lines with calibration.txt: {sorted(shared)[:3]}"


def test_the_calibration_text_shares_no_8_word_run_with_an_evaluation_text_where_it_is_read(smollm2):
    cal = C.calibration_text()
    runs = {source: _shared_runs(cal, text) for source, text in load_texts().items()}
    assert runs["kjv"] == [] and runs["python"] == []
    assert {r for _, _, r in runs["licenses"]} == KNOWN_LICENCE_RUNS
    # the default chunks collect() reads (C.collect's rule, context 512, 8 chunks) miss every known run
    tok = smollm2.tokenizer
    n = len(tok.encode(cal, add_special_tokens=False)) // 512
    picks = sorted({round(i * (n - 1) / 7) for i in range(8)})
    for start, end, run in runs["licenses"]:
        first = len(tok.encode(cal[:start], add_special_tokens=False)) // 512
        last = len(tok.encode(cal[:end], add_special_tokens=False)) // 512
        assert not {first, last} & set(picks), f"calibration chunk {first} holds evaluation text {run!r}"
