"""Starting MPI, describing it, and failing as one job instead of N processes."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import NoReturn

from proxies.core import exits

THREAD_LEVELS = {0: "single", 1: "funneled", 2: "serialized", 3: "multiple"}


def init():
    """Start MPI at thread level multiple (which also keeps MPICH off its shared-memory
    collectives, which spin and collapse when ranks outnumber cores) and return the MPI
    module."""
    import mpi4py

    mpi4py.rc.thread_level = "multiple"
    from mpi4py import MPI

    return MPI


def describe(MPI) -> dict:
    import mpi4py

    cvars = {k: v for k, v in os.environ.items() if k.startswith(("MPIR_CVAR_", "OMPI_MCA_"))}
    return {
        "library": " ".join(MPI.Get_library_version().split("\n")[0].split()),
        "standard": ".".join(map(str, MPI.Get_version())),
        "mpi4py": mpi4py.__version__,
        "thread_level": THREAD_LEVELS.get(MPI.Query_thread(), str(MPI.Query_thread())),
        "env": cvars,
    }


def agree(comm, error: str | None, prog: str) -> None:
    """Collective: if any rank has an error, the lowest such rank prints it; all exit 2.

    For checks whose outcome may differ between ranks (a file present on one node only).
    """
    from mpi4py import MPI

    first = comm.allreduce(comm.rank if error else comm.size, op=MPI.MIN)
    if first < comm.size:
        if comm.rank == first:
            print(f"{prog}: error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)


def abort_on_exception(comm, prog: str) -> None:
    """An uncaught exception on one rank prints its traceback once and aborts the job, so
    the other ranks do not wait forever for a peer that is gone."""

    def hook(kind, value, tb):
        text = "".join(traceback.format_exception(kind, value, tb))
        print(f"{prog}: rank {comm.rank} failed:\n{text}", file=sys.stderr, flush=True)
        comm.Abort(1)

    sys.excepthook = hook


# What the run is doing now, for the line Ctrl-C prints (the runner points it at the
# watchdog's last beat: "iteration 3 op 5/20: allreduce ...").
_where: Callable[[], str] | None = None
INTERRUPT_GRACE_S = 2.0  # how long other ranks leave rank 0 to say it and end the job


def set_where(where: Callable[[], str] | None) -> None:
    global _where
    _where = where


def interrupted(prog: str) -> NoReturn:
    """Ctrl-C (the launcher forwards SIGINT to every rank): one line, exit 130, no traceback.

    Rank 0 prints and aborts the job. Other ranks stay quiet for a grace period, the time
    rank 0 needs; a rank still alive after it (rank 0 blocked inside a C MPI call, which
    Python cannot interrupt) says it itself and aborts, so the job never hangs.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not raise mid-exit
    where = "while starting"
    if _where is not None:
        try:
            what = _where()
            where = f"in {what}" if what.startswith("iteration") else f"while {what}"
        except Exception:  # noqa: BLE001 (the line matters more than the detail)
            pass
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
        from proxies.core import cli

        cli.say(f"{prog}: interrupted {where}")
        sys.exit(exits.INTERRUPTED)
    comm = MPI.COMM_WORLD
    if comm.rank != 0:
        time.sleep(INTERRUPT_GRACE_S)
    rank = f" (rank {comm.rank})" if comm.rank else ""
    sys.stdout.flush()
    print(f"{prog}: interrupted {where}{rank}", file=sys.stderr, flush=True)
    comm.Abort(exits.INTERRUPTED)
    os._exit(exits.INTERRUPTED)  # should MPI_Abort return


class Watchdog:
    """Turns a run that cannot progress into a diagnosis.

    The engine calls `beat(what)` before every op. If no beat arrives for `timeout` seconds,
    this rank prints what it was waiting for and aborts the whole job.
    """

    def __init__(self, comm, prog: str, timeout: float):
        self.comm, self.prog, self.timeout = comm, prog, timeout
        self.what = "starting"
        self.last = time.monotonic()
        self._stop = threading.Event()
        self._thread = None
        if timeout > 0:
            self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
            self._thread.start()

    def beat(self, what: str) -> None:
        self.what = what
        self.last = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        period = min(1.0, self.timeout / 4)
        while not self._stop.wait(period):
            stuck = time.monotonic() - self.last
            if stuck > self.timeout:
                print(
                    f"{self.prog}: watchdog: rank {self.comm.rank} made no progress for "
                    f"{stuck:.0f} s, stuck in {self.what}. A peer may have died, stalled, or "
                    f"sent a message that does not match; aborting the job "
                    f"(--timeout {self.timeout:g} s).",
                    file=sys.stderr,
                    flush=True,
                )
                time.sleep(1.0)  # let other stuck ranks say what they wait for
                self.comm.Abort(3)
