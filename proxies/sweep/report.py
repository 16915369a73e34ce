"""A sweep's results as a table, a CSV and plots.

Per point (series x ranks): the time per iteration is the mean of the proxy's `iter_time_s`
(each iteration the slowest rank's), averaged over repeats; the breakdown is the mean of
each `breakdown_s` category the same way. A series is one run's argument combination
across rank counts; its base is its point with the fewest ranks that ran (N0, t0):

    strong scaling (same problem):   speed-up = t0 / t        efficiency = speed-up * N0 / N
    weak scaling (work grows with N): efficiency = t0 / t     speed-up = efficiency * N / N0

With a machine model, a point's JSON also holds `predicted_iter_time_s` (one number: the
predicted iteration) and `predicted_breakdown_s`: the row's `predicted_s` is its mean over
repeats, `error` = (predicted - measured) / measured. Predicted-only points (predict_ranks)
have no measurement; their speed-up and efficiency come from predicted times only, against
the series' predicted time at its fewest ranks (a measured point's prediction, or the
smallest predicted point), never against a measurement.
"""

from __future__ import annotations

import csv
import json
import os
import statistics
import sys
from collections import Counter

from proxies.core import exits
from proxies.core.report import HIDDEN, abbrev, console, ordered
from proxies.core.report import label as category_label
from proxies.registry import report_categories
from proxies.sweep import results

# Every proxy's category labels: results carry no job to ask.
TABLE = report_categories()

CSV_FILE = "report.csv"
PLOTS = ("time.png", "efficiency.png", "breakdown.png")


def point_time(result: dict) -> float:
    return statistics.fmean(result["iter_time_s"])


def point_breakdown(result: dict) -> dict[str, float]:
    return {c: statistics.fmean(v) for c, v in result.get("breakdown_s", {}).items() if v}


def predicted_time(result: dict) -> float | None:
    t = result.get("predicted_iter_time_s")
    return None if t is None else float(t)


def mean_breakdown(bds: list[dict[str, float]]) -> dict[str, float]:
    cats = ordered({c for b in bds for c in b}, TABLE)
    return {c: statistics.fmean(b.get(c, 0.0) for b in bds) for c in cats}


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
        predicted = bool(p.get("predicted"))
        row = {
            "label": p["label"],
            "series": ", ".join(f"{k}={p['series'].get(k)}" for k in varying.get(p["label"], [])),
            "series_id": p["series_id"],
            "proxy": p["proxy"],
            "scaling": p.get("scaling", "strong"),
            "ranks": ranks,
            "args": p["args"],
            "status": status,
            "repeats": len(ok),
            "iter_time_s": None,
            "iter_time_min_s": None,  # over every iteration of every repeat
            "iter_time_median_s": None,
            "iter_time_max_s": None,
            "speedup": None,
            "efficiency": None,
            "breakdown_s": {},
            "reason": reason(not_ok[0]) if not_ok else "",
            "predicted": predicted,  # predict_ranks: no measurement, only the prediction
            "machine": p.get("machine", ""),
            "predicted_s": None,
            "error": None,
            "predicted_speedup": None,
            "predicted_efficiency": None,
            "predicted_breakdown_s": {},
        }
        if ok and not predicted:
            row["iter_time_s"] = statistics.fmean(point_time(r["result"]) for r in ok)
            row["breakdown_s"] = mean_breakdown([point_breakdown(r["result"]) for r in ok])
            its = [t for r in ok for t in r["result"]["iter_time_s"]]
            row["iter_time_min_s"], row["iter_time_max_s"] = min(its), max(its)
            row["iter_time_median_s"] = statistics.median(its)
        pred = [r["result"] for r in ok if predicted_time(r["result"]) is not None]
        if pred:
            row["predicted_s"] = statistics.fmean(predicted_time(r) for r in pred)
            row["predicted_breakdown_s"] = mean_breakdown(
                [{c: float(v) for c, v in r.get("predicted_breakdown_s", {}).items()} for r in pred]
            )
        if row["iter_time_s"] and row["predicted_s"] is not None:
            row["error"] = (row["predicted_s"] - row["iter_time_s"]) / row["iter_time_s"]
        out.append(row)
    scale(out)
    return out


# What a point's work is, from its result's config (every proxy writes these): the global
# batch, and the model's size where it is a key.
WORK_KEYS = ("global_batch", "params", "layers", "seq_len")


def scaling_warnings(records: list[dict]) -> list[str]:
    """One line per series whose declared `scaling:` does not match how its work grows
    with the ranks: weak scaling declared but the work (global batch, model size) the same
    at every rank count, or strong scaling (the default) but the work changing."""
    work: dict[str, dict[int, tuple]] = {}
    first: dict[str, dict] = {}
    for rec in results.latest(records).values():
        p, res = rec["point"], rec.get("result")
        config = res.get("config") if rec["status"] == "ok" and isinstance(res, dict) else None
        if not isinstance(config, dict):
            continue
        first.setdefault(p["series_id"], p)
        key = tuple((k, json.dumps(config[k])) for k in WORK_KEYS if k in config)
        work.setdefault(p["series_id"], {})[p["ranks"]] = key
    out = []
    for sid, by_ranks in work.items():
        if len(by_ranks) < 2:
            continue
        p = first[sid]
        ranks = sorted(by_ranks)
        named = varying_args(records).get(p["label"], [])
        who = p["label"] + "".join(f" {k}={p['series'].get(k)}" for k in named)
        grows = len(set(by_ranks.values())) > 1
        at = ", ".join(map(str, ranks))
        if p.get("scaling", "strong") == "weak" and not grows:
            what = ", ".join(f"{k} {v}" for k, v in by_ranks[ranks[0]]) or "its config"
            out.append(
                f"{who}: scaling: weak, but the work ({what}) is the same at {at} ranks "
                "(strong scaling? efficiency is then t0/t, not speed-up x N0/N)"
            )
        elif p.get("scaling", "strong") == "strong" and grows:
            keys = [k for k, _ in by_ranks[ranks[0]]]
            changed = [k for k in keys if len({dict(v).get(k) for v in by_ranks.values()}) > 1]
            what = "; ".join(
                f"{k} " + " -> ".join(dict(by_ranks[n]).get(k, "?") for n in ranks) for k in changed
            )
            out.append(
                f"{who}: scaling: strong, but the work changes with the ranks ({what} at "
                f"{at} ranks): scaling: weak?"
            )
    return out


def scale(rows: list[dict]) -> None:
    """Measured speed-up and efficiency against the series' smallest measured point;
    predicted ones against its smallest predicted point. A predicted-only row shows the
    predicted pair as its speed-up and efficiency (it has no other)."""
    for time_key, speedup, efficiency in (
        ("iter_time_s", "speedup", "efficiency"),
        ("predicted_s", "predicted_speedup", "predicted_efficiency"),
    ):
        by_series: dict[str, list[dict]] = {}
        for r in rows:
            if r[time_key]:
                by_series.setdefault(r["series_id"], []).append(r)
        for members in by_series.values():
            base = min(members, key=lambda r: r["ranks"])
            t0, n0 = base[time_key], base["ranks"]
            for r in members:
                ratio = t0 / r[time_key]
                if r["scaling"] == "weak":
                    r[efficiency], r[speedup] = ratio, ratio * r["ranks"] / n0
                else:
                    r[speedup], r[efficiency] = ratio, ratio * n0 / r["ranks"]
    for r in rows:
        if r["predicted"]:
            r["speedup"], r["efficiency"] = r["predicted_speedup"], r["predicted_efficiency"]


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
    """Why a point did not run or failed: the record's reason (a sweep writes one for every
    such point: the exit status in words and the proxy's diagnosis), else (records of
    earlier versions) from its status, exit status and stderr."""
    if rec.get("reason"):
        return rec["reason"]
    if rec["status"] == "skipped":
        return ""
    if rec["status"] == "timeout":
        return f"timed out after {rec.get('timeout_s', '?')} s"
    line = results.diagnosis(rec.get("stderr_tail", ""))
    return line or results.failure_reason(rec.get("returncode"), "")


# -- output --------------------------------------------------------------------------------


def seconds(x: float | None) -> str:
    return "" if x is None else f"{x:.4f}"


def percent(x: float | None) -> str:
    return "" if x is None else f"{100 * x:+.1f}%"


def name(row: dict) -> str:
    return row["label"] + (f" ({row['series']})" if row["series"] else "")


def shown_name(row: dict) -> str:
    return name(row) + (" (pred)" if row["predicted"] else "")


def shown_breakdown(row: dict) -> dict[str, float]:
    """What the breakdown columns show: the measurement, or for a predicted-only row the
    prediction (the row is marked)."""
    return row["predicted_breakdown_s"] if row["predicted"] else row["breakdown_s"]


def print_table(table_rows: list[dict], title: str, out=None) -> None:
    """One table per proxy (breakdown categories differ between proxies); points that did
    not run are listed under it with the reason. With predictions, a predicted column and
    the relative error beside the measured time; predicted-only rows marked (pred)."""
    from rich.markup import escape

    from proxies.core.tables import Column, show, unique_shorts

    out = out or console()
    for proxy in dict.fromkeys(r["proxy"] for r in table_rows):
        mine = [r for r in table_rows if r["proxy"] == proxy]
        shown = [r for r in mine if r["status"] != "skipped"]
        cats = ordered({c for r in shown for c in shown_breakdown(r)}, TABLE)
        cats = [c for c in cats if not c.endswith(HIDDEN)]
        with_pred = any(r["predicted_s"] is not None or r["predicted"] for r in shown)
        if shown:
            what = "mean over ranks; (pred) rows: predicted" if with_pred else "mean over ranks"
            cols = [Column("run", number=False, key=True), Column("ranks", key=True)]
            cols += [Column("status", number=False), Column("time/iter")]
            cols += [Column("predicted"), Column("error")] if with_pred else []
            cols += [Column("speed-up"), Column("efficiency")]
            shorts = unique_shorts([abbrev(c, TABLE) for c in cats])
            cols += [
                Column(category_label(c, TABLE), short=s) for c, s in zip(cats, shorts, strict=True)
            ]
            table = []
            for r in shown:
                ok = r["status"] == "ok"
                status = ("predicted" if r["predicted"] else "ok") if ok else r["status"]
                pred = [seconds(r["predicted_s"]), percent(r["error"])] if with_pred else []
                bd = shown_breakdown(r)
                table.append(
                    [
                        escape(shown_name(r)),
                        str(r["ranks"]),
                        status if ok else f"[red]{escape(status)}[/]",
                        seconds(r["iter_time_s"]),
                        *pred,
                        "" if r["speedup"] is None else f"{r['speedup']:.2f}x",
                        "" if r["efficiency"] is None else f"{100 * r['efficiency']:.0f}%",
                        *(seconds(bd.get(c)) if bd else "" for c in cats),
                    ]
                )
            show(out, f"{title}: {proxy}, seconds per iteration (breakdown: {what})", cols, table)
            if any(r["predicted"] for r in shown):
                out.print(
                    "(pred): predicted only, on the machine model, not run; its speed-up "
                    "and efficiency are against the series' predicted time at its fewest ranks"
                )
        # Why points did not run: grouped by reason, ranks listed.
        why: dict[tuple[str, str, str], list[int]] = {}
        for r in mine:
            if r["status"] != "ok":
                why.setdefault((shown_name(r), r["status"], r["reason"]), []).append(r["ranks"])
        for (who, status, reason), ranks in why.items():
            at = ", ".join(map(str, ranks))
            color = "yellow" if status == "skipped" else "red"
            out.print(f"[{color}]{status}[/]: {escape(who)} at {at} ranks: {escape(reason)}")


def write_csv(table_rows: list[dict], path: str) -> None:
    cats = ordered({c for r in table_rows for c in r["breakdown_s"]}, TABLE)
    pcats = ordered({c for r in table_rows for c in r["predicted_breakdown_s"]}, TABLE)
    arg_names = list(dict.fromkeys(k for r in table_rows for k in r["args"]))
    cols = ["label", "series", "proxy", "scaling", "ranks", "status", "repeats", "iter_time_s"]
    cols += ["iter_time_min_s", "iter_time_median_s", "iter_time_max_s"]
    cols += ["speedup", "efficiency", "predicted", "predicted_s", "error"]
    cols += ["predicted_speedup", "predicted_efficiency"]
    cols += [f"breakdown_{c}_s" for c in cats] + [f"predicted_breakdown_{c}_s" for c in pcats]
    # One column per argument (a spreadsheet filters on it); lists and mappings as JSON.
    cols += [f"arg_{k}" for k in arg_names] + ["machine", "reason"]
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(cols)
            for r in table_rows:
                row = dict(r)
                row.update({f"arg_{k}": csv_value(r["args"].get(k)) for k in arg_names})
                row.update({f"breakdown_{c}_s": r["breakdown_s"].get(c) for c in cats})
                row.update(
                    {f"predicted_breakdown_{c}_s": r["predicted_breakdown_s"].get(c) for c in pcats}
                )
                w.writerow(["" if row.get(c) is None else row[c] for c in cols])
        os.replace(tmp, path)
    finally:
        remove(tmp)  # only left when writing failed (a full disk): no half file stays


def csv_value(v: object) -> object:
    """An argument as a CSV cell: numbers and strings as they are, flags true/false, lists
    and mappings as JSON, absent empty."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, dict)):
        return json.dumps(v, sort_keys=True)
    return v


HATCHES = ("", "..", "xx", "oo", "--", "||", "++", "**")


def styles(n: int) -> list[tuple[tuple, str]]:
    """n distinct (colour, hatch) pairs: a qualitative colormap's colours (tab10 up to 10,
    tab20 up to 20), then tab20's again with a hatch pattern per round of 20 (bars) so
    no two categories look alike."""
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    size = cmap.N
    return [(cmap(i % size), HATCHES[(i // size) % len(HATCHES)]) for i in range(n)]


def doubling(ranks: list[int]) -> bool:
    """Rank counts that (at least) double from one to the next: a log2 axis spaces them
    evenly; otherwise a linear one shows them as they are."""
    rs = sorted(set(ranks))
    return len(rs) > 1 and all(b >= 2 * a for a, b in zip(rs, rs[1:], strict=False))


def plot(table_rows: list[dict], directory: str, title: str) -> list[str]:
    """time.png, efficiency.png, breakdown.png; [] when matplotlib is not installed.
    Measurements are solid lines with filled markers; predictions (of measured points and
    predicted-only ones) dashed lines with hollow markers in the series' colour; predicted
    bars are hatched."""
    try:
        import matplotlib
        import matplotlib.ticker

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    done = [r for r in table_rows if r["iter_time_s"] or r["predicted_s"]]
    if not done:
        return []
    series: dict[str, list[dict]] = {}
    for r in done:
        series.setdefault(r["series_id"], []).append(r)
    paths = []
    colour = [c for c, _ in styles(len(series))]
    lines = ("-", "-.", ":")  # beyond 20 series, the colours repeat with another line style
    for name, keys, ylabel in (
        ("time.png", ("iter_time_s", "predicted_s"), "seconds per iteration"),
        ("efficiency.png", ("efficiency", "predicted_efficiency"), "parallel efficiency"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for k, members in enumerate(series.values()):
            members = sorted(members, key=lambda r: r["ranks"])
            r0 = members[0]
            legend = r0["label"] + (f" ({r0['series']})" if r0["series"] else "")
            legend += f" [{r0['scaling']}]"
            measured_key, predicted_key = keys
            measured = [r for r in members if not r["predicted"] and r[measured_key]]
            predicted = [r for r in members if r[predicted_key]]
            style = {"color": colour[k], "marker": "o"}
            if measured:
                xs, ys = [r["ranks"] for r in measured], [r[measured_key] for r in measured]
                ax.plot(xs, ys, label=legend, linestyle=lines[k // 20 % len(lines)], **style)
                if name == "time.png":  # error bars: min to max over every iteration
                    low = [y - r["iter_time_min_s"] for y, r in zip(ys, measured, strict=True)]
                    high = [r["iter_time_max_s"] - y for y, r in zip(ys, measured, strict=True)]
                    ax.errorbar(xs, ys, yerr=[low, high], fmt="none", ecolor=colour[k], capsize=3)
            if predicted:
                xs, ys = [r["ranks"] for r in predicted], [r[predicted_key] for r in predicted]
                ax.plot(
                    xs,
                    ys,
                    linestyle="--",
                    markerfacecolor="none",
                    label=f"{legend} predicted",
                    **style,
                )
        if doubling([r["ranks"] for r in done]):
            ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["ranks"] for r in done}))
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        if name == "time.png":
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

    bars = [r for r in done if shown_breakdown(r)]
    cats = [
        c
        for c in ordered({c for r in bars for c in shown_breakdown(r)}, TABLE)
        if not c.endswith(HIDDEN)
    ]
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(bars) + 2), 4.5))
    xs = range(len(bars))
    bottom = [0.0] * len(bars)
    for (colour, hatch), c in zip(styles(len(cats)), cats, strict=True):
        h = [shown_breakdown(r).get(c, 0.0) for r in bars]
        drawn = ax.bar(
            xs,
            h,
            bottom=bottom,
            color=colour,
            hatch=hatch or None,
            label=category_label(c, TABLE).split(" (")[0],
        )
        for patch, r in zip(drawn, bars, strict=True):
            if r["predicted"]:
                patch.set_hatch(hatch + "//")
                patch.set_alpha(0.6)
        bottom = [b + v for b, v in zip(bottom, h, strict=True)]
    ticks = [
        f"{r['label']}\n{r['series']}\n{r['ranks']} ranks{' (pred)' * r['predicted']}".replace(
            "\n\n", "\n"
        )
        for r in bars
    ]
    ax.set_xticks(list(xs), ticks, fontsize="x-small", rotation=90)
    ax.set_ylabel("seconds per iteration (mean over ranks)")
    ax.tick_params(axis="y", labelsize="small")
    ax.set_title(
        f"{title}: where the time went"
        + (" (hatched: predicted)" if any(r["predicted"] for r in bars) else "")
    )
    ax.legend(fontsize="small")
    fig.tight_layout()
    paths.append(save(fig, os.path.join(directory, "breakdown.png"), plt))
    return paths


def save(fig, path: str, plt) -> str:
    tmp = f"{path}.tmp{os.getpid()}.png"
    try:
        fig.savefig(tmp, dpi=120)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        remove(tmp)
    return path


def remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def report(directory: str, out=None, records: list[dict] | None = None) -> list[dict]:
    """Table on stdout, CSV and plots in the directory; returns the rows. OSError when they
    cannot be written (results.jsonl is only read)."""
    out = out or console()
    if records is None:
        records = results.load(os.path.join(directory, results.FILE))
    title = os.path.basename(os.path.normpath(directory))
    for line in scaling_warnings(records):
        print(f"proxies report: warning: {line}", file=sys.stderr)
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
    from proxies.core.provenance import add_version

    add_version(p)  # --version
    p.add_argument(
        "--sweep",
        metavar="FILE",
        help="the sweep file, to read the per-point JSON files that the commands of "
        "--print-commands wrote into the directory (when it has no results.jsonl)",
    )
    args = p.parse_args(argv)
    d = args.directory
    if os.path.isfile(d) and d.endswith(".jsonl"):
        d = os.path.dirname(d) or "."
    path = os.path.join(d, results.FILE)
    from_files = not os.path.isfile(path) and results.point_files(d)
    if from_files and not args.sweep:
        return fail(
            f"{d}: per-point JSON files of --print-commands runs and no {results.FILE}: "
            "name their sweep file with --sweep FILE",
            exits.USAGE,
        )
    if not os.path.isfile(path) and not from_files:
        return fail(f"{path}: no such file (run a sweep first)", exits.USAGE)
    try:
        # The CSV and plots go beside it: writable, before any work.
        results.probe_directory(d)
    except OSError as e:
        return fail(f"{d}: cannot write the report there: {e.strerror}", exits.USAGE)
    for out in (CSV_FILE, *PLOTS):
        out = os.path.join(d, out)
        if os.path.lexists(out) and not os.path.isfile(out):
            return fail(
                f"{out}: exists and is not a regular file (it would be replaced)", exits.USAGE
            )
    from proxies.sweep.schema import SweepError

    try:
        records = results.load_point_files(d, args.sweep) if from_files else results.load(path)
    except (results.ResultsError, SweepError) as e:
        return fail(str(e), exits.USAGE)
    if not records:
        return fail(f"{path}: no usable records (run a sweep first)", exits.USAGE)
    try:
        report(d, records=records)
    except OSError as e:
        return fail(f"{e.filename or d}: cannot write the report: {e.strerror}", exits.FAILED)
    return exits.OK


def fail(message: str, status: int) -> int:
    print(f"proxies report: error: {message}", file=sys.stderr)
    return status
