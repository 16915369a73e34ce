"""Every printed table goes through `show`: one layout policy for the whole suite.

The policy, in order, until the table fits the console's width:

1. as is (every header and cell on one line);
2. text wrapped at spaces (headers and text cells, never inside a word);
3. long headers replaced by their abbreviation (`Column.short`), with a legend printed
   below the table naming each abbreviation in full;
4. split into parts side by side in time (the `key` columns repeated in each part).

Numbers are never cut, folded or wrapped: a number column is at least as wide as its widest
cell, and rich only ever wraps a header at its spaces, since every column is at least as
wide as its longest word. rich's own squeezing (which cuts headers to `conv_allredu…` until
two read the same, and numbers to `0…`) never runs, because the widths handed to it fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# A rich table with the default box spends, per column, one space each side and one rule,
# plus the outer rule: width = sum(columns) + 3 * columns + 1.
PER_COLUMN = 3
# Tables of more rows than this are drawn here, line by line as rich draws them, when every
# cell fits its column on one line: rich's Table spends about 0.4 ms a row (a dry run's
# listing of one rank's 20,000 ops took 11 s to print, 0.3 s drawn here).
DRAWN_ROWS = 500


@dataclass(frozen=True)
class Column:
    header: str
    number: bool = True  # right-aligned, never wrapped or cut
    short: str = ""  # abbreviation used when the table would not fit (legend below)
    key: bool = False  # repeated in every part when the table is split


def plural(n: int, word: str, many: str | None = None) -> str:
    """`1 rank`, `2 ranks`, `1,024 ranks`."""
    return f"{n:,} {word if n == 1 else (many or word + 's')}"


def si_count(n: float) -> str:
    """A count in words a person reads at a glance: 21,310 -> "21.3 K", 3.42e6 -> "3.42 M",
    1.75e11 -> "175 B" (billions, as model sizes are quoted)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:g}"


def rank_ranges(ranks: Sequence[int]) -> str:
    """Ranks as runs: [0, 1, 2, 3, 8, 9, 10, 11] -> "0-3, 8-11". Runs that repeat with a
    fixed length and stride, as grid dimensions make them, are written by their first two
    and last: every other rank of 512 -> "0, 2, ..., 510"; "0-3, 8-11, ..., 504-507"."""
    runs: list[tuple[int, int]] = []
    for r in sorted(set(ranks)):
        if runs and r == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], r)
        else:
            runs.append((r, r))
    text = [str(a) if a == b else f"{a}-{b}" for a, b in runs]
    if len(runs) >= 4:
        lengths = {b - a for a, b in runs}
        strides = {runs[k + 1][0] - runs[k][0] for k in range(len(runs) - 1)}
        if len(lengths) == 1 and len(strides) == 1:
            text = [text[0], text[1], "...", text[-1]]
    return ", ".join(text)


def _plain(cell: str) -> str:
    if "[" not in cell:  # no markup (the common case, and 10x cheaper than parsing it)
        return cell
    from rich.text import Text

    return Text.from_markup(cell).plain


def _longest_word(text: str) -> int:
    return max((len(w) for w in text.split()), default=0)


def _widths(cols: list[Column], rows: list[list[str]], idx: list[int], short: bool):
    """Per column (indices idx): (least width, natural width) and the headers shown."""
    heads, least, full = [], [], []
    for i in idx:
        c = cols[i]
        head = c.short if short and c.short else c.header
        cells = [_plain(r[i]) for r in rows]
        widest = max((len(x) for x in cells), default=0)
        heads.append(head)
        full.append(max(len(head), widest))
        words = widest if c.number else max((_longest_word(x) for x in cells), default=0)
        least.append(max(_longest_word(head), words, 1))
    return heads, least, full


def _fit(least: list[int], full: list[int], cols: list[Column], idx: list[int], avail: int):
    """Widths from `least` up to `full` within `avail`: text columns get the room first, in
    proportion to what each lacks (they are the ones that wrap into many lines), then the
    headers of number columns."""
    widths = list(least)
    extra = avail - sum(widths)
    for want_text in (True, False):
        ks = [k for k, i in enumerate(idx) if cols[i].number != want_text]
        lack = sum(full[k] - widths[k] for k in ks)
        if extra <= 0 or lack <= 0:
            continue
        share = min(extra, lack)
        for k in ks:
            more = min(full[k] - widths[k], share * (full[k] - widths[k]) // lack)
            widths[k] += more
            extra -= more
        for k in ks:  # what the rounding left, in order
            more = min(extra, full[k] - widths[k])
            widths[k] += more
            extra -= more
    return widths


def _render(title, cols, rows, idx, heads, widths):
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for i, head, w in zip(idx, heads, widths, strict=True):
        c = cols[i]
        t.add_column(head, justify="right" if c.number else "left", width=w, min_width=w)
    for r in rows:
        if r is None:
            t.add_section()
        else:
            t.add_row(*(r[i] for i in idx))
    return t


def _draw(out, title, cols, rows, idx, heads, widths) -> bool:
    """Print the table as rich's default table (box HEAVY_HEAD, header bold, title italic
    above it) would, when every header and cell fits its width on one line and holds no
    markup; False, having printed nothing, otherwise."""
    from rich.text import Text

    body: list[str] = []
    right = [cols[i].number for i in idx]

    def cells(texts: Sequence[str]) -> list[str]:
        return [
            " " + (t.rjust(w) if r else t.ljust(w)) + " "
            for t, w, r in zip(texts, widths, right, strict=True)
        ]

    def rule(left: str, fill: str, cross: str, end: str) -> str:
        return left + cross.join(fill * (w + 2) for w in widths) + end

    if any(len(h) > w for h, w in zip(heads, widths, strict=True)):
        return False
    section = rule("├", "─", "┼", "┤")
    for r in rows:
        if r is None:  # a section: a rule under the previous row (none before the first)
            if body and body[-1] != section:
                body.append(section)
            continue
        texts = [r[i] for i in idx]
        for t, w in zip(texts, widths, strict=True):
            if len(t) > w or "\n" in t or _plain(t) != t:
                return False
        body.append("│" + "│".join(cells(texts)) + "│")
    if body and body[-1] == section:
        body.pop()
    table_width = sum(widths) + PER_COLUMN * len(widths) + 1
    if title:
        out.print(title, style="table.title", width=table_width, highlight=False)
    head = Text("┃")
    for c in cells(heads):
        head.append(c, style="table.header")
        head.append("┃")
    out.print(rule("┏", "━", "┳", "┓"), highlight=False, markup=False)
    out.print(head, highlight=False)
    out.print(rule("┡", "━", "╇", "┩"), highlight=False, markup=False)
    if body:
        out.print("\n".join(body), highlight=False, markup=False, emoji=False, soft_wrap=True)
    out.print(rule("└", "─", "┴", "┘"), highlight=False, markup=False)
    return True


def layout(cols: list[Column], rows: list[list[str] | None], width: int) -> dict:
    """The plan `show` prints: {"parts": [column indices...], "short": bool}. Exposed for
    tests."""
    data = [r for r in rows if r is not None]
    every = list(range(len(cols)))

    def room(n: int) -> int:
        return width - PER_COLUMN * n - 1

    for short in (False, True):
        if short and not any(c.short for c in cols):
            break
        _, least, _ = _widths(cols, data, every, short)
        if sum(least) <= room(len(every)):
            return {"parts": [every], "short": short}
    # Split: the key columns in every part, the others packed in order.
    short = any(c.short for c in cols)
    keys = [i for i, c in enumerate(cols) if c.key]
    rest = [i for i, c in enumerate(cols) if not c.key]
    _, least, _ = _widths(cols, data, every, short)
    parts: list[list[int]] = []
    part: list[int] = []
    for i in rest:
        trial = keys + part + [i]
        if part and sum(least[j] for j in trial) > room(len(trial)):
            parts.append(keys + part)
            part = []
        part.append(i)
    if part or not parts:
        parts.append(keys + part)
    return {"parts": parts, "short": short}


def show(
    out,
    title: str,
    cols: list[Column],
    rows: list[list[str] | None],
    *,
    note: str = "",
) -> None:
    """Print the table on the rich console `out` (None rows: a section rule), by the policy
    above; `note` is printed under it (before the legend)."""
    data = [r for r in rows if r is not None]
    plan = layout(cols, rows, out.width)
    parts, short = plan["parts"], plan["short"]
    used: dict[str, str] = {}
    for n, idx in enumerate(parts):
        heads, least, full = _widths(cols, data, idx, short)
        widths = _fit(least, full, cols, idx, out.width - PER_COLUMN * len(idx) - 1)
        name = title if len(parts) == 1 else f"{title} (part {n + 1} of {len(parts)})"
        if len(data) <= DRAWN_ROWS or not _draw(out, name, cols, rows, idx, heads, widths):
            out.print(_render(name, cols, rows, idx, heads, widths))
        for i, head in zip(idx, heads, strict=True):
            if head != cols[i].header:
                used[head] = cols[i].header
    if note:
        out.print(note)
    if used:
        # One per line: a legend a reader scans, never wrapped mid-entry by the terminal.
        out.print("abbreviations:")
        pad = max(len(s) for s in used)
        for s, full in used.items():
            out.print(f"  {s:<{pad}}  {full}")


def unique_shorts(shorts: list[str]) -> list[str]:
    """Abbreviations made distinct (a legend must name one thing per abbreviation)."""
    seen: dict[str, int] = {}
    out = []
    for s in shorts:
        seen[s] = seen.get(s, 0) + 1
        out.append(s if seen[s] == 1 else f"{s}{seen[s]}")
    return out
