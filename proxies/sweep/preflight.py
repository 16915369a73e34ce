"""What a sweep checks after its file is validated and before any long work (the proxies'
prechecks, the first point): that what it will write can be written and what its points
need is there. Each problem is a SweepError (one line, exit 2).

- outputs: the results directory (made if needed, a file created and removed in it, and
  results.jsonl, when it exists, a regular file opened for appending); --sbatch's file
  (its directory exists and takes a new file; not a directory, not a device);
- when points are launched (not --print-commands, not --sbatch): the launcher's program is
  on PATH (shutil.which), unless every point is skipped or predicted;
- when points run here or in the batch job (not --print-commands): every `data:` file a
  point to run names exists and can be read (relative paths from the current directory,
  where the points run).
"""

from __future__ import annotations

import os
import shutil
import stat

from proxies.sweep import launch, results
from proxies.sweep.schema import Point, Sweep, SweepError

DATA_ARGS = ("data",)  # proxy arguments naming an input file (gpt2, gpt3: --data FILE)


def check(sweep: Sweep, points: list[Point], args) -> None:
    """All the checks for the mode `args` selects (see the module's docstring)."""
    if args.print_commands and not args.sbatch:
        return  # prints only: nothing is written, nothing launched here
    results_dir(os.path.join(args.results, sweep.name))
    if args.sbatch:
        new_file(args.sbatch, "--sbatch")
    else:
        launcher(sweep, points, "--launcher" if args.launcher else "launcher")
    data_files(sweep, points)


def results_dir(outdir: str) -> None:
    try:
        results.probe_directory(outdir)
        jsonl = os.path.join(outdir, results.FILE)
        if os.path.lexists(jsonl):
            fd = os.open(jsonl, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise SweepError(f"--results: {jsonl}: not a regular file")
            finally:
                os.close(fd)
    except OSError as e:
        where = e.filename or outdir
        raise SweepError(f"--results: cannot write results to {where}: {e.strerror}") from None


def new_file(path: str, option: str) -> None:
    """`path` can be written whole (by a temporary file beside it, then a rename)."""
    if os.path.isdir(path):
        raise SweepError(f"{option}: {path}: is a directory")
    if os.path.lexists(path) and not os.path.isfile(path):
        raise SweepError(f"{option}: {path}: exists and is not a regular file")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise SweepError(f"{option}: {path}: no such directory {folder}")
    try:
        results.probe_directory(folder)
    except OSError as e:
        raise SweepError(f"{option}: {path}: cannot write in {folder}: {e.strerror}") from None


def launcher(sweep: Sweep, points: list[Point], key: str) -> None:
    launched = [p for p in points if not p.skip and not p.predicted]
    if not launched:
        return
    program = launch.command(launched[0], sweep.launcher, None)[0]
    if shutil.which(program) is None:
        raise SweepError(
            f"{sweep.path}: {key}: {program!r} is not on PATH: it would launch "
            f"{len(launched)} points (--print-commands and --sbatch only write them out)"
        )


def data_files(sweep: Sweep, points: list[Point]) -> None:
    checked: set[str] = set()
    for p in points:
        if p.skip:
            continue
        args = dict(p.args)
        for dest in DATA_ARGS:
            if dest not in args or not isinstance(args[dest], str) or args[dest] in checked:
                continue
            file = args[dest]
            problem = readable(file)
            if problem:
                key = next((w for d, _, w in p.run.args if d == dest), "args")
                raise SweepError(
                    f"{sweep.path}: {key}: {file}: {problem} (points run in {os.getcwd()})"
                )
            checked.add(file)


def readable(path: str) -> str | None:
    """None when `path` is a regular file that can be opened for reading, else why not."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        return e.strerror
    except ValueError:
        return "not a file name"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return "not a regular file"
    finally:
        os.close(fd)
    return None
