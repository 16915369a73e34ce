"""results/<name>/results.jsonl: one line per finished point, appended whole and synced, so
an interrupted sweep loses nothing and a rerun knows what is done.

A line is {"point": {id, label, proxy, ranks, args, repeat, series, scaling}, "status":
ok | failed | timeout | skipped, "command", "start", "elapsed_s", "returncode",
"stderr_tail" (failed, timeout), "reason" (skipped, failed, timeout: in words, see
failure_reason), "result" (the proxy's JSON, ok)}. The last line of a point wins
(--retry-failed appends a new one). A line that is not such a record is skipped with a
warning by every reader (a sweep reruns its point).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import signal
import stat
import sys
import tempfile

from proxies.core import exits

FILE = "results.jsonl"
DONE = ("ok", "failed", "timeout")  # statuses a rerun does not repeat (skips are re-decided)
STATUSES = (*DONE, "skipped")
MAX_LINE = 64 << 20  # bytes of one record: longer is not one of ours
MAX_WARNINGS = 10  # bad lines named one by one; the rest are counted
MAX_RANKS = 2**31 - 1  # an MPI int (and speed-ups divide by it as a float)
MAX_SECONDS = 1e15  # a time beyond this is not a measurement (and would overflow sums)
# The system calls that append a record, by name here so tests can make the disk full.
write, fsync = os.write, os.fsync


class ResultsError(Exception):
    """The results file cannot be read or written: one line, the path first."""


def append(path: str, record: dict) -> None:
    """Append one whole line with a single write on an O_APPEND descriptor, then fsync.

    Never a torn line: when the write is short or fails (a full disk) or the fsync fails,
    the file is truncated back to its size before, and OSError is raised (the caller stops
    and says which points are recorded). A line torn by a crash of the machine is at worst
    the last one; readers skip it and the next append starts a new line."""
    data = (json.dumps(record, separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        try:
            n = write(fd, data)
            if n != len(data):
                raise OSError(errno.ENOSPC, f"No space left on device (wrote {n} of {len(data)})")
            fsync(fd)
        except OSError as e:
            try:
                os.ftruncate(fd, size)
            except OSError:
                pass  # nothing more can be done; the reader skips a torn line
            raise OSError(e.errno, e.strerror, path) from None
    finally:
        os.close(fd)


def load(path: str, warn: bool = True) -> list[dict]:
    """Every usable record, in file order. A line that is not one (binary data, a torn
    line, JSON of another shape, wrong types, empty lists) is skipped with a warning naming
    the file and line (the first MAX_WARNINGS; then a count). ResultsError when the file
    exists but cannot be read."""
    records, bad = [], 0
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block us
    except FileNotFoundError:
        return []
    except OSError as e:
        raise ResultsError(f"{path}: cannot read: {e.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ResultsError(f"{path}: cannot read: not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            n = 0
            while True:
                line = f.readline(MAX_LINE + 1)
                if not line:
                    break
                n += 1
                why = None
                if len(line) > MAX_LINE and not line.endswith(b"\n"):
                    while line and not line.endswith(b"\n"):  # the rest of the long line
                        line = f.readline(MAX_LINE)
                    why = f"longer than {MAX_LINE} bytes"
                elif not line.strip():
                    continue
                else:
                    rec, why = parse_line(line)
                if why is None:
                    records.append(rec)
                    continue
                bad += 1
                if warn and bad <= MAX_WARNINGS:
                    print(f"{path}:{n}: skipping a line: {why}", file=sys.stderr)
    except OSError as e:
        raise ResultsError(f"{path}: cannot read: {e.strerror}") from None
    finally:
        os.close(fd)
    if warn and bad > MAX_WARNINGS:
        print(f"{path}: {bad} lines skipped in all", file=sys.stderr)
    return records


def parse_line(line: bytes) -> tuple[dict | None, str | None]:
    """(record, None), or (None, why the line is not a usable record)."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"not UTF-8 text (byte {e.start})"
    try:
        rec = json.loads(text)
    except (ValueError, RecursionError):  # torn, not JSON, nested past the parser's stack
        return None, "not a complete JSON record (torn or not JSON)"
    return (rec, None) if (why := problem(rec)) is None else (None, why)


def problem(rec: object) -> str | None:
    """None when `rec` has what the runner and the report read, with the right types; else
    what is wrong, in words."""
    if not isinstance(rec, dict):
        return "not a JSON object"
    if rec.get("status") not in STATUSES:
        return f"status is not one of {', '.join(STATUSES)}"
    p = rec.get("point")
    if not isinstance(p, dict):
        return "no point object"
    for key, typ in (("id", str), ("label", str), ("proxy", str), ("series_id", str)):
        if not isinstance(p.get(key), typ):
            return f"point.{key} is not a string"
    for key in ("args", "series"):
        if not isinstance(p.get(key), dict):
            return f"point.{key} is not an object"
    if not (integer(p.get("ranks")) and 0 < p["ranks"] <= MAX_RANKS):
        return "point.ranks is not a positive integer (an MPI int)"
    for key in ("index", "repeat"):
        if key in p and not integer(p[key]):
            return f"point.{key} is not an integer"
    if p.get("scaling", "strong") not in ("strong", "weak"):
        return "point.scaling is not strong or weak"
    if not isinstance(p.get("predicted", False), bool):
        return "point.predicted is not true or false"
    if not isinstance(p.get("machine", ""), str):
        return "point.machine is not a string"
    for key in ("describe", "reason", "stderr_tail"):
        if key in rec and not isinstance(rec[key], str):
            return f"{key} is not a string"
    if rec.get("returncode") is not None and not integer(rec["returncode"]):
        return "returncode is not an integer"
    for key in ("elapsed_s", "timeout_s"):
        if key in rec and not seconds(rec[key]):
            return f"{key} is not a number of seconds"
    if rec["status"] == "ok":
        return result_problem(rec.get("result"), p.get("predicted", False))
    return None


def result_problem(res: object, predicted: bool) -> str | None:
    if not isinstance(res, dict):
        return "an ok record without a result object"
    times = res.get("iter_time_s")  # a predicted point's is not read
    if not predicted and not (isinstance(times, list) and times and all(map(seconds, times))):
        return "result.iter_time_s is not a non-empty list of seconds"
    pred = res.get("predicted_iter_time_s")
    if (predicted or pred is not None) and not seconds(pred):
        return "result.predicted_iter_time_s is not a number of seconds"
    bd = res.get("breakdown_s", {})
    if not isinstance(bd, dict) or not all(
        isinstance(v, list) and all(number(x) for x in v) for v in bd.values()
    ):
        return "result.breakdown_s is not an object of lists of numbers"
    pbd = res.get("predicted_breakdown_s", {})
    if not isinstance(pbd, dict) or not all(number(x) for x in pbd.values()):
        return "result.predicted_breakdown_s is not an object of numbers"
    return None


def integer(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def number(x: object) -> bool:
    """A finite number of sane size (ints of any size compare without converting)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and abs(x) <= MAX_SECONDS


def seconds(x: object) -> bool:
    return number(x) and x >= 0


def latest(records: list[dict]) -> dict[str, dict]:
    """Point id -> its last record, in the order points first appear."""
    out: dict[str, dict] = {}
    for rec in records:
        out[rec["point"]["id"]] = rec
    return out


# -- why a point failed ---------------------------------------------------------------------

# What MPI launchers add after a rank's own message: not the diagnosis.
LAUNCHER_NOISE = re.compile(
    r"^(=+|BAD TERMINATION|PID \d+|RUNNING AT|EXIT CODE|CLEANING UP|YOUR APPLICATION|"
    r"This typically refers|Please see the FAQ|\[mpiexec@|\[proxy:)"
)


def diagnosis(stderr_tail: str) -> str:
    """The proxy's own last line (`proxies.X: ...`), else the last line that is not a
    launcher's banner, else ""."""
    lines = [x.strip() for x in stderr_tail.splitlines() if x.strip()]
    for line in reversed(lines):
        if line.startswith("proxies"):
            return line
    for line in reversed(lines):
        if not LAUNCHER_NOISE.match(line):
            return line
    return ""


def failure_reason(returncode: int | None, stderr_tail: str) -> str:
    """A failed point's reason in words: the meaning of its exit status (exits.py: a rank
    died, no progress, corruption found, loss not finite ...) and the proxy's diagnosis."""
    line = diagnosis(stderr_tail)
    if returncode is None:
        what = "did not start"
    elif returncode < 0:
        try:
            what = f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            what = f"killed by signal {-returncode}"
    elif returncode in exits.MEANING and returncode != exits.OK:
        what = f"{exits.MEANING[returncode]} (exit status {returncode})"
    else:
        what = f"exit status {returncode}"
    return f"{what}: {line}" if line else f"{what}, nothing on stderr"


def probe_directory(directory: str) -> None:
    """Make `directory` if needed and create and remove a file in it: OSError if it cannot
    be written (checked before work, so nothing long runs for results that cannot be kept)."""
    os.makedirs(directory, exist_ok=True)
    fd, probe = tempfile.mkstemp(dir=directory, prefix=".probe-")
    os.close(fd)
    os.remove(probe)


class Locked(Exception):
    """Another sweep holds the results directory."""


class Lock:
    """One sweep at a time per results directory (released by the kernel if we die)."""

    def __init__(self, directory: str):
        self.path = os.path.join(directory, ".lock")
        self.fd: int | None = None

    def __enter__(self) -> Lock:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise Locked(
                f"another sweep is writing to {os.path.dirname(self.path)} (lock {self.path})"
            ) from None
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


# -- the per-point JSON files of --print-commands runs ---------------------------------------

POINT_FILE = re.compile(r"^\d{4,}-[A-Za-z0-9_]+-\d+r-[0-9a-f]{8}\.json$")  # runner.tag + .json


def point_files(directory: str) -> list[str]:
    """The names of the per-point result files in `directory` (those --print-commands'
    commands write: `<index>-<proxy>-<ranks>r-<hash of the point>.json`)."""
    try:
        return sorted(f for f in os.listdir(directory) if POINT_FILE.match(f))
    except OSError:
        return []


def load_point_files(directory: str, sweep_path: str, warn: bool = True) -> list[dict]:
    """Records, as results.jsonl would hold them, for the points of the sweep file whose
    JSON file is in `directory` (found by the name --print-commands gave it: the same
    sweep file gives the same names). A file that is not a usable result is skipped with a
    warning; points without a file are not run yet and counted. SweepError when the sweep
    file cannot be loaded."""
    from proxies.sweep import runner, schema  # they build on this module

    sweep = schema.load(sweep_path)
    records, missing = [], 0
    for i, p in enumerate(schema.expand(sweep)):
        point = {**p.record(), "index": i}
        if p.skip:
            records.append({"point": point, "status": "skipped", "reason": p.skip})
            continue
        path = os.path.join(directory, runner.tag(i, p) + ".json")
        try:
            with open(path, "rb") as f:
                line = f.read(MAX_LINE + 1)
        except FileNotFoundError:
            missing += 1
            continue
        except OSError as e:
            raise ResultsError(f"{path}: cannot read: {e.strerror}") from None
        rec = {"point": point, "status": "ok"}
        try:
            rec["result"] = json.loads(line.decode("utf-8"))
        except (ValueError, RecursionError):
            rec["result"] = None
        why = problem(rec)
        if why is None:
            records.append(rec)
        elif warn:
            print(f"{path}: skipping: {why}", file=sys.stderr)
    if warn and missing:
        print(
            f"{directory}: {missing} points of {sweep_path} have no JSON file yet", file=sys.stderr
        )
    return records
