"""Run a command under mpiexec with a hard timeout, for multi-rank tests; any MPI.

The whole process group is killed on timeout, so a hung MPI job cannot outlive its test.

Launcher-agnostic: `flavour()` asks the venv's mpi4py which MPI it loads (once, in a
subprocess), and `launcher_env()` is what that launcher needs on a test machine. Only
environment variables, no command-line flags, so commands the tests build themselves and
jobs the sweep launches get them too (conftest.py exports them for the whole session).

Open MPI's launcher (prterun) appends a 6-line banner to stderr whenever a rank exits with a
non-zero status; no launcher setting of Open MPI 5.0.11 silences it without also turning the
job's status into 0 (measured: --prtemca prte_execute_quiet 1 prints it anyway;
--runtime-options error-nonzero-status=false makes mpiexec exit 0). `run` moves that exact
banner from `stderr` to `launcher`, so tests check what the proxies themselves print.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mpiexec() -> str:
    here = shutil.which("mpiexec", path=os.path.dirname(sys.executable))
    found = here or shutil.which("mpiexec")
    if not found:
        raise RuntimeError("mpiexec not found: run the tests through ./dev.sh test")
    return found


_PROBE = (
    "import mpi4py; mpi4py.rc.initialize = False\n"  # the version is readable before MPI_Init
    "from mpi4py import MPI; print(MPI.Get_library_version())"
)


@functools.cache
def flavour() -> str:
    """'openmpi', 'mpich' (MPICH and its derivatives) or 'other': the MPI this venv's
    mpi4py loads."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60
    ).stdout
    if "Open MPI" in out:
        return "openmpi"
    if "MPICH" in out:
        return "mpich"
    return "other"


def launcher_env() -> dict[str, str]:
    """What the launcher of `flavour()` needs here: MPICH's hydra needs nothing. Open MPI
    refuses to run as root without two variables and more ranks than cores without
    oversubscription (PRRTE's mapping policy; OMPI_MCA_rmaps_base_oversubscribe is the 4.x
    name, ignored by 5.x)."""
    if flavour() != "openmpi":
        return {}
    env = {"PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"}
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env |= {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    return env


# prterun's banner on a non-zero exit (help-prun.txt [prun:non-zero-exit]), exactly: a
# dashed line, "<tool> detected that one or more processes exited with non-zero status,",
# the first such process's name and exit code, a dashed line.
_DASH = r"-{20,}\n"
OPENMPI_BANNER = re.compile(
    _DASH + r"\S+ detected that one or more processes exited with non-zero status,\n"
    r"thus causing the job to be terminated\. The first process to do so was:\n\n"
    r"\s+Process name: \S+\n\s+Exit code:\s+(\d+)\n" + _DASH
)


def split_banner(stderr: str) -> tuple[str, str]:
    """(stderr without Open MPI's non-zero-exit banner, the banner or '')."""
    m = OPENMPI_BANNER.search(stderr)
    if m is None:
        return stderr, ""
    return stderr[: m.start()] + stderr[m.end() :], m.group(0)


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str  # what the ranks (and the launcher, but for Open MPI's banner) wrote
    launcher: str = ""  # Open MPI's non-zero-exit banner, if it printed one


def run(cmd: list[str], timeout: float = 120, env: dict | None = None, cwd: str = ROOT) -> Result:
    full_env = {**os.environ, **launcher_env(), **(env or {})}
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(
            f"timed out after {timeout} s: {' '.join(cmd)}\n{out}\n{err}"
        ) from None
    err, banner = split_banner(err)
    return Result(proc.returncode, out, err, banner)


def mpirun(
    n: int, module: str, *args: str, timeout: float = 120, env: dict | None = None
) -> Result:
    """mpiexec -n N python -m MODULE ARGS."""
    return run([mpiexec(), "-n", str(n), sys.executable, "-m", module, *args], timeout, env)
