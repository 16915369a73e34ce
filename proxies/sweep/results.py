"""results/<name>/results.jsonl: one line per finished point, appended whole and synced, so
an interrupted sweep loses nothing and a rerun knows what is done.

A line is {"point": {id, label, proxy, ranks, args, repeat, series, scaling}, "status":
ok | failed | timeout | skipped, "command", "start", "elapsed_s", "returncode",
"stderr_tail" (failed, timeout), "reason" (skipped), "result" (the proxy's JSON, ok)}.
The last line of a point wins (--retry-failed appends a new one).
"""

from __future__ import annotations

import fcntl
import json
import os
import sys

FILE = "results.jsonl"
DONE = ("ok", "failed", "timeout")  # statuses a rerun does not repeat (skips are re-decided)


def append(path: str, record: dict) -> None:
    """Append one whole line with a single write, then fsync. A line torn by a crash of the
    machine is at worst the last one; readers skip it and the next append starts a new line."""
    data = (json.dumps(record, separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        while data:
            n = os.write(fd, data)
            data = data[n:]
        os.fsync(fd)
    finally:
        os.close(fd)


def load(path: str, warn: bool = True) -> list[dict]:
    """Every complete record, in file order (an unreadable line is reported and skipped)."""
    records = []
    try:
        f = open(path)
    except FileNotFoundError:
        return []
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                rec = None
            if not isinstance(rec, dict) or "point" not in rec or "status" not in rec:
                if warn:
                    print(f"{path}:{n}: skipping an incomplete line", file=sys.stderr)
                continue
            records.append(rec)
    return records


def latest(records: list[dict]) -> dict[str, dict]:
    """Point id -> its last record, in the order points first appear."""
    out: dict[str, dict] = {}
    for rec in records:
        out[rec["point"]["id"]] = rec
    return out


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
