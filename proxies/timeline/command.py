"""python -m proxies timeline TRACE.json -o PICTURE.png: a few ranks of a --trace file
(measured or predicted) over one iteration, one lane per rank and kind of work (the trace's
threads), each op a bar coloured by its category, waits (idle) grey and hatched over the op
they are part of, and each message a thin line from its send to its receive.

Needs matplotlib (the `plots` extra): imported only here, one line and exit 2 without it.
"""

from __future__ import annotations

import json
from collections import defaultdict

from proxies.core import cli, exits
from proxies.core.trace import ITERATION

PROG = "python -m proxies timeline"
DEFAULT_RANKS = 4
IDLE = "idle"


def parse(argv: list[str] | None):
    from proxies.core.provenance import add_version

    p = cli.Parser(
        prog=PROG,
        description="Draw a --trace file (measured or predicted): a few ranks over one "
        "iteration, coloured by category.",
    )
    p.add_argument("trace", metavar="TRACE.json", help="a file written by a proxy's --trace")
    p.add_argument("-o", "--output", metavar="PICTURE.png", required=True, help="the PNG to write")
    p.add_argument(
        "--ranks",
        metavar="LIST",
        help=f"ranks drawn, e.g. 0,1,5 (default: the first {DEFAULT_RANKS} in the trace)",
    )
    p.add_argument(
        "--iteration",
        type=cli.nonneg_int,
        default=0,
        metavar="K",
        help="which of the trace's iterations, counted from 0 (default 0: the first)",
    )
    add_version(p)
    return p.parse_args(argv)


def load(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise cli.UsageError(f"{path}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise cli.UsageError(f"{path}: not JSON ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise cli.UsageError(f"{path}: not a trace (no traceEvents): write one with --trace")
    return doc


def lanes(doc: dict, ranks: list[int] | None, iteration: int):
    """(window (t0, t1) in us, [(lane label, [slice events])], message lines, names)."""
    ev = doc["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in ev if e.get("name") == "process_name"}
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in ev if e.get("name") == "thread_name"
    }
    pids = sorted(names)
    if ranks is None:
        ranks = pids[:DEFAULT_RANKS]
    missing = [r for r in ranks if r not in names]
    if missing:
        raise cli.UsageError(f"rank {missing[0]} is not in the trace (it has ranks {pids})")
    marks = sorted(
        (e for e in ev if e.get("ph") == "X" and e.get("cat") == ITERATION), key=lambda e: e["ts"]
    )
    firsts = sorted({round(e["ts"]) for e in marks if e["pid"] == ranks[0]})
    if iteration >= len(firsts):
        raise cli.UsageError(f"--iteration {iteration}: the trace has {len(firsts)}")
    own = [e for e in marks if e["pid"] == ranks[0]][iteration]
    t0, t1 = own["ts"], own["ts"] + own["dur"]
    by_lane: dict[tuple, list] = defaultdict(list)
    for e in ev:
        if e.get("ph") != "X" or e["cat"] == ITERATION or e["pid"] not in ranks:
            continue
        if e["ts"] + e["dur"] < t0 or e["ts"] > t1:
            continue
        by_lane[e["pid"], e["tid"]].append(e)
    out = []
    for pid in ranks:
        for key in sorted(k for k in by_lane if k[0] == pid):
            out.append(
                (f"{names[pid].split(':')[0]} {threads.get(key, key[1])}", by_lane[key], key)
            )
    flows = defaultdict(dict)
    for e in ev:
        if e.get("ph") in ("s", "f") and e["pid"] in ranks and t0 <= e["ts"] <= t1:
            flows[e["id"]][e["ph"]] = (e["pid"], e["tid"], e["ts"])
    lines = [(f["s"], f["f"]) for f in flows.values() if len(f) == 2]
    return (t0, t1), out, lines, {r: names[r] for r in ranks}


def draw(doc: dict, output: str, ranks: list[int] | None, iteration: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise cli.UsageError(
            "the picture needs matplotlib: pip install 'mpi-dl-proxies[plots]'"
        ) from None
    (t0, t1), out, lines, names = lanes(doc, ranks, iteration)
    cats = sorted({e["cat"] for _, evs, _ in out for e in evs} - {IDLE})
    palette = plt.get_cmap("tab10")
    colour = {c: palette(i % 10) for i, c in enumerate(cats)}
    colour[IDLE] = (0.8, 0.8, 0.8, 1.0)
    ms = 1e-3  # the axis in milliseconds from the iteration's start
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(out) + 1.6))
    row_of = {}
    for y, (_, evs, key) in enumerate(out):
        row_of[key] = y
        for e in sorted(evs, key=lambda e: -e["dur"]):  # parents first, their waits over them
            idle = e["cat"] == IDLE
            ax.barh(
                y,
                max(e["dur"], 0.0) * ms,
                left=(e["ts"] - t0) * ms,
                height=0.5 if idle else 0.8,
                color=colour[e["cat"]],
                hatch="//" if idle else None,
                edgecolor="grey" if idle else "none",
                linewidth=0.3,
            )
    for (sp, st, sts), (fp, ft, fts) in lines:
        if (sp, st) in row_of and (fp, ft) in row_of:
            ax.plot(
                [(sts - t0) * ms, (fts - t0) * ms],
                [row_of[sp, st], row_of[fp, ft]],
                color="black",
                linewidth=0.4,
                alpha=0.5,
            )
    ax.set_yticks(range(len(out)), [label for label, _, _ in out], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, (t1 - t0) * ms)
    ax.set_xlabel("milliseconds from the iteration's start")
    meta = doc.get("otherData", {})
    kind = meta.get("kind", "")
    ax.set_title(f"{meta.get('proxy', '')} {kind} timeline, iteration {iteration}", fontsize=9)
    handles = [Patch(color=colour[c], label=c) for c in cats]
    handles.append(Patch(facecolor=colour[IDLE], hatch="//", edgecolor="grey", label=IDLE))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    cli.check_output(args.output, "-o")
    ranks = None
    if args.ranks is not None:
        try:
            ranks = [int(x) for x in args.ranks.split(",") if x.strip()]
        except ValueError:
            raise cli.UsageError(f"--ranks {args.ranks!r}: expected ranks like 0,1,5") from None
    doc = load(args.trace)
    draw(doc, args.output, ranks, args.iteration)
    print(f"{PROG}: wrote {args.output}")
    return exits.OK
