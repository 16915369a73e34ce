"""Output a person can read: every table printed at 80 and 200 columns holds every number of
its data uncut, no header cut into a duplicate, a legend for every abbreviation; plurals;
dry-run plan tables group identical ranks (bounded at 512 ranks)."""

import json
import re

import pytest
from launch import mpirun
from rich.console import Console

from proxies.core import report, tables
from proxies.core.tables import Column
from proxies.cosmoflow import SPEC
from proxies.sweep import report as sweep_report

# cosmoflow's categories labelled as a cosmoflow run labels them (its spec's table)
COSMOFLOW = report.Categories.of(SPEC.categories, SPEC.short)

WIDTHS = (80, 200)
# A number as printed: digits with thousands commas and a decimal part.
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?(?:e[+-]\d+)?")


def recorder(width: int) -> Console:
    return Console(width=width, record=True, highlight=False, soft_wrap=True)


def text_of(out: Console) -> str:
    return out.export_text()


def table_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line[:1] in "│┃"]


def numbers_in(text: str) -> list[str]:
    """Every number in the table rows, as printed (cells are split at the rules)."""
    found = []
    for line in table_lines(text):
        for cell in re.split(r"[│┃]", line):
            found += NUMBER.findall(cell)
    return found


def assert_uncut(text: str, expected: list[str], width: int) -> None:
    assert "…" not in text, text
    assert all(len(line) <= width for line in text.splitlines() if line[:1] in "│┃┏┡└"), text
    seen = numbers_in(text)
    for value in expected:
        for token in NUMBER.findall(value):
            assert token in seen, f"{token} (of {value!r}) not printed whole:\n{text}"


def legend(text: str) -> dict[str, str]:
    """The abbreviations listed under a table: {short: full}."""
    if "abbreviations:" not in text:
        return {}
    block = text.split("abbreviations:", 1)[1].splitlines()[1:]
    out = {}
    for line in block:
        if not line.startswith("  "):
            break
        short, full = re.split(r"\s{2,}", line.strip(), maxsplit=1)
        out[short] = full
    return out


def all_headers(text: str) -> list[list[str]]:
    """Each table's column headers, their wrapped lines joined (lines between ┏ and ┡)."""
    tables_, cols, inside = [], [], False
    for line in text.splitlines():
        if line.startswith("┏"):
            inside, cols = True, []
        elif line.startswith("┡"):
            inside = False
            tables_.append(cols)
        elif inside:
            cells = [c.strip() for c in line.split("┃")[1:-1]]
            cols = (
                cells
                if not cols
                else [f"{a} {b}".strip() for a, b in zip(cols, cells, strict=False)]
            )
    return tables_


def headers(text: str) -> list[str]:
    """The first table's headers."""
    return all_headers(text)[0]


# -- the layout policy itself --------------------------------------------------------------


@pytest.mark.parametrize("width", WIDTHS)
def test_numbers_never_cut_and_abbreviations_have_a_legend(width):
    cats = [f"category_{i}_allreduce" for i in range(14)]
    cols = [Column("ranks", number=False, key=True)]
    cols += [Column(f"a long category label number {i}", short=f"c{i}") for i in range(14)]
    rows = [
        [f"stage {s}", *(f"{1234567.891 * (s + 1) * (i + 1):,.3f}" for i in range(len(cats)))]
        for s in range(3)
    ]
    out = recorder(width)
    tables.show(out, "a wide table", cols, rows)
    text = text_of(out)
    assert_uncut(text, [v for r in rows for v in r[1:]], width)
    named = legend(text)
    used = {c.short for c in cols[1:]}
    if width == 80:  # too wide for 80: abbreviated and split, every abbreviation explained
        assert named == {f"c{i}": f"a long category label number {i}" for i in range(14)}
        assert "(part 1 of" in text
    else:
        assert set(named) <= used
    parts = max(1, text.count("(part "))
    assert text.count("stage 2") == parts  # the key column is repeated in every part


def test_layout_prefers_wrapping_then_abbreviating_then_splitting():
    cols = [Column("name", number=False), Column("a header with words", short="h")]
    rows = [["x y z", "123"]]
    assert tables.layout(cols, rows, 200) == {"parts": [[0, 1]], "short": False}
    # least widths: "name" 4, "header" 6 (headers wrap at spaces); 3 per column + 1 of rules
    assert tables.layout(cols, rows, 7 + 4 + 6) == {"parts": [[0, 1]], "short": False}
    # one less: the header abbreviated ("h" over "123": 3 wide)
    assert tables.layout(cols, rows, 7 + 4 + 6 - 1) == {"parts": [[0, 1]], "short": True}
    # narrower than both columns together: split
    assert tables.layout(cols, rows, 7 + 4 + 3 - 1) == {"parts": [[0], [1]], "short": True}


def long_table(rows: int, cell=lambda k: f"send mb {k % 7}"):
    cols = [Column("#", key=True), Column("op", number=False), Column("bytes sent"), Column("peer")]
    data: list = [None]  # a section before the first row draws nothing
    for k in range(rows):
        data.append([str(k), cell(k), f"{k * 1000:,}", "" if k % 3 else "1"])
        if k % 97 == 3:
            data += [None, None]  # two in a row: one rule
    return cols, data + [None]  # nor one after the last


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("title", ["rank 0 (stage 0): ops in order", "a title " * 12])
def test_long_tables_are_drawn_as_rich_draws_them(monkeypatch, width, title):
    """Above DRAWN_ROWS rows the table is drawn line by line, character for character what
    rich's Table prints (a title longer than the table wraps as rich wraps it)."""
    cols, rows = long_table(300)
    printed = {}
    for drawn in (10**9, 100):
        monkeypatch.setattr(tables, "DRAWN_ROWS", drawn)
        out = recorder(width)
        tables.show(out, title, cols, rows, note="a note")
        printed[drawn] = text_of(out)
    assert printed[100] == printed[10**9]
    assert printed[100].count("├") == 4  # after rows 3, 100, 197, 294; none after the last


@pytest.mark.parametrize("cell", [lambda k: "[bold]x[/bold]", lambda k: "a word " * (k // 50)])
def test_long_tables_with_markup_or_wrapped_cells_are_left_to_rich(monkeypatch, cell):
    """A cell with markup, or one its column must wrap (width 80), is rich's to print."""
    cols, rows = long_table(300, cell)
    monkeypatch.setattr(tables, "DRAWN_ROWS", 100)
    out = recorder(80)
    heads, widths = ["#", "op", "b", "p"], [3, 20, 7, 4]
    assert not tables._draw(out, "t", cols, rows, [0, 1, 2, 3], heads, widths)
    assert text_of(out) == ""
    tables.show(out, "t", cols, rows)
    assert "[bold]" not in text_of(out)


def test_words():
    assert tables.plural(1, "rank") == "1 rank"
    assert tables.plural(2, "rank") == "2 ranks"
    assert tables.plural(1024, "rank") == "1,024 ranks"
    assert tables.si_count(3_424_704) == "3.42 M"
    assert tables.si_count(174_600_000_000) == "175 B"
    assert tables.si_count(512) == "512"
    assert tables.rank_ranges([3, 0, 1, 2, 8, 9, 10, 11]) == "0-3, 8-11"
    assert tables.rank_ranges(range(0, 512, 2)) == "0, 2, ..., 510"
    assert tables.rank_ranges([0, 1, 2, 5, 9]) == "0-2, 5, 9"


# -- a real run's report -------------------------------------------------------------------


@pytest.fixture(scope="module")
def cosmoflow_result(tmp_path_factory):
    """A real 4-rank cosmoflow run (2 shards x 2 replicas): 11 categories, hidden ones
    included, two stages, who-waited-for-whom."""
    out = tmp_path_factory.mktemp("out") / "cf.json"
    args = ["--model", "cosmoflow-tiny", "--shards", "2", "--iters", "2", "--warmup", "0"]
    r = mpirun(4, "proxies.cosmoflow", *args, "--quiet", "--json", str(out), timeout=180)
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())


def expected_numbers(result: dict) -> list[str]:
    """The values print_report formats, as it formats them."""
    import statistics

    vals = []
    for c, v in result["breakdown_s"].items():
        vals += [f"{statistics.fmean(v):.4f}", f"{max(result['breakdown_per_rank_s'][c]):.4f}"]
    for b in result["bytes"].values():
        vals.append(report.human_bytes(max(b)).split()[0])
    labels = result["rank_labels"]
    for per in result["breakdown_per_rank_s"].values():
        for name in dict.fromkeys(labels):
            idx = [i for i, x in enumerate(labels) if x == name]
            vals.append(f"{statistics.fmean(per[i] for i in idx):.4f}")
    return vals


@pytest.mark.mpi
@pytest.mark.parametrize("width", WIDTHS)
def test_run_report_uncut(cosmoflow_result, width):
    out = recorder(width)
    report.print_report(cosmoflow_result, ["header line"], out=out, table=COSMOFLOW)
    text = text_of(out)
    assert_uncut(text, expected_numbers(cosmoflow_result), width)
    assert "over 2 timed iterations" in text
    # The per-stage table names categories as the breakdown does, or by an abbreviation
    # whose legend entry is that name.
    stage_part = text.split("per stage", 1)[1].split("who waited", 1)[0]
    names = {report.label(c, COSMOFLOW) for c in cosmoflow_result["breakdown_per_rank_s"]}
    named = legend(stage_part)
    shown = {h for t in all_headers(stage_part) for h in t} - {"ranks"}
    for h in shown:
        assert h in names or named.get(h) in names, (h, stage_part)
    hs = [h for t in all_headers(stage_part) for h in t if h != "ranks"]
    assert len(hs) == len(set(hs)) == len(names), hs  # none cut into a duplicate, none lost
    if width == 80:
        assert named and set(named.values()) <= names


@pytest.mark.mpi
def test_one_iteration_and_one_rank_words(cosmoflow_result):
    one = dict(cosmoflow_result, iter_time_s=cosmoflow_result["iter_time_s"][:1])
    out = recorder(80)
    report.print_report(one, [], quiet=True, out=out)
    assert "over 1 timed iteration (" in text_of(out)


# -- sweep report --------------------------------------------------------------------------


def sweep_record(label, ranks, t, **bd):
    series = {"layers": 2}
    point = {
        "id": json.dumps([label, ranks, 0, series]),
        "label": label,
        "proxy": "cosmoflow",
        "ranks": ranks,
        "args": dict(series),
        "repeat": 0,
        "series": series,
        "series_id": json.dumps([label, series]),
        "scaling": "strong",
    }
    return {
        "point": point,
        "status": "ok",
        "describe": label,
        "result": {"iter_time_s": t, "breakdown_s": bd},
    }


@pytest.mark.mpi
@pytest.mark.parametrize("width", WIDTHS)
def test_sweep_table_uncut(cosmoflow_result, width):
    bd = cosmoflow_result["breakdown_s"]
    recs = [
        sweep_record(
            "strong",
            n,
            [0.1234 * 4 / n, 0.1236 * 4 / n],
            **{c: [x * 4 / n for x in v] for c, v in bd.items()},
        )
        for n in (1, 2, 4, 8, 16)
    ]
    rows = sweep_report.rows(recs)
    out = recorder(width)
    sweep_report.print_table(rows, "sweep", out)
    text = text_of(out)
    expected = []
    for r in rows:
        expected += [str(r["ranks"]), sweep_report.seconds(r["iter_time_s"])]
        expected += [f"{r['speedup']:.2f}", f"{100 * r['efficiency']:.0f}"]
        expected += [
            sweep_report.seconds(v)
            for c, v in r["breakdown_s"].items()
            if not c.endswith(report.HIDDEN)
        ]
    assert_uncut(text, expected, width)
    named = legend(text)
    hs = [h for t in all_headers(text) for h in t if h not in ("run", "ranks")]
    assert len(hs) == len(set(hs)), hs
    if width == 80:
        assert named  # abbreviated, each explained by its full label
        assert set(named.values()) <= {report.label(c, COSMOFLOW) for c in bd}


# -- dry runs ------------------------------------------------------------------------------


def dry(monkeypatch, width, module, argv) -> str:
    import importlib

    out = recorder(width)
    monkeypatch.setattr(report, "console", lambda: out)
    main = importlib.import_module(f"proxies.{module}.proxy").main
    assert main(argv) == 0
    return text_of(out)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize(
    "module, argv, groups",
    [
        ("gpt2", ["8", "4", "--dry-run", "--world-size", "512"], 4),
        ("cosmoflow", ["--shards", "4", "--dry-run", "--world-size", "512"], 4),
    ],
)
def test_dry_run_groups_identical_ranks(monkeypatch, width, module, argv, groups):
    text = dry(monkeypatch, width, module, [*argv, "--show-ranks", "0"])
    plan = text.split("plan of one iteration", 1)[1].split("ops in order", 1)[0]
    plan = plan.split("(part 2 of", 1)[0]  # at 80 columns the table comes in two parts
    rows = [line for line in table_lines(plan) if line.startswith("│")]
    counts = [int(line.split("│")[2].strip()) for line in rows if line.split("│")[2].strip()]
    assert len(counts) == groups and sum(counts) == 512, plan
    assert len(plan.splitlines()) < 40
    assert "512 ranks" in text and "…" not in text


@pytest.mark.parametrize("width", WIDTHS)
def test_op_listing_flops_in_their_own_column(monkeypatch, width):
    text = dry(
        monkeypatch,
        width,
        "gpt2",
        ["8", "2", "--dry-run", "--world-size", "2", "--show-ranks", "0"],
    )
    listing = text.split("ops in order", 1)[1]
    shown = [h for t in all_headers(listing) for h in t]
    assert "flop" in shown and "bytes" in shown and not re.search(r"\d flop", listing)
    assert "2 ranks" in text
    one = dry(monkeypatch, width, "gpt2", ["8", "1", "--dry-run", "--world-size", "1"])
    assert "plan valid: 1 rank," in one


def test_gpt3_dry_run_sizes_and_uncut(monkeypatch):
    argv = [
        "4",
        "2",
        "--model",
        "gpt3-medium",
        "--layers-only",
        "--dry-run",
        "--world-size",
        "8",
        "--tp",
        "2",
    ]
    text = dry(monkeypatch, 80, "gpt3", argv)
    assert "parameters (104 M)" in text and "0.10 B" not in text
    assert "…" not in text
    # the traffic table's byte counts, whole
    assert "268,435,456" in numbers_in(text)
