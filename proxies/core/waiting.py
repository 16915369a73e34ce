"""How a rank waits for its peers, and how its non-blocking collectives keep moving.

Waiting: MPI libraries busy-poll while they wait. With more ranks than cores that polling
takes the cores from the ranks that have work (32 ranks on 2 cores: the last stage computed
at a tenth of its speed). In "yield" mode every wait is a non-blocking test followed by a
short sleep, backing off from 20 us to 1 ms; it costs up to ~1 ms latency per wait, which is
why it is the default only for oversubscribed nodes (`Waiter`).

Progress: an MPI without asynchronous progress advances a posted collective only inside MPI
calls; `Progress` is the helper thread that keeps testing them while the rank computes.
"""

from __future__ import annotations

import math
import threading
import time

SPIN_FIRST = 50e-6  # seconds a yielding wait tests without sleeping
FIRST_SLEEP = 2e-5  # then it sleeps this long, twice as long after each test, up to max_sleep
MAX_SLEEP = 1e-3


def sleep_lengths(max_sleep: float = MAX_SLEEP) -> list[float]:
    """A yielding wait's sleeps between tests until they stop growing: 20 us, 40 us ...,
    then max_sleep (every later sleep is that long)."""
    out, d = [], FIRST_SLEEP
    while d < max_sleep:
        out.append(d)
        d *= 2
    return [*out, max_sleep]


def yield_sees(x: float, wake: float = 0.0, max_sleep: float = MAX_SLEEP) -> float:
    """When a yielding wait (Waiter._poll) that began at 0 sees what became ready at x: at
    once while it spins, then at its next test; each sleep lasts `wake` longer than asked
    (the kernel's timer slack and the wake-up, ~70 us on Linux). The predictor's model of
    a crowded run's waits."""
    if x <= SPIN_FIRST:
        return max(x, 0.0)
    *growing, longest = sleep_lengths(max_sleep)
    t = SPIN_FIRST
    for delay in growing:
        t += delay + wake
        if t >= x:
            return t
    step = longest + wake
    return t + step * max(1, math.ceil((x - t) / step - 1e-12))


class Waiter:
    """Blocking MPI waits ("spin", the library's own) or test-and-sleep ("yield")."""

    def __init__(self, MPI, mode: str, max_sleep: float = MAX_SLEEP):
        self.MPI, self.yielding, self.max_sleep = MPI, mode == "yield", max_sleep

    def _poll(self, ready, others=None):
        # Test back to back for a moment first: MPI's non-blocking schedules advance only
        # inside a test, so a sleep between the rounds of a small collective costs a round.
        # `others` tests the rank's other pending requests each round: one test call moves
        # about one step of one pending schedule (MPICH: k allreduces pending under one
        # Testall take k times one's rounds), so each needs its own call to keep moving.
        deadline = time.perf_counter() + SPIN_FIRST
        while time.perf_counter() < deadline:
            out = ready()
            if out:
                return out
            if others is not None:
                others()
        delay = FIRST_SLEEP
        while True:
            out = ready()
            if out:
                return out
            if others is not None:
                others()
            time.sleep(delay)
            delay = min(2 * delay, self.max_sleep)

    def probe(self, comm, source: int, tag: int, status, others=None):
        if not self.yielding:
            return comm.Mprobe(source, tag, status)
        return self._poll(lambda: comm.Improbe(source, tag, status), others)

    def waitall(self, reqs: list, others=None) -> None:
        """Complete reqs; a yielding wait also calls `others` (tests of the rank's other
        pending requests) between its tests."""
        if not self.yielding:
            self.MPI.Request.Waitall(reqs)
        elif reqs:
            self._poll(lambda: self.MPI.Request.Testall(reqs), others)

    def barrier(self, comm) -> None:
        if not self.yielding:
            comm.Barrier()
        else:
            self.waitall([comm.Ibarrier()])


def test_each(MPI, entries) -> int:
    """Test each incomplete entry of the engine's pending table with its own call (one MPI
    test moves about one step of one pending schedule), noting when it completes (entry[5]);
    the progress thread's round and a yielding wait's. Returns how many were incomplete."""
    Testall, Wtime = MPI.Request.Testall, MPI.Wtime
    waiting = [e for e in entries if e[5] is None]
    for entry in waiting:
        if Testall(entry[2]):
            entry[5] = Wtime()
    return len(waiting)


class Progress:
    """A helper thread that tests the pending non-blocking collectives every `interval`
    seconds, as a GPU's communication stream or NCCL's proxy thread keeps them moving:
    an MPI without asynchronous progress advances a posted allreduce only inside MPI calls,
    so a rank busy computing (or sleeping, in model/replay compute) would leave it where it
    was. It notes each one's completion time (the end of its hidden span).

    MPI forbids two threads completing the same request, so the engine holds `lock` while
    it starts, tests or waits for requests itself; the thread tests only under it. Needs
    MPI_THREAD_MULTIPLE.
    """

    def __init__(self, MPI, pending: dict, interval: float = 1e-4):
        self.MPI, self.pending, self.interval = MPI, pending, interval
        self.lock = threading.Lock()
        self.active = threading.Event()
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="proxies-mpi-progress", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            self.active.wait()
            with self.lock:
                if self.closed:
                    return
                if not test_each(self.MPI, self.pending.values()):
                    self.active.clear()  # until the engine posts another
            time.sleep(self.interval)

    def resume(self) -> None:
        self.active.set()

    def close(self) -> None:
        with self.lock:
            self.closed = True
        self.active.set()
        self.thread.join()
