"""A per-rank supervisor: who died, in which op, and a job status the launcher keeps.

Why a second process. Measured with the mpich wheel's hydra (5.0.2): when one rank is
SIGKILLed, hydra SIGKILLs every other rank within ~0.1 s (no SIGTERM first), so no survivor
can print anything, and the job's status is 9 whatever the ranks would have exited with
(hydra folds every process's wait status together; one killed by a signal wins). And
MPI_Init holds the Python interpreter lock while it waits for the ranks that have not
started, so a watchdog thread inside the rank cannot time a start-up stall.

So the process the launcher starts forks: the child is the rank (MPI, the proxy); the parent
stays a small supervisor outside MPI. It survives its rank's death, names it and the op it
was in (the rank publishes what it is doing in a shared page, the `Beacon`), and ends the job
with exits.RANK_DIED through the launcher's own abort (PMI's "abort" command on the
connection the launcher gave the process, the one MPI_Abort uses), which sets the job's
status. It also times the rank's start-up (MPI initialisation, the first collectives) until
the in-rank watchdog (mpi.Watchdog) takes over, ending a start-up stall with
exits.STALLED.

Without a launcher whose rank variables hold together (cli.env_world_size), without fork
(not POSIX), or with PROXIES_SUPERVISE=0, there is no supervisor: the in-rank watchdog still
names what each rank waits for and from whom, which names a dead or stalled peer, but a
SIGKILLed rank's job then ends as the launcher decides.
"""

from __future__ import annotations

import mmap
import os
import select
import signal
import struct
import sys
import time

from proxies.core import cli, exits

# Before an abort: the launcher forwards what the processes wrote through pipes and stops
# reading when the abort ends the job; on a loaded machine a diagnosis was lost now and then.
FORWARD_S = 0.5

# Beacon states: what the rank is doing now.
WAITING = 1  # waiting on peers: the timer runs
LOCAL = 2  # local work (building the model, calibrating, computing): no timer

_HEAD = struct.Struct("<ddiiI")  # last progress (monotonic), unused, state, watched, length
_SIZE = 4096


class Beacon:
    """What a rank is doing, in a page shared with its supervisor (anonymous shared mmap,
    created before the fork). Written by the rank at every beat, read by the supervisor.

    Tearing is harmless: the supervisor reads after the rank is dead, or reads a timestamp
    whose staleness is measured in seconds."""

    def __init__(self) -> None:
        self.page = mmap.mmap(-1, _SIZE)  # MAP_SHARED | MAP_ANONYMOUS: shared across fork
        self.watched = 0  # 1 once the in-rank watchdog times the waits
        self.set(WAITING, "start-up, before MPI initialisation")

    def set(self, state: int, what: str) -> None:
        text = what.encode("utf-8", "replace")[: _SIZE - _HEAD.size]
        _HEAD.pack_into(self.page, 0, time.monotonic(), 0.0, state, self.watched, len(text))
        self.page[_HEAD.size : _HEAD.size + len(text)] = text

    def read(self) -> tuple[float, int, int, str]:
        """(last progress, state, watched by the in-rank watchdog, what)."""
        last, _, state, watched, n = _HEAD.unpack_from(self.page, 0)
        text = bytes(self.page[_HEAD.size : _HEAD.size + n]).decode("utf-8", "replace")
        return last, state, watched, text


_beacon: Beacon | None = None


def beacon() -> Beacon | None:
    """This rank's beacon, when it has a supervisor."""
    return _beacon


def report(state: int, what: str) -> None:
    """Publish what this rank does now (no-op without a supervisor)."""
    if _beacon is not None:
        _beacon.set(state, what)


def pmi_abort(code: int, reason: str) -> bool:
    """End the job with `code` through the launcher, as MPI_Abort does: hydra's PMI-1 wire
    command on the connection it gave this process (PMI_FD). False where there is none."""
    fd = os.environ.get("PMI_FD", "")
    if not fd.isdigit():
        return False
    word = "".join(c if c.isalnum() else "_" for c in reason)[:200] or "abort"
    try:
        os.write(int(fd), f"cmd=abort exitcode={code} message={word}\n".encode())
    except OSError:
        return False
    return True


def supervise(prog: str, timeout: float) -> None:
    """Fork: the child returns and becomes the rank; the parent supervises it and never
    returns. Does nothing where a supervisor cannot work (see the module's doc)."""
    global _beacon
    if (
        os.environ.get("PROXIES_SUPERVISE", "1") == "0"
        or not hasattr(os, "fork")
        or cli.env_world_size() is None  # no launcher whose rank variables hold together
    ):
        return
    page = Beacon()
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        _die_with_parent(parent)
        _beacon = page
        return
    _supervise(prog, timeout, page, child)


def _die_with_parent(parent: int) -> None:
    """The rank must not outlive its supervisor (the launcher kills the supervisor, the
    process it knows). Linux: PR_SET_PDEATHSIG; elsewhere the in-rank watchdog notices."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the supervisor died before the prctl
        os._exit(exits.FAILED)


def _supervise(prog: str, timeout: float, page: Beacon, child: int):
    rank = cli.env_rank()
    # A Ctrl-C reaches the whole process group (hydra signals groups too): the rank
    # handles it and its status is passed on. A SIGTERM aimed at this process alone goes on
    # to the rank.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: _kill(child, signal.SIGTERM))
    try:
        pidfd = os.pidfd_open(child)
    except (AttributeError, OSError):
        pidfd = None
    period = min(0.5, timeout / 4) if timeout > 0 else 0.5
    while True:
        if pidfd is not None:
            select.select([pidfd], [], [], period)
        else:
            time.sleep(min(period, 0.05))
        pid, status = os.waitpid(child, os.WNOHANG)
        if pid == child:
            break
        last, state, watched, what = page.read()
        stuck = time.monotonic() - last
        if timeout > 0 and state == WAITING and not watched and stuck > timeout:
            if "before MPI initialisation" in what:
                why = f"has not joined the job after {stuck:.0f} s: it has not started MPI"
                why += " (a slow import, a hung file system?)"
            elif "MPI initialisation" in what:
                why = f"waited {stuck:.0f} s in MPI initialisation: some rank has not joined"
                why += " (it stalled before or while starting MPI)"
            else:
                why = f"made no progress for {stuck:.0f} s at start-up, waiting in {what}"
            print(
                f"{prog}: watchdog: rank {rank} {why}; ending the job "
                f"(--timeout {timeout:g} s, exit status {exits.STALLED}).",
                file=sys.stderr,
                flush=True,
            )
            time.sleep(1.0)  # let the other ranks' supervisors say what they wait for
            _end(exits.STALLED, f"rank {rank} stalled at start-up", child)
    if os.WIFEXITED(status):
        os._exit(os.WEXITSTATUS(status))
    sig = os.WTERMSIG(status)
    if sig in (signal.SIGINT, signal.SIGTERM):
        os._exit(exits.INTERRUPTED)
    what = page.read()[3]
    print(
        f"{prog}: rank {rank} (pid {child}) died: killed by {signal.Signals(sig).name} "
        f"while in {what}; ending the job (exit status {exits.RANK_DIED}).",
        file=sys.stderr,
        flush=True,
    )
    _end(exits.RANK_DIED, f"rank {rank} died", None)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _end(code: int, reason: str, child: int | None):
    """The launcher's abort sets the job's status and ends every rank; if there is no such
    launcher, or it lets this process go on, the rank is killed and this one exits."""
    time.sleep(FORWARD_S)  # the launcher forwards our line before its abort stops reading
    if pmi_abort(code, reason):
        time.sleep(5.0)  # hydra kills this process now; don't race it with our own exit
    if child is not None:
        _kill(child, signal.SIGKILL)
    os._exit(code)
