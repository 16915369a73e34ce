"""Architecture guards on proxies/ that can only tighten: no file over 600 lines, no code
repeated between GPT-2 and GPT-3 or between proxies/transformer and another package.

Today's offenders are listed with their current figures: an entry may shrink (the figure is
a ceiling), a new offender or a grown one fails, and an entry that no longer offends fails
too, asking to be deleted, so the lists only ever get shorter. (Imports are
tests/project/test_layering.py's business, not this file's.)
"""

from __future__ import annotations

import os
import re
import sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = os.path.join(ROOT, "proxies")
MAX_LINES = 600
RUN = 6  # identical consecutive lines that count as a repeat

# file (relative to proxies/) -> its line count when the guard came in: may only shrink.
LONG_FILES: dict[str, int] = {}

# (file, file) -> lines of the first that are in runs of RUN or more lines repeated in the
# second, when the guard came in: may only shrink.
REPEATS: dict[tuple[str, str], int] = {
    ("gpt2/proxy.py", "gpt3/proxy.py"): 12,  # the LAYERS and STAGES positionals
}


def python_files() -> list[str]:
    out = []
    for d, _, files in os.walk(PKG):
        out += [os.path.relpath(os.path.join(d, f), PKG) for f in files if f.endswith(".py")]
    return sorted(out)


def line_count(rel: str) -> int:
    with open(os.path.join(PKG, rel), encoding="utf-8") as f:
        return sum(1 for _ in f)


def test_no_file_over_600_lines():
    counts = {rel: line_count(rel) for rel in python_files()}
    long = {rel: n for rel, n in counts.items() if n > MAX_LINES}
    new = {rel: n for rel, n in long.items() if rel not in LONG_FILES}
    grown = {rel: (n, LONG_FILES[rel]) for rel, n in long.items() if n > LONG_FILES.get(rel, n)}
    fixed = sorted(rel for rel in LONG_FILES if counts.get(rel, 0) <= MAX_LINES)
    assert not new, f"over {MAX_LINES} lines (split the module): {new}"
    assert not grown, f"allowlisted long files grew (lines now, allowed): {grown}"
    assert not fixed, f"no longer over {MAX_LINES} lines: delete from LONG_FILES: {fixed}"


# -- repeated code ---------------------------------------------------------------------------
# A line is compared with its whitespace collapsed. Not compared: blank lines, comment-only
# lines and imports (two modules rightly import the same names), and lines of only closing
# brackets, which would otherwise join two short repeats into one. Docstrings are compared:
# prose copied between modules drifts like code does.

_SKIP = re.compile(r"^(#.*|import .*|from \S+ import .*|[)\]}]+,?:?)$")


def significant_lines(rel: str) -> list[str]:
    with open(os.path.join(PKG, rel), encoding="utf-8") as f:
        lines = [" ".join(line.split()) for line in f]
    out, in_import = [], False
    for line in lines:
        if in_import:  # the rest of a parenthesised import
            in_import = not line.endswith(")")
            continue
        if line.startswith(("from ", "import ")) and line.endswith("("):
            in_import = True
            continue
        if line and not _SKIP.match(line):
            out.append(line)
    return out


def windows(rel: str) -> dict[tuple[str, ...], list[int]]:
    lines = significant_lines(rel)
    out: dict[tuple[str, ...], list[int]] = defaultdict(list)
    for i in range(len(lines) - RUN + 1):
        out[tuple(lines[i : i + RUN])].append(i)
    return out


def repeated_lines(a: str, b: str) -> int:
    """Lines of `a` inside some run of RUN or more consecutive lines that `b` has too."""
    wa, wb = windows(a), windows(b)
    covered: set[int] = set()
    for w, starts in wa.items():
        if w in wb:
            for s in starts:
                covered.update(range(s, s + RUN))
    return len(covered)


def package_of(rel: str) -> str:
    return rel.split(os.sep)[0]


def compared_pairs() -> list[tuple[str, str]]:
    """gpt2 x gpt3, and proxies/transformer x every other package."""
    files = python_files()
    by = defaultdict(list)
    for rel in files:
        by[package_of(rel)].append(rel)
    pairs = [(a, b) for a in by["gpt2"] for b in by["gpt3"]]
    others = [rel for rel in files if package_of(rel) != "transformer"]
    pairs += [(a, b) for a in by["transformer"] for b in others]
    return pairs


def repeats() -> dict[tuple[str, str], int]:
    out = {}
    for a, b in compared_pairs():
        n = repeated_lines(a, b)
        if n:
            out[(a, b)] = n
    return out


def test_no_code_repeated_between_gpt2_gpt3_and_transformer():
    found = repeats()
    new = {k: n for k, n in found.items() if k not in REPEATS}
    grown = {k: (n, REPEATS[k]) for k, n in found.items() if n > REPEATS.get(k, n)}
    gone = sorted(k for k in REPEATS if k not in found)
    assert not new, f"code repeated in runs of {RUN}+ lines (write it once): {new}"
    assert not grown, f"allowlisted repeats grew (lines now, allowed): {grown}"
    assert not gone, f"no longer repeated: delete from REPEATS: {gone}"


def test_the_repeat_finder_finds_a_repeat_and_ignores_imports(tmp_path, monkeypatch):
    # The guard must be able to fail: a 6-line block in two files is found, 5 lines are not,
    # imports and blank lines are not, and whitespace does not hide a copy.
    monkeypatch.setattr(sys.modules[__name__], "PKG", str(tmp_path))
    body = [f"x{i} = f({i}, y)" for i in range(6)]
    (tmp_path / "a.py").write_text("import os\nfrom a import (\n  b,\n)\n" + "\n".join(body))
    (tmp_path / "b.py").write_text("\n\n".join("    " + line.replace(" ", "  ") for line in body))
    (tmp_path / "c.py").write_text("\n".join(body[:5]) + "\nother()\n" + "\n".join(body[5:]))
    (tmp_path / "d.py").write_text("import os\nfrom a import (\n  b,\n)\n")
    assert repeated_lines("a.py", "b.py") == 6
    assert repeated_lines("a.py", "c.py") == 0
    assert repeated_lines("a.py", "d.py") == 0
