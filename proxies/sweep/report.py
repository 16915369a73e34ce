"""A sweep's results as a table, a CSV and plots.

Per point (series x ranks): the time per iteration is the mean of the proxy's `iter_time_s`
(each iteration the slowest rank's), averaged over repeats; the breakdown is the mean of
each `breakdown_s` category the same way. A series is one run's argument combination
across rank counts; its base is its point with the fewest ranks that ran (N0, t0):

    strong scaling (same problem):   speed-up = t0 / t        efficiency = speed-up * N0 / N
    weak scaling (work grows with N): efficiency = t0 / t     speed-up = efficiency * N / N0
"""

from __future__ import annotations

import csv
import json
import os
import statistics
import sys
from collections import Counter

from proxies.core.report import HIDDEN, console, ordered
from proxies.core.report import label as category_label
from proxies.sweep import results

CSV_FILE = "report.csv"
PLOTS = ("time.png", "efficiency.png", "breakdown.png")


def point_time(result: dict) -> float:
    return statistics.fmean(result["iter_time_s"])


def point_breakdown(result: dict) -> dict[str, float]:
    return {c: statistics.fmean(v) for c, v in result.get("breakdown_s", {}).items() if v}


def rows(records: list[dict]) -> list[dict]:
    """One row per (series, ranks), in the sweep's order, with speed-up and efficiency
    against the series' smallest run."""
    groups: dict[tuple[str, int], list[dict]] = {}
    latest = sorted(results.latest(records).values(), key=lambda r: r["point"].get("index", 0))
    for rec in latest:
        p = rec["point"]
        groups.setdefault((p["series_id"], p["ranks"]), []).append(rec)
    varying = varying_args(records)
    out = []
    for (_, ranks), recs in groups.items():
        p = recs[0]["point"]
        ok = [r for r in recs if r["status"] == "ok" and r.get("result")]
        counts = Counter(r["status"] for r in recs)
        status = ", ".join(k if len(counts) == 1 else f"{k} {n}" for k, n in counts.items())
        not_ok = [r for r in recs if r["status"] != "ok"]
        row = {
            "label": p["label"],
            "series": ", ".join(f"{k}={p['series'][k]}" for k in varying.get(p["label"], [])),
            "series_id": p["series_id"],
            "proxy": p["proxy"],
            "scaling": p.get("scaling", "strong"),
            "ranks": ranks,
            "args": p["args"],
            "status": status,
            "repeats": len(ok),
            "iter_time_s": None,
            "speedup": None,
            "efficiency": None,
            "breakdown_s": {},
            "reason": reason(not_ok[0]) if not_ok else "",
        }
        if ok:
            row["iter_time_s"] = statistics.fmean(point_time(r["result"]) for r in ok)
            bds = [point_breakdown(r["result"]) for r in ok]
            cats = ordered({c for b in bds for c in b})
            row["breakdown_s"] = {c: statistics.fmean(b.get(c, 0.0) for b in bds) for c in cats}
        out.append(row)
    scale(out)
    return out


def scale(rows: list[dict]) -> None:
    by_series: dict[str, list[dict]] = {}
    for r in rows:
        if r["iter_time_s"]:
            by_series.setdefault(r["series_id"], []).append(r)
    for members in by_series.values():
        base = min(members, key=lambda r: r["ranks"])
        t0, n0 = base["iter_time_s"], base["ranks"]
        for r in members:
            ratio = t0 / r["iter_time_s"]
            if r["scaling"] == "weak":
                r["efficiency"], r["speedup"] = ratio, ratio * r["ranks"] / n0
            else:
                r["speedup"], r["efficiency"] = ratio, ratio * n0 / r["ranks"]


def varying_args(records: list[dict]) -> dict[str, list[str]]:
    """Per run label, the args whose values differ between its series (what names a line)."""
    combos: dict[str, list[dict]] = {}
    for rec in records:
        p = rec["point"]
        combos.setdefault(p["label"], [])
        if p["series"] not in combos[p["label"]]:
            combos[p["label"]].append(p["series"])
    out = {}
    for label, cs in combos.items():
        keys = list(dict.fromkeys(k for c in cs for k in c))
        out[label] = [k for k in keys if len({json.dumps(c.get(k)) for c in cs}) > 1]
    return out


def reason(rec: dict) -> str:
    if rec["status"] == "skipped":
        return rec.get("reason", "")
    if rec["status"] == "timeout":
        return f"timed out after {rec.get('timeout_s', '?')} s"
    lines = [x for x in rec.get("stderr_tail", "").splitlines() if x.strip()]
    return lines[-1].strip() if lines else f"exit status {rec.get('returncode')}"


# -- output --------------------------------------------------------------------------------


def seconds(x: float | None) -> str:
    return "" if x is None else f"{x:.4f}"


def name(row: dict) -> str:
    return row["label"] + (f" ({row['series']})" if row["series"] else "")


def print_table(table_rows: list[dict], title: str, out=None) -> None:
    """One table per proxy (breakdown categories differ between proxies); points that did
    not run are listed under it with the reason."""
    from rich.markup import escape
    from rich.table import Table

    out = out or console()
    for proxy in dict.fromkeys(r["proxy"] for r in table_rows):
        mine = [r for r in table_rows if r["proxy"] == proxy]
        shown = [r for r in mine if r["status"] != "skipped"]
        cats = ordered({c for r in shown for c in r["breakdown_s"]})
        cats = [c for c in cats if not c.endswith(HIDDEN)]
        if shown:
            t = Table(
                title=f"{title}: {proxy}, seconds per iteration (breakdown: mean over ranks)",
                title_justify="left",
            )
            t.add_column("run", no_wrap=True)
            for col in ("ranks", "status", "time/iter", "speed-up", "efficiency"):
                t.add_column(col, justify="left" if col == "status" else "right")
            for c in cats:
                t.add_column(category_label(c).split(" (")[0], justify="right")
            for r in shown:
                ok = r["status"] == "ok"
                t.add_row(
                    escape(name(r)),
                    str(r["ranks"]),
                    r["status"] if ok else f"[red]{escape(r['status'])}[/]",
                    seconds(r["iter_time_s"]),
                    "" if r["speedup"] is None else f"{r['speedup']:.2f}x",
                    "" if r["efficiency"] is None else f"{100 * r['efficiency']:.0f}%",
                    *(seconds(r["breakdown_s"].get(c)) if r["breakdown_s"] else "" for c in cats),
                )
            out.print(t)
        # Why points did not run: grouped by reason, ranks listed.
        why: dict[tuple[str, str, str], list[int]] = {}
        for r in mine:
            if r["status"] != "ok":
                why.setdefault((name(r), r["status"], r["reason"]), []).append(r["ranks"])
        for (who, status, reason), ranks in why.items():
            at = ", ".join(map(str, ranks))
            color = "yellow" if status == "skipped" else "red"
            out.print(f"[{color}]{status}[/]: {escape(who)} at {at} ranks: {escape(reason)}")


def write_csv(table_rows: list[dict], path: str) -> None:
    cats = ordered({c for r in table_rows for c in r["breakdown_s"]})
    cols = ["label", "series", "proxy", "scaling", "ranks", "status", "repeats", "iter_time_s"]
    cols += ["speedup", "efficiency", *(f"breakdown_{c}_s" for c in cats), "args", "reason"]
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for r in table_rows:
            row = {**r, "args": json.dumps(r["args"], sort_keys=True)}
            row.update({f"breakdown_{c}_s": r["breakdown_s"].get(c) for c in cats})
            w.writerow(["" if row.get(c) is None else row[c] for c in cols])
    os.replace(tmp, path)


def plot(table_rows: list[dict], directory: str, title: str) -> list[str]:
    """time.png, efficiency.png, breakdown.png; [] when matplotlib is not installed."""
    try:
        import matplotlib
        import matplotlib.ticker

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    done = [r for r in table_rows if r["iter_time_s"]]
    if not done:
        return []
    series: dict[str, list[dict]] = {}
    for r in done:
        series.setdefault(r["series_id"], []).append(r)
    paths = []
    for name, key, ylabel in (
        ("time.png", "iter_time_s", "seconds per iteration"),
        ("efficiency.png", "efficiency", "parallel efficiency"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for members in series.values():
            members = sorted(members, key=lambda r: r["ranks"])
            r0 = members[0]
            legend = r0["label"] + (f" ({r0['series']})" if r0["series"] else "")
            ax.plot(
                [r["ranks"] for r in members],
                [r[key] for r in members],
                marker="o",
                label=f"{legend} [{r0['scaling']}]",
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["ranks"] for r in done}))
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        if key == "iter_time_s":
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
            ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        else:
            ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
            ax.set_ylim(bottom=0)
        ax.set_xlabel("ranks")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title}: {ylabel}")
        ax.legend(fontsize="small")
        ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        paths.append(save(fig, os.path.join(directory, name), plt))

    cats = [
        c for c in ordered({c for r in done for c in r["breakdown_s"]}) if not c.endswith(HIDDEN)
    ]
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(done) + 2), 4.5))
    xs = range(len(done))
    bottom = [0.0] * len(done)
    for c in cats:
        h = [r["breakdown_s"].get(c, 0.0) for r in done]
        ax.bar(xs, h, bottom=bottom, label=category_label(c).split(" (")[0])
        bottom = [b + v for b, v in zip(bottom, h, strict=True)]
    ticks = [f"{r['label']}\n{r['series']}\n{r['ranks']} ranks".replace("\n\n", "\n") for r in done]
    ax.set_xticks(list(xs), ticks, fontsize="x-small", rotation=90)
    ax.set_ylabel("seconds per iteration (mean over ranks)")
    ax.set_title(f"{title}: where the time went")
    ax.legend(fontsize="small")
    fig.tight_layout()
    paths.append(save(fig, os.path.join(directory, "breakdown.png"), plt))
    return paths


def save(fig, path: str, plt) -> str:
    tmp = f"{path}.tmp{os.getpid()}.png"
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def report(directory: str, out=None) -> list[dict]:
    """Table on stdout, CSV and plots in the directory; returns the rows."""
    out = out or console()
    records = results.load(os.path.join(directory, results.FILE))
    title = os.path.basename(os.path.normpath(directory))
    table_rows = rows(records)
    print_table(table_rows, title, out)
    write_csv(table_rows, os.path.join(directory, CSV_FILE))
    written = [os.path.join(directory, CSV_FILE), *plot(table_rows, directory, title)]
    out.print("wrote " + ", ".join(written))
    if len(written) == 1:
        out.print("(plots need matplotlib: pip install matplotlib)")
    return table_rows


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m proxies report",
        description="Table (time per iteration, speed-up, efficiency, breakdown), CSV and "
        "plots of a sweep's results.jsonl.",
    )
    p.add_argument("directory", help="a sweep's results directory, e.g. results/smoke")
    args = p.parse_args(argv)
    d = args.directory
    if os.path.isfile(d) and d.endswith(".jsonl"):
        d = os.path.dirname(d) or "."
    path = os.path.join(d, results.FILE)
    if not os.path.isfile(path):
        print(f"proxies report: error: {path}: no such file (run a sweep first)", file=sys.stderr)
        return 2
    if not results.load(path, warn=False):
        print(f"proxies report: error: {path}: no results yet", file=sys.stderr)
        return 2
    report(d)
    return 0
