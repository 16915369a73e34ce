"""Per-rank timings gathered on rank 0: the rich table and the JSON results."""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from proxies.core.tables import plural

HIDDEN = "_hidden"  # communication that ran under other work: not part of the iteration's sum


def union_seconds(spans: list[tuple[float, float]]) -> float:
    """Wall time covered by at least one span: concurrent requests are not counted twice
    (how a run books a category's hidden time, and the predictor alike)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


# The categories core makes, with their labels, in display order: compute and pipeline
# send/recv (core/pipeline.py) and data-parallel gradient sync first, then the categories a
# proxy adds (its Job's `categories`, its spec's), then data loading, the engine's wire casts,
# fault delays, and last idle time and overhead.
HEAD = {
    "compute": "compute",
    "pp": "pipeline send/recv",
    "dp_allreduce": "data-parallel allreduce",
    "dp_reduce_scatter": "data-parallel reduce-scatter",
    "dp_allgather": "data-parallel allgather",
}
TAIL = {
    "data": "synthetic data",
    "dtype_cast": "float32 <-> 16-bit wire casts",
    "fault_delay": "fault delay (--slow-link holds)",
    "idle": "idle (bubble, waiting for peers)",
    "overhead": "overhead (the engine's own)",
}
# Short names for the tables' column headers when full labels would not fit (a legend
# under the table spells them out); categories not listed are shortened by `abbrev`.
SHORT = {
    "compute": "comp",
    "pp": "pp",
    "dtype_cast": "cast",
    "fault_delay": "fault",
    "overhead": "ovhd",
}
KINDS = {"allreduce": "ar", "allgather": "ag", "reduce_scatter": "rs", "alltoall": "a2a"}


@dataclass(frozen=True)
class Categories:
    """Labels (in display order) and short column headers of the categories a table shows:
    core's own with those a proxy adds (`Categories.of`)."""

    labels: Mapping[str, str]
    short: Mapping[str, str]

    @classmethod
    def of(
        cls, labels: Mapping[str, str] | None = None, short: Mapping[str, str] | None = None
    ) -> Categories:
        """Core's categories with a proxy's `labels` (display order) and `short` headers."""
        return cls({**HEAD, **(labels or {}), **TAIL}, {**SHORT, **(short or {})})


CORE = Categories.of()


def ordered(categories, table: Categories = CORE) -> list[str]:
    """Display order: the table's, then unknown categories sorted, idle and overhead last,
    then the hidden ones."""
    cats = set(categories)
    hidden = sorted(c for c in cats if c.endswith(HIDDEN))
    head = [c for c in table.labels if c in cats and c not in ("idle", "overhead")]
    tail = [c for c in ("idle", "overhead") if c in cats]
    return head + sorted(cats - set(head) - set(tail) - set(hidden)) + tail + hidden


def label(category: str, table: Categories = CORE) -> str:
    labels = table.labels
    if category.endswith(HIDDEN):
        base = category[: -len(HIDDEN)]
        return f"{labels.get(base, base)}, hidden under other work"
    return labels.get(category, category)


def abbrev(category: str, table: Categories = CORE) -> str:
    """A short column header for a category: "conv_allreduce" -> "conv ar",
    "dp_reduce_scatter_hidden" -> "dp rs hid"."""
    hidden = category.endswith(HIDDEN)
    base = category[: -len(HIDDEN)] if hidden else category
    short = table.short.get(base)
    if short is None:
        short = base.replace("_", " ")
        for kind, k in KINDS.items():
            if base.endswith("_" + kind):
                short = f"{base[: -len(kind) - 1][:5]} {k}".replace("_", " ")
                break
    return short + (" hid" if hidden else "")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def summarize(rows: list[dict], table: Categories = CORE) -> dict:
    """Combine per-rank rows ({"rank", "label", "iter_s": [...], "seconds": {cat: [...]},
    "bytes": {cat: n}}) into the result fields the README lists under --json."""
    rows = sorted(rows, key=lambda r: r["rank"])
    iters = np.array([r["iter_s"] for r in rows])  # (ranks, iterations)
    cats = ordered({c for r in rows for c in r["seconds"]}, table)
    per = {c: np.array([r["seconds"].get(c, [0.0] * iters.shape[1]) for r in rows]) for c in cats}
    byte_cats = sorted({c for r in rows for c in r["bytes"]})
    return {
        "iter_time_s": iters.max(axis=0).tolist(),
        "breakdown_s": {c: per[c].mean(axis=0).tolist() for c in cats},
        "breakdown_max_s": {c: per[c].max(axis=0).tolist() for c in cats},
        "breakdown_per_rank_s": {c: per[c].mean(axis=1).tolist() for c in cats},
        "bytes": {c: [int(r["bytes"].get(c, 0)) for r in rows] for c in byte_cats},
        "rank_labels": [r["label"] for r in rows],
        **waited_for(rows),
    }


def waited_for(rows: list[dict]) -> dict:
    """`waited_for`: per rank, {peer: seconds per iteration} (waits.py), when measured."""
    if not any("waited_for" in r for r in rows):
        return {}
    return {"waited_for": [r.get("waited_for", {}) for r in rows]}


WAITS_SHOWN = 32  # ranks listed in the who-waited-for-whom table; beyond, the most idle
PEERS_SHOWN = 3


def print_waits(result: dict, out) -> None:
    """Who waited for whom: each rank's idle and the peers it waited for most."""
    from proxies.core.tables import Column, show

    waited = result.get("waited_for")
    idle = result["breakdown_per_rank_s"].get("idle")
    if not waited or idle is None or len(waited) < 2 or not any(waited):
        return
    ranks = list(range(len(waited)))
    title = f"who waited for whom: idle per rank and the {PEERS_SHOWN} peers it waited for most"
    if len(ranks) > WAITS_SHOWN:
        ranks = sorted(sorted(ranks, key=lambda r: -idle[r])[: WAITS_SHOWN // 2])
        title += f" ({len(ranks)} of {len(waited)} ranks, the most idle; all in --json)"
    cols = [
        Column("rank", key=True),
        Column("stage", number=False, key=True),
        Column("idle"),
        Column("waited for (rank: seconds)", number=False),
    ]
    labels = result["rank_labels"]
    rows = []
    for r in ranks:
        top = sorted(waited[r].items(), key=lambda kv: -kv[1])[:PEERS_SHOWN]
        rows.append(
            [str(r), labels[r], f"{idle[r]:.4f}", "   ".join(f"{p}: {s:.4f}" for p, s in top)]
        )
    show(out, title + ", seconds per iteration", cols, rows)


def stats(values: list[float]) -> dict:
    return {
        "mean": statistics.fmean(values),
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


def to_terminal() -> bool:
    """Whether this process's stdout reaches a terminal. Open MPI gives every rank a
    pseudo-terminal that its launcher reads and forwards, to a terminal or to a file alike
    (isatty() is true even under `> out.txt`), so under it (OMPI_COMM_WORLD_RANK set) the
    answer is no unless FORCE_COLOR says otherwise. MPICH and Slurm pass a pipe: isatty()."""
    if os.environ.get("FORCE_COLOR"):
        return True
    if os.environ.get("OMPI_COMM_WORLD_RANK") is not None:
        return False
    return sys.stdout.isatty()


def console():
    """A rich console deciding colour and width from what stdout really is: a terminal gets
    colour and its width; anything else no colour codes and COLUMNS or 160 columns, so
    tables are not squeezed to 80."""
    from rich.console import Console

    if to_terminal():
        return Console(file=sys.stdout, highlight=False, soft_wrap=True)
    columns = os.environ.get("COLUMNS", "")
    width = int(columns) if columns.isdigit() and int(columns) > 0 else 160
    return Console(
        file=sys.stdout, width=width, force_terminal=False, highlight=False, soft_wrap=True
    )


def print_report(
    result: dict,
    header: list[str],
    quiet: bool = False,
    predicted: bool = False,
    out=None,
    table: Categories = CORE,
) -> None:
    """The measured (or, predicted=True, the predicted) iteration: summary, categories,
    stages (on `out`, a rich console: by default `console()`); `table` names the
    categories (the job's: Job.report_categories())."""
    out = out or console()
    s = stats(result["iter_time_s"])
    n = len(result["iter_time_s"])
    summary = (
        f"time per iteration: mean {s['mean']:.4f} s, median {s['median']:.4f} s, "
        f"min {s['min']:.4f} s, max {s['max']:.4f} s over {plural(n, 'timed iteration')} "
        f"(max over ranks)"
    )
    if predicted:
        summary = f"predicted time per iteration: {s['mean']:.4f} s"
    if quiet:
        out.print(summary)
        return
    for line in header:
        out.print(line)
    out.print(summary)

    print_breakdown(result, out, mean_iter=s["mean"], predicted=predicted, table=table)
    print_stages(result, out, predicted=predicted, table=table)
    print_waits(result, out)
    if result.get("loss"):
        out.print("loss per iteration: " + " ".join(f"{x:.6f}" for x in result["loss"]))


def print_breakdown(
    result: dict, out, *, mean_iter: float, predicted: bool = False, table: Categories = CORE
) -> None:
    """Where the time went: one row per category, mean and max over ranks, share, bytes."""
    from proxies.core.tables import Column, show

    where = "where the time would go" if predicted else "where the time went"
    cols = [
        Column("category", number=False, key=True),
        Column("mean over ranks"),
        Column("max over ranks"),
        Column("share"),
        Column("bytes / rank (max)", number=False),
    ]
    rows = []
    byts = result["bytes"]
    for c, values in result["breakdown_s"].items():
        mean = statistics.fmean(values)
        mx = max(result["breakdown_per_rank_s"][c])
        moved = [k for k in byts if k == c or k.startswith(c + "_")]
        btxt = ", ".join(
            (k[len(c) + 1 :] + " " if k != c else "") + human_bytes(max(byts[k])) for k in moved
        )
        share = f"{100 * mean / mean_iter:.1f}%" if mean_iter else "-"
        if c.endswith(HIDDEN):
            share, btxt = "(overlapped)", ""
        rows.append([label(c, table), f"{mean:.4f} s", f"{mx:.4f} s", share, btxt])
    show(out, f"{where}, per iteration", cols, rows)


def print_stages(result: dict, out, *, predicted: bool = False, table: Categories = CORE) -> None:
    """Per rank group (e.g. pipeline stage): where imbalance and bubbles show. The columns
    are the breakdown table's categories, by the same names (abbreviated with a legend
    when they would not fit)."""
    from proxies.core.tables import Column, show, unique_shorts

    labels = result["rank_labels"]
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(labels):
        groups.setdefault(name, []).append(i)
    if len(groups) < 2:
        return
    per = result["breakdown_per_rank_s"]
    cats = list(per)
    shorts = unique_shorts([abbrev(c, table) for c in cats])
    cols = [Column("ranks", number=False, key=True)]
    cols += [Column(label(c, table), short=s) for c, s in zip(cats, shorts, strict=True)]
    rows = [
        [name, *(f"{np.mean([per[c][i] for i in idx]):.4f}" for c in cats)]
        for name, idx in groups.items()
    ]
    title = (
        "predicted " if predicted else ""
    ) + "per stage, mean over its ranks, seconds per iteration"
    show(out, title, cols, rows)


def write_json(path: str, result: dict | list, *, prog: str = "proxies") -> str | None:
    """Write the results as JSON: see save."""
    return save(path, json.dumps(result, indent=1) + "\n", prog=prog, suffix=".json")


def save(path: str, text: str, *, prog: str = "proxies", suffix: str = ".json") -> str | None:
    """Write atomically (a reader never sees half a file); never lose a finished run's results.

    The folder was checked before the run (cli.output_problem), but it can still fail at
    the end (disk full, folder removed): then the text goes to ./proxies-results-<time><suffix>
    or, failing that, the temp folder, and stderr says where. Returns the path written, or
    None when nothing could be written (the caller exits non-zero). No temp file is left.
    """
    problem = _write_atomic(path, text)
    if problem is None:
        return path
    name = f"proxies-results-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}{suffix}"
    for folder in (os.getcwd(), tempfile.gettempdir()):
        fallback = os.path.join(folder, name)
        if _write_atomic(fallback, text) is None:
            print(
                f"{prog}: could not write {path} ({problem}); the results are in {fallback}",
                file=sys.stderr,
                flush=True,
            )
            return fallback
    print(f"{prog}: could not write {path} ({problem}) nor a fallback", file=sys.stderr, flush=True)
    return None


def _write_atomic(path: str, text: str) -> str | None:
    """Write `text` to `path` via a temp file beside it; the problem in words, or None."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return e.strerror or str(e)
    return None


def timestamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
