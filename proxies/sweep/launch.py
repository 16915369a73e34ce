"""Launching points: the launcher template, the command of one point, running it with a
timeout that ends its whole process group, and asking the proxy whether a point can run.

    mpiexec -n {ranks} {command}         the default (mpirun and srun likewise)
    {command} is `python -m proxies.<proxy> POSITIONALS --option value ... --json PATH`

A predicted-only point (predict_ranks) is no launch: one process, `{command} --dry-run
--world-size N` with the machine options, which predicts N ranks without MPI.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from proxies.sweep.launchers import template
from proxies.sweep.schema import Point

KILL_GRACE_S = 3.0  # SIGTERM first (srun and mpiexec then clean up their ranks), then SIGKILL
PRECHECK_TIMEOUT_S = 300.0


def proxy_command(point: Point, json_path: str | None, machine: bool = True) -> list[str]:
    """`python -m proxies.<proxy> ...`, with the run's machine options unless machine=False
    (the precheck only asks whether the point can be planned)."""
    cmd = [sys.executable, "-m", f"proxies.{point.proxy}", *point.argv]
    if machine:
        cmd += point.machine_argv
    return cmd + (["--json", json_path] if json_path else [])


def command(point: Point, launcher: str, json_path: str | None) -> list[str]:
    """The full command of a point: launched, or one process for a predicted point."""
    if point.predicted:
        return proxy_command(point, json_path) + ["--dry-run", "--world-size", str(point.ranks)]
    words = []
    for w in shlex.split(template(launcher)):
        if w == "{command}":
            words += proxy_command(point, json_path)
        else:
            words.append(w.replace("{ranks}", str(point.ranks)))
    if words[0] in ("mpiexec", "mpirun"):
        # The MPI next to this Python (the mpich wheel in a venv) before the one on PATH:
        # the launcher must match the library mpi4py was built against.
        here = shutil.which(words[0], path=os.path.dirname(sys.executable))
        words[0] = here or words[0]
    return words


def environment(point: Point) -> dict[str, str]:
    """The environment a point runs in: ours, minus the BLAS thread counts that importing
    `proxies` set for this process (each rank must choose its own), plus the run's env."""
    from proxies.core import threads

    env = dict(os.environ)
    if threads.decision and not threads.decision[3].startswith("user"):
        for var in threads.BLAS_VARS:
            if env.get(var) == str(threads.decision[0]):
                env.pop(var)
    env.update(dict(point.run.env))
    return env


@dataclass
class Outcome:
    status: str  # ok | failed | timeout
    returncode: int | None
    elapsed_s: float
    error: str = ""  # why it could not be started (returncode None)


def run(
    cmd: list[str],
    env: dict[str, str],
    timeout: float,
    out: str,
    err: str,
    tick: Callable[[], None] | None = None,
) -> Outcome:
    """Run cmd with stdout and stderr to files, calling `tick` about 4 times a second while
    it runs; past `timeout` seconds (or on any exception here, e.g. Ctrl-C) its whole
    process group is ended. A command that cannot be started (not found, not executable,
    arguments too long) is a failed outcome with the reason, also written to `err`; OSError
    from opening the log files (a full disk) is raised: that is the sweep's own problem."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    with open(out, "wb") as fo, open(err, "wb") as fe:
        try:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=fo,
                stderr=fe,
                env=env,
                start_new_session=True,  # its own process group: a timeout ends all of it
                preexec_fn=die_with_parent(),
            )
        except (OSError, ValueError) as e:
            why = f"cannot start {cmd[0]}: {getattr(e, 'strerror', None) or e}"
            fe.write((why + "\n").encode(errors="replace"))
            return Outcome("failed", None, time.monotonic() - t0, why)
        try:
            while True:
                try:
                    rc = proc.wait(timeout=max(0.0, min(0.25, deadline - time.monotonic())))
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() >= deadline:
                        end_group(proc)
                        return Outcome("timeout", None, time.monotonic() - t0)
                    if tick:
                        tick()
        except BaseException:
            end_group(proc)
            raise
    return Outcome("ok" if rc == 0 else "failed", rc, time.monotonic() - t0)


def die_with_parent() -> Callable[[], None] | None:
    """On Linux, a pre-exec hook asking for SIGKILL when the sweep dies, so a killed sweep
    leaves no launcher running. Looked up here, in the parent: the hook itself only calls
    prctl (no imports, no allocation worth the name, between fork and exec)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    PR_SET_PDEATHSIG = 1
    kill = int(signal.SIGKILL)

    def hook() -> None:
        prctl(PR_SET_PDEATHSIG, kill)

    return hook


def end_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            if sig == signal.SIGTERM:
                # The launcher is gone; whatever it left in the group goes too.
                os.killpg(proc.pid, signal.SIGKILL)
            break
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            break
    proc.wait()


def tail(path: str, lines: int = 20, chars: int = 4000) -> str:
    """The last lines of a log file, for the record of a failed point."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - chars))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


# -- asking the proxy ----------------------------------------------------------------------


def precheck(points: list[Point], workers: int | None = None) -> dict[str, str]:
    """Plan each distinct point with `--dry-run --world-size N` (one process per point, in
    parallel); returns {point id: the proxy's message} for the points it rejects as bad
    input (exit status 2, the proxies' contract). A dry run that crashes rejects nothing:
    the point runs, fails and is recorded with its stderr like any failing point."""
    todo: dict[tuple, Point] = {}
    for p in points:
        if p.skip is None and (p.run.precheck or p.run.skips_rejected):
            todo.setdefault((p.proxy, p.ranks, p.argv), p)
    workers = workers or max(1, min(8, os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        verdicts = dict(zip(todo, pool.map(dry_run, todo.values()), strict=True))
    out = {}
    for p in points:
        msg = verdicts.get((p.proxy, p.ranks, p.argv))
        if msg:
            out[p.id] = msg
    return out


def dry_run(point: Point) -> str | None:
    """The proxy's one-line message when it rejects the point (exit status 2), else None."""
    cmd = proxy_command(point, None, machine=False)
    cmd += ["--dry-run", "--world-size", str(point.ranks)]
    try:
        r = subprocess.run(
            cmd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            env=environment(point),
            timeout=PRECHECK_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return None  # slow to plan is not impossible
    except (OSError, ValueError):
        return None  # cannot start: the point fails when launched, with the reason
    if r.returncode != 2:
        return None
    lines = [x.strip() for x in r.stderr.splitlines() if x.strip()]
    return lines[-1] if lines else "--dry-run exited with status 2"


def shell(cmd: list[str]) -> str:
    return shlex.join(cmd)
