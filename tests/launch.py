"""Run a command under mpiexec with a hard timeout, for multi-rank tests.

The whole process group is killed on timeout, so a hung MPI job cannot outlive its test.
"""

from __future__ import annotations

import os
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


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def run(cmd: list[str], timeout: float = 120, env: dict | None = None, cwd: str = ROOT) -> Result:
    full_env = {**os.environ, **(env or {})}
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
    return Result(proc.returncode, out, err)


def mpirun(
    n: int, module: str, *args: str, timeout: float = 120, env: dict | None = None
) -> Result:
    """mpiexec -n N python -m MODULE ARGS."""
    return run([mpiexec(), "-n", str(n), sys.executable, "-m", module, *args], timeout, env)
