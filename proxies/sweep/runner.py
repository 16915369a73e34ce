"""python -m proxies sweep FILE: expand a sweep file into points, launch each as its own MPI
job, record each in results/<name>/results.jsonl as it finishes, then report.

Exit status (proxies/core/exits.py): 0 when every point ran (or was skipped by a rule), 1
when a point failed or timed out, or when a record could not be written (a full disk: the
sweep stops, nothing torn stays; rerun to resume), 2 for a bad sweep file, bad options or an
output that cannot be written (checked before the first point), 128 + signal when
interrupted (rerun to resume).

Points of `predict_ranks` are not launched: each is one process predicting its rank count
on the run's machine model (`--dry-run --world-size N --machine FILE`); they are recorded,
resumed and reported like the others, marked predicted, and never size the allocation.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import shlex
import shutil
import signal
import sys
import time
from dataclasses import replace

from proxies.core import configs, exits, provenance
from proxies.sweep import launch, preflight, results
from proxies.sweep.schema import Point, Sweep, SweepError, expand, load

PROG = "python -m proxies sweep"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Run a YAML scaling sweep: every point its own MPI job, results appended "
        "to RESULTS/<name>/results.jsonl as each finishes (a rerun resumes), then a table, "
        "a CSV and plots (python -m proxies report RESULTS/<name> redoes them).",
    )
    p.add_argument("file", help="the sweep file, e.g. configs/smoke.yaml")
    p.add_argument("--results", default="results", metavar="DIR", help="results go to DIR/<name>/")
    p.add_argument("--fresh", action="store_true", help="discard earlier results and start over")
    p.add_argument(
        "--retry-failed",
        action="store_true",
        help="run again the points recorded as failed or timed out (the last record counts)",
    )
    p.add_argument(
        "--launcher",
        metavar="TEMPLATE",
        help="override the file's launcher: mpiexec, mpirun, srun or a template with "
        "{ranks} and {command}",
    )
    p.add_argument(
        "--print-commands",
        action="store_true",
        help="print every launch command (skipped points as comments) and run nothing",
    )
    p.add_argument(
        "--sbatch",
        metavar="FILE",
        help="write a Slurm batch script that runs this sweep inside one allocation, and "
        "run nothing",
    )
    p.add_argument(
        "--no-precheck",
        action="store_true",
        help="do not ask the proxy (--dry-run --world-size N) whether each point can run",
    )
    p.add_argument("--no-report", action="store_true", help="skip the table, CSV and plots")
    provenance.add_version(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        sweep, points = prepare(args)
        if args.sbatch:
            return write_sbatch(sweep, points, args)
        if args.print_commands:
            return print_commands(sweep, points, args)
        return execute(sweep, points, args)
    except (SweepError, results.Locked, results.ResultsError) as e:
        print(f"proxies sweep: error: {clip(str(e))}", file=sys.stderr)
        return exits.USAGE


def clip(message: str, limit: int = 2000) -> str:
    """A message quoting a value from the file (a 200 KB string) stays a readable line."""
    if len(message) <= limit:
        return message
    return f"{message[: limit - 500]} [... {len(message) - limit} characters ...] {message[-400:]}"


def prepare(args) -> tuple[Sweep, list[Point]]:
    """Load, validate and expand the file; ask the proxy about each point (unless
    --no-precheck): a point it rejects is skipped under a proxy_rejects rule, else an error."""
    sweep = load(configs.resolve(args.file))  # configs/smoke.yaml from an installed wheel too
    if args.launcher:
        try:
            launch.template(args.launcher)
        except ValueError as e:
            raise SweepError(f"--launcher: {e}") from None
        sweep = replace(sweep, launcher=args.launcher)
    points = expand(sweep)
    preflight.check(sweep, points, args)  # outputs, launcher, data files: before long work
    if args.no_precheck:
        return sweep, points
    rejected = launch.precheck(points)
    checked = []
    for p in points:
        msg = rejected.get(p.id)
        if msg and p.run.skips_rejected:
            p = replace(p, skip=f"rejected by the proxy: {msg}")
        elif msg:
            raise SweepError(
                f"{sweep.path}: {p.run.key or 'args'}: the point {p.describe()} cannot run: "
                f"{msg} (skip such points with a rule, e.g. '- proxy_rejects: true' under skip)"
            )
        checked.append(p)
    return sweep, checked


def tag(index: int, p: Point) -> str:
    """A file-name-safe name of a point: its place in the sweep and a hash of its identity."""
    return f"{index:04d}-{p.proxy}-{p.ranks}r-{hashlib.sha1(p.id.encode()).hexdigest()[:8]}"


def env_prefix(p: Point) -> str:
    return "".join(f"{k}={shlex.quote(v)} " for k, v in p.run.env)


def comment(text: str) -> str:
    """Text for a `#` line of a script: control characters (a newline would end the
    comment and start a command) written as escapes."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


# -- cluster use ---------------------------------------------------------------------------


def print_commands(sweep: Sweep, points: list[Point], args) -> int:
    outdir = os.path.join(args.results, sweep.name)
    runnable = [p for p in points if not p.skip]
    predicted = sum(p.predicted for p in runnable)
    print(
        f"# sweep {sweep.name} ({comment(sweep.path)}): {len(points)} points, "
        f"{len(runnable)} to run, "
        f"{len(points) - len(runnable)} skipped"
        + (f"; {predicted} predicted, one process each, no launcher" if predicted else "")
    )
    for i, p in enumerate(points):
        if p.skip:
            print(comment(f"# skipped: {p.describe()}: {p.skip}"))
            continue
        cmd = launch.command(p, sweep.launcher, os.path.join(outdir, f"{tag(i, p)}.json"))
        print(env_prefix(p) + launch.shell(cmd))
    return 0


def write_sbatch(sweep: Sweep, points: list[Point], args) -> int:
    """A batch script that runs the sweep itself inside one allocation, so results, resume
    and timeouts work there as here. Sized for the largest point and the sum of timeouts."""
    runnable = [p for p in points if not p.skip]
    if not runnable:
        raise SweepError("every point is skipped: nothing to submit")
    # Predicted points run inside the job too (their time counts) but on one core: the
    # allocation is sized by the measured points only.
    ranks = max((p.ranks for p in runnable if not p.predicted), default=1)
    seconds = int(sum(p.run.timeout for p in runnable)) + 600
    outdir = os.path.abspath(os.path.join(args.results, sweep.name))
    options = {
        "job-name": f"proxies-{sweep.name}",
        "ntasks": str(ranks),
        "time": f"{seconds // 86400}-{seconds // 3600 % 24:02d}:{seconds // 60 % 60:02d}:"
        f"{seconds % 60:02d}",
        "output": os.path.join(outdir, "slurm-%j.out"),
        **dict(sweep.sbatch),
    }
    for k, v in options.items():  # one line each: a newline (here, in --results) adds a line
        if not v.isprintable():
            what = f"sbatch.{k}" if k in dict(sweep.sbatch) else "--results"
            raise SweepError(f"{what}: {v!r}: a newline or control character cannot go in #SBATCH")
    passed = ["--results", os.path.abspath(args.results)]
    passed += ["--launcher", sweep.launcher] if args.launcher else []
    passed += [
        f for f, on in (("--fresh", args.fresh), ("--retry-failed", args.retry_failed)) if on
    ]
    passed += ["--no-precheck"] * args.no_precheck + ["--no-report"] * args.no_report
    sweep_cmd = [sys.executable, "-m", "proxies", "sweep", os.path.abspath(sweep.path), *passed]
    lines = [
        "#!/bin/bash",
        comment(
            f"# Sweep {sweep.name} ({sweep.path}): {len(runnable)} points to run, up to "
            f"{ranks} ranks, launched with: {launch.template(sweep.launcher)}"
        ),
        comment(f"# Written by: {PROG} {shlex.join(sys.argv[1:]) if sys.argv[1:] else sweep.path}"),
        *(f"#SBATCH --{k}={v}" for k, v in options.items()),
        "set -euo pipefail",
        f"cd {shlex.quote(os.getcwd())}",
        "exec " + shlex.join(sweep_cmd),
    ]
    tmp = os.path.join(os.path.dirname(os.path.abspath(args.sbatch)), f".sbatch-{os.getpid()}")
    try:
        os.makedirs(outdir, exist_ok=True)  # Slurm opens --output before the job starts
        with open(tmp, "w") as f:  # whole, then renamed: never half a script
            f.write("\n".join(lines) + "\n")
        os.chmod(tmp, 0o755)
        os.replace(tmp, args.sbatch)
    except OSError as e:
        print(f"proxies sweep: error: --sbatch {args.sbatch}: {e.strerror}", file=sys.stderr)
        return exits.FAILED
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    print(f"wrote {args.sbatch}: sbatch {args.sbatch}")
    return exits.OK


# -- running -------------------------------------------------------------------------------


class Stop(BaseException):
    """SIGTERM or SIGHUP: end the running point, keep what is recorded."""


def execute(sweep: Sweep, points: list[Point], args) -> int:
    outdir = os.path.join(args.results, sweep.name)
    jsonl = os.path.join(outdir, results.FILE)
    try:
        os.makedirs(outdir, exist_ok=True)
        with results.Lock(outdir):
            code = execute_locked(sweep, points, args, outdir, jsonl)
    except OSError as e:  # the sweep's own writes: records, logs (a full disk)
        return stopped(e, jsonl, len(points))
    if code is not None:
        return code

    status = exits.OK
    if not args.no_report:
        from proxies.sweep import report

        try:
            report.report(outdir)
        except OSError as e:
            print(
                f"proxies sweep: error: cannot write the report: {e.filename or outdir}: "
                f"{e.strerror} (python -m proxies report {outdir} writes it again)",
                file=sys.stderr,
            )
            status = exits.FAILED
    final = results.latest(results.load(jsonl))
    bad = [
        final[p.id]
        for p in points
        if p.id in final and final[p.id]["status"] in ("failed", "timeout")
    ]
    if bad:
        npred = sum(1 for rec in bad if rec["point"].get("predicted"))
        print(
            f"proxies sweep: {len(bad)} of {len(points)} points failed or timed out"
            + (f" ({npred} of them predictions, which launch nothing)" if npred else "")
            + ":",
            file=sys.stderr,
        )
        for rec in bad:
            why = f": {rec['reason']}" if rec.get("reason") else ""
            print(
                f"  {rec['status']}: {rec.get('describe', rec['point']['id'])}{why}",
                file=sys.stderr,
            )
        print(
            f"logs in {os.path.join(outdir, 'logs')}; --retry-failed runs them again",
            file=sys.stderr,
        )
        return exits.FAILED
    return status


def execute_locked(sweep: Sweep, points: list[Point], args, outdir: str, jsonl: str) -> int | None:
    """Record skips, run what is not done; an exit status when interrupted, else None."""
    if args.fresh:
        for old in (jsonl, os.path.join(outdir, "report.csv")):
            if os.path.exists(old):
                os.remove(old)
        shutil.rmtree(os.path.join(outdir, "logs"), ignore_errors=True)
    # tmp/ holds the JSON of points in flight; under the lock none is ours or alive.
    shutil.rmtree(os.path.join(outdir, "tmp"), ignore_errors=True)
    for sub in ("logs", "tmp"):
        os.makedirs(os.path.join(outdir, sub), exist_ok=True)
    shutil.copyfile(sweep.path, os.path.join(outdir, "sweep.yaml"))
    last = results.latest(results.load(jsonl))

    todo, before, skipped = [], 0, 0
    for i, p in enumerate(points):
        prev = last.get(p.id)
        if p.skip:
            skipped += 1
            if not (prev and prev["status"] == "skipped" and prev.get("reason") == p.skip):
                results.append(jsonl, skip_record(i, p))
        elif (
            prev
            and prev["status"] in results.DONE
            and not (args.retry_failed and prev["status"] != "ok")
        ):
            before += 1
        else:
            todo.append((i, p))
    print(
        f"sweep {sweep.name}: {len(points)} points: {len(todo)} to run, {before} done "
        f"before, {skipped} skipped · results in {jsonl}",
        flush=True,
    )

    def stop(signum, frame):
        raise Stop(signum)

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        run_points(sweep, todo, outdir, jsonl)
    except (KeyboardInterrupt, Stop) as e:
        done = len(results.latest(results.load(jsonl, warn=False)))
        print(
            f"\ninterrupted: {done} points are recorded in {jsonl}; run the same command "
            "again to resume",
            file=sys.stderr,
        )
        return 128 + (e.args[0] if isinstance(e, Stop) else signal.SIGINT)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return None


def stopped(e: OSError, jsonl: str, total: int) -> int:
    """The sweep could not write (a full disk): one line saying so and what is recorded.
    Nothing recorded is lost and no line is torn (results.append), so a rerun resumes."""
    full = e.errno in (errno.ENOSPC, errno.EDQUOT)
    what = "the disk is full" if full else (e.strerror or str(e))
    try:
        done = len(results.latest(results.load(jsonl, warn=False)))
    except results.ResultsError:
        done = 0
    print(
        f"proxies sweep: error: {what} ({e.filename or jsonl}): stopped with {done} of {total} "
        f"points recorded in {jsonl}; free space and run the same command again to resume",
        file=sys.stderr,
    )
    return exits.FAILED


def skip_record(i: int, p: Point) -> dict:
    return {
        "point": {**p.record(), "index": i},
        "describe": p.describe(),
        "status": "skipped",
        "reason": p.skip,
        "start": now(),
    }


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def run_points(sweep: Sweep, todo: list[tuple[int, Point]], outdir: str, jsonl: str) -> None:
    if not todo:
        return
    if not sys.stdout.isatty():
        for k, (i, p) in enumerate(todo, 1):
            rec = run_point(sweep, i, p, outdir, jsonl, None)
            print(f"[{k}/{len(todo)}] {summary(rec)}", flush=True)
        return

    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.table import Column

    from proxies.core.report import console

    # No refresh thread (auto_refresh off): the point's process is forked from a process
    # with one thread, and the bar is redrawn while waiting for it instead.
    short = short_names([p for _, p in todo])
    with Progress(
        SpinnerColumn(),
        TextColumn(
            "{task.description}", table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis")
        ),
        BarColumn(bar_width=20),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console(),
        auto_refresh=False,
    ) as progress:
        task = progress.add_task("", total=len(todo))
        for i, p in todo:
            progress.update(task, description=short[p.id])
            progress.refresh()
            rec = run_point(sweep, i, p, outdir, jsonl, progress.refresh)
            progress.console.print(summary(rec), markup=False, highlight=False)
            progress.advance(task)
            progress.refresh()


def short_names(points: list[Point]) -> dict[str, str]:
    """Point id -> label, ranks and only the args that vary within its run: what fits next
    to a progress bar."""
    values: dict[tuple[str, str], set[str]] = {}
    for p in points:
        for k, v in p.args:
            values.setdefault((p.run.label, k), set()).add(repr(v))
    out = {}
    for p in points:
        words = [f"{k}={v}" for k, v in p.args if len(values[(p.run.label, k)]) > 1]
        rep = f" #{p.repeat + 1}" if p.run.repeat > 1 and not p.predicted else ""
        rep += " (pred)" if p.predicted else ""
        out[p.id] = " ".join([p.run.label, f"{p.ranks} ranks", *words]) + rep
    return out


def run_point(sweep: Sweep, i: int, p: Point, outdir: str, jsonl: str, tick) -> dict:
    """Launch one point, wait (at most its timeout), append its record; returns the record."""
    name = tag(i, p)
    json_path = os.path.join(outdir, "tmp", f"{name}.{os.getpid()}.json")
    cmd = launch.command(p, sweep.launcher, json_path)
    out, err = (os.path.join(outdir, "logs", f"{name}.{x}") for x in ("out", "err"))
    start = now()
    outcome = launch.run(cmd, launch.environment(p), p.run.timeout, out, err, tick)
    rec = {
        "point": {**p.record(), "index": i},
        "describe": p.describe(),
        "status": outcome.status,
        "command": cmd,
        "env": dict(p.run.env),
        "start": start,
        "elapsed_s": round(outcome.elapsed_s, 3),
        "returncode": outcome.returncode,
        "timeout_s": p.run.timeout,
        "log": os.path.join("logs", name),
        **provenance.fields(),  # schema_version, version, commit; hosts: the sweep's own
        "launcher": sweep.launcher,  # the file's (or --launcher's), not this process's
    }
    if outcome.status == "ok":
        try:
            with open(json_path) as f:
                rec["result"] = json.load(f)
        except (OSError, ValueError) as e:
            rec["status"] = "failed"
            rec["stderr_tail"] = f"exit status 0 but no JSON results in {json_path}: {e}"
        else:
            if p.predicted and "predicted_iter_time_s" not in rec["result"]:
                rec["status"] = "failed"
                rec["stderr_tail"] = f"exit status 0 but no predicted_iter_time_s in {json_path}"
    if outcome.status != "ok" or rec["status"] != "ok":
        rec["stderr_tail"] = rec.get("stderr_tail") or launch.tail(err)
        # In words, for the summary line and the report: the exit status's meaning (a rank
        # died, no progress, corruption, loss not finite ...) and the proxy's diagnosis.
        if outcome.status == "timeout":
            rec["reason"] = f"timed out after {p.run.timeout:g} s"
        elif outcome.error:
            rec["reason"] = outcome.error
        elif outcome.status != "ok":
            rec["reason"] = results.failure_reason(outcome.returncode, rec["stderr_tail"])
        else:
            rec["reason"] = rec["stderr_tail"]
    results.append(jsonl, rec)
    if os.path.exists(json_path):
        os.remove(json_path)
    return rec


def summary(rec: dict) -> str:
    what = rec["describe"]
    if rec["status"] == "ok":
        from proxies.sweep.report import point_time, predicted_time

        t = predicted_time(rec["result"])
        pred = "" if t is None else f"predicted {t:.4g} s/iter"
        if rec["point"].get("predicted"):
            return f"{what}: ok, {pred} ({rec['elapsed_s']:.1f} s)"
        pred = f", {pred}" if pred else ""
        return (
            f"{what}: ok, {point_time(rec['result']):.4g} s/iter{pred} ({rec['elapsed_s']:.1f} s)"
        )
    if rec["status"] == "timeout":
        return f"{what}: TIMEOUT after {rec['timeout_s']:g} s"
    return f"{what}: FAILED: {rec['reason']}"
