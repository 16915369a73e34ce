"""python -m proxies compare A B: is B faster than A, with the noise stated.

A and B are two proxy result JSONs (--json) or two sweep results directories. Per point
(a file is one point; sweep points are matched by proxy, ranks and arguments), per
category of the breakdown and for the iteration itself: A's and B's median over
iterations, B - A, B / A, each side's min-max range, and a verdict from a two-sided
Mann-Whitney U test at 95% confidence (stats.py).
"""

from __future__ import annotations

import argparse
import sys

from proxies.compare import sides, stats
from proxies.core import exits
from proxies.core.report import HIDDEN, console, ordered, write_json
from proxies.core.report import label as category_label
from proxies.registry import report_categories

# Every proxy's category labels: results carry no job to ask.
TABLE = report_categories()

PROG = "python -m proxies compare"
ITERATION = "iteration"  # the row of the whole iteration (max over ranks), before categories


def parse(argv: list[str] | None) -> argparse.Namespace:
    from proxies.core.cli import Parser
    from proxies.core.provenance import add_version

    p = Parser(  # a bad option is one line (UsageError), not usage text
        prog=PROG,
        description="Compare two runs: per category and for the whole iteration, the medians "
        "over iterations, the difference, each side's range, and whether the difference is "
        f"beyond noise (two-sided Mann-Whitney U test, p < {stats.ALPHA}).",
    )
    p.add_argument(
        "a", metavar="A", help="a proxy result JSON (--json) or a sweep's results directory"
    )
    p.add_argument("b", metavar="B", help="the same kind as A: compared against A")
    p.add_argument("--json", metavar="OUT", help="also write the comparison as JSON")
    p.add_argument(
        "--allow-different",
        action="store_true",
        help="compare runs whose configs differ in what they run (model, sizes, layout, "
        "batch, compute mode ...); refused without it",
    )
    add_version(p)  # --version
    return p.parse_args(argv)


def samples(pt: dict, category: str) -> list[float]:
    if category == ITERATION:
        return pt["iter_time_s"]
    return pt["breakdown_s"].get(category) or [0.0] * len(pt["iter_time_s"])


def compare_point(a: dict, b: dict) -> dict:
    cats = ordered(set(a["breakdown_s"]) | set(b["breakdown_s"]), TABLE)
    rows = {c: stats.compare(samples(a, c), samples(b, c)) for c in [ITERATION, *cats]}
    return {
        "a": a["name"],
        "b": b["name"],
        "work_differences": sides.work_differences(a, b),
        "other_differences": sides.how_differences(a, b),
        "rows": rows,
    }


def pairs(a: dict[str, dict], b: dict[str, dict]) -> tuple[list[tuple[dict, dict]], list, list]:
    matched = [(a[k], b[k]) for k in a if k in b]
    return matched, [a[k]["name"] for k in a if k not in b], [b[k]["name"] for k in b if k not in a]


def main(argv: list[str] | None = None) -> int:
    from proxies.core.cli import UsageError

    try:
        args = parse(argv)
    except UsageError as e:
        return fail(str(e))
    from proxies.core.cli import output_problem

    if (why := output_problem(args.json, "--json")) is not None:
        return fail(why)
    try:
        kind_a, a = sides.load(args.a)
        kind_b, b = sides.load(args.b)
    except sides.SideError as e:
        return fail(str(e))
    if kind_a != kind_b:
        return fail(f"{args.a} is a {kind_a}, {args.b} a {kind_b}: compare two of the same kind")
    if kind_a == "file":
        a["run"]["name"], b["run"]["name"] = args.a, args.b
    matched, only_a, only_b = pairs(a, b)
    if not matched:
        return fail(f"{args.a} and {args.b} have no point in common (proxy, ranks, arguments)")
    compared = [compare_point(x, y) for x, y in matched]
    refused = [c for c in compared if c["work_differences"]]
    if refused and not args.allow_different:
        first = refused[0]
        x, y = next((x, y) for x, y in matched if x["name"] == first["a"])
        words = ", ".join(
            f"{k} ({value(x, k)} vs {value(y, k)})" for k in first["work_differences"]
        )
        more = f" (and {len(refused) - 1} more points)" if len(refused) > 1 else ""
        return fail(
            f"{first['a']} and {first['b']} run different work: {words}{more}; "
            "--allow-different compares them anyway"
        )
    out = console()
    for c in compared:
        print_point(c, out)
    for who, names in ((args.a, only_a), (args.b, only_b)):
        if names:
            out.print(f"only in {who} ({len(names)}, not compared): " + "; ".join(names))
    if len(compared) > 1:
        out.print(summary(compared))
    doc = {
        "a": args.a,
        "b": args.b,
        "alpha": stats.ALPHA,
        "test": "two-sided Mann-Whitney U over per-iteration samples",
        "points": compared,
        "only_in_a": only_a,
        "only_in_b": only_b,
    }
    if args.json and write_json(args.json, doc, prog="proxies compare") is None:
        return exits.FAILED
    return exits.OK


def value(pt: dict, key: str) -> object:
    return pt[key] if key in ("proxy", "world_size") else pt["config"].get(key)


def summary(compared: list[dict]) -> str:
    verdicts = [c["rows"][ITERATION]["faster"] for c in compared]
    return (
        f"{len(compared)} points, time per iteration: B faster in {verdicts.count('B')}, "
        f"slower in {verdicts.count('A')}, no difference beyond noise (or too few "
        f"iterations) in {verdicts.count(None)}"
    )


def print_point(c: dict, out) -> None:
    from rich.markup import escape
    from rich.table import Table

    title = f"A = {c['a']}\nB = {c['b']}" if c["a"] != c["b"] else c["a"]
    t = Table(
        title=escape(title + "\nseconds per iteration: median [min - max] over iterations"),
        title_justify="left",
    )
    for col in ("", "A", "B", "B - A", "B / A", "verdict"):
        t.add_column(col, justify="left" if col in ("", "verdict") else "right")
    for cat, r in c["rows"].items():
        name = (
            "time per iteration" if cat == ITERATION else category_label(cat, TABLE).split(" (")[0]
        )
        if cat.endswith(HIDDEN):
            name = category_label(cat, TABLE)
        colour = {"B": "green", "A": "red"}.get(r["faster"])
        t.add_row(
            escape(name),
            escape(shown(r["a"])),
            escape(shown(r["b"])),
            f"{r['difference_s']:+.4f}",
            "" if r["ratio"] is None else f"{r['ratio']:.3f}",
            f"[{colour}]{r['verdict']}[/]" if colour else r["verdict"],
        )
    out.print(t)
    if c["work_differences"]:
        out.print(
            "[yellow]different work[/] (--allow-different): " + ", ".join(c["work_differences"])
        )
    if c["other_differences"]:
        out.print("differs (same work): " + escape("; ".join(c["other_differences"])))


def shown(s: dict) -> str:
    return f"{s['median']:.4f} [{s['min']:.4f} - {s['max']:.4f}]"


def fail(message: str) -> int:
    print(f"proxies compare: error: {message}", file=sys.stderr)
    return exits.USAGE
