"""Rebuild the held-out texts of data/text/ from local Debian packages (nothing is downloaded).

Run as root on Debian 12 after ``apt-get install -y bible-kjv-text bible-kjv`` (for ``/usr/bin/bible``);
Python 3.11's standard library and ``/usr/share/common-licenses`` are already there. Output is
deterministic; see README.md for provenance and licences.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

HERE = Path(__file__).parent
BOOKS = ["Ruth1:1-4:22", "Esther1:1-10:3", "Jonah1:1-4:11", "Eccl1:1-12:14", "Mark1:1-16:20"]
STDLIB = ["textwrap.py", "heapq.py", "fractions.py", "statistics.py", "shlex.py", "graphlib.py", "string.py"]
LICENCES = ["GPL-3", "Apache-2.0"]  # the order of the llama.cpp run quoted in issue 10
# Calibration text (codebooks, per-channel statistics, bit allocation of the quantization study):
# disjoint from the three evaluation texts above: other KJV books, other stdlib modules, other licences.
CALIB_BOOKS = ["Gen1:1-11:32"]
CALIB_STDLIB = ["difflib.py", "calendar.py"]
CALIB_LICENCES = ["MPL-2.0", "Artistic"]


def kjv(books: list[str] = BOOKS) -> str:
    """Chapters as paragraphs: verse numbers dropped, verse lines joined."""
    out = []
    for spec in books:
        raw = subprocess.run(["bible", spec], capture_output=True, text=True, check=True).stdout
        for block in re.split(r"\n(?=\S[^\n]* \d+\n)", raw.strip()):
            head, _, body = block.strip().partition("\n")
            verses = re.split(r"\n\s*\d+ ", "\n" + body.strip())
            text = " ".join(" ".join(v.split()) for v in verses if v.strip())
            out.append(f"{head.strip()}\n\n{text}\n")
    return "\n".join(out)


def main() -> None:
    (HERE / "kjv_prose.txt").write_text(kjv())
    lib = Path("/usr/lib/python3.11")
    (HERE / "python_stdlib.txt").write_text("".join(f"# ---- Lib/{n} ----\n{(lib / n).read_text()}" for n in STDLIB))
    lic = Path("/usr/share/common-licenses")
    (HERE / "licenses.txt").write_text("".join((lic / n).read_text() for n in LICENCES))
    (HERE / "calibration.txt").write_text(
        kjv(CALIB_BOOKS) + "".join(f"# ---- Lib/{n} ----\n{(lib / n).read_text()}" for n in CALIB_STDLIB)
        + "".join((lic / n).read_text() for n in CALIB_LICENCES))


if __name__ == "__main__":
    main()
