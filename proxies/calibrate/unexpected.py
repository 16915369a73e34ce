"""What an unexpected message costs a crowded rank's wait (calibrate's `oversubscribed.unexpected`).

A rank whose yielding wait (test, then a sleep doubling to 1 ms) is inside a collective the
MPI library runs advances that collective only inside its tests. A message that arrives for
an op the rank has not posted yet goes to MPI's unexpected queue, and MPICH takes in one
arrival per test: each such message takes a test from the collective, which then moves a
backed-off test (about 1 ms) later. Measured with 4 ranks on 2 cores: 8 tiny messages into
a rank inside a 24 MiB all-to-all held it 7 - 8 ms (MPICH 5.0.2), 0.5 - 1.7 ms (Open MPI
5.0). The proxies meet this when an early rank posts its next collectives while its peers
are still in the last one (DLRM's backward all-reduces, posted while the forward all-to-all
still runs on the other ranks).

The measurement, through the real engine with the runs' yielding waits: ranks 1 .. n-1 run
MPI's all-to-all; rank 0 sleeps 2 ms (the wait has backed off to 1 ms tests by
then), then sends `MESSAGES` tiny messages to rank 1, which receives them after the
all-to-all. Rank 1's time with the messages less its time without, alternating, medians
(the all-to-all doubles until it runs well past the messages' arrival): the figure is the
value at which the predictor, on the fitted machine, delays rank 1 of the same layout by
that much (`fitted`).
"""

from __future__ import annotations

import statistics

import numpy as np

from proxies.core import pages

MESSAGES = 8
NAP = 2e-3  # seconds rank 0 sleeps before it sends: rank 1's wait is at 1 ms tests by then
FIRST = 16 << 20  # bytes of the all-to-all per rank to start from
MOST = 128 << 20  # ... and at most (quick: 32 MiB)
MOST_TESTS = 4.0  # the most tests per message the fit gives
LEFT = 4e-3  # seconds the all-to-all alone must run past the nap (it doubles until it does)


class _Runtime:
    def __init__(self, nbytes: int) -> None:
        self.a2a = pages.zeros(nbytes // 4, np.float32)
        self.a2a[...] = 1
        self.small = {f"u{i}": pages.zeros(4, np.float32) for i in range(MESSAGES)}

    def buffer(self, name: str, mb: int, chunk: int) -> np.ndarray:
        return self.a2a if name == "a2a" else self.small[name]

    def compute(self, op, iteration: int) -> None:  # mode "model": the engine sleeps
        pass

    def finish_iteration(self, iteration: int) -> tuple[float, int]:
        return 0.0, 0


def _plan(rank: int, n: int, nbytes: int, sends: bool):
    from proxies.core.plan import P2P, Collective, Compute, Msg, Plan, Wait

    msgs = lambda peer: tuple(Msg(peer, 100 + i, f"u{i}", 0, 4) for i in range(MESSAGES))  # noqa: E731
    if rank == 0:
        ops = (Compute("nap", seconds=NAP), P2P("unexpected", sends=msgs(1))) if sends else ()
    else:
        ops = (Collective("alltoall", "rest", "a2a", nbytes // 4, req="a"), Wait("a"))
        if rank == 1 and sends:
            ops += (P2P("unexpected", recvs=msgs(0)),)
    return Plan(rank, ops, {"rest": tuple(range(1, n))})


def measure(comm, MPI, reps: int, quick: bool) -> dict | None:
    """Rank 1's all-to-all alone and with the messages (seconds, medians of `reps`
    alternating pairs), on every rank of `comm` with yielding waits; None with fewer than
    3 ranks (the all-to-all needs two besides the sender)."""
    from proxies.core.engine import Engine

    n, r = comm.size, comm.rank
    if n < 3:
        return None
    rest = comm.Split(1 if r else MPI.UNDEFINED, r)
    comms = {"rest": rest if r else None}
    most = (32 << 20) if quick else MOST
    nbytes = FIRST - FIRST % (4 * (n - 1))
    try:
        while True:
            runtime = _Runtime(nbytes)
            engines = {
                sends: Engine(
                    MPI, _plan(r, n, nbytes, sends), runtime, comms, mode="model", wait="yield"
                )
                for sends in (False, True)
            }
            times: dict[bool, list[float]] = {False: [], True: []}
            try:
                for i in range(1 + reps):
                    for sends in (False, True):
                        comm.Barrier()
                        t0 = MPI.Wtime()
                        engines[sends].run_iteration(i)
                        mine = MPI.Wtime() - t0
                        if i:  # after a warm-up of each
                            times[sends].append(comm.bcast(mine, root=1))
            finally:
                for e in engines.values():
                    e.close()
            alone = statistics.median(times[False])
            # long enough: the all-to-all still runs well after the messages arrive
            if alone > NAP + LEFT or 2 * nbytes > most:
                break
            nbytes *= 2
    finally:
        if rest != MPI.COMM_NULL:
            rest.Free()
    return {
        "messages": MESSAGES,
        "bytes": nbytes,
        "alone_s": alone,
        "with_s": statistics.median(times[True]),
    }


def tests_taken(record: dict, wake: float) -> float:
    """Tests each message took by hand: rank 1's delay over the messages' backed-off tests
    (1 ms + wake each). What `fitted` starts from where the predictor sees no delay."""
    from proxies.core.waiting import MAX_SLEEP

    delay = max(0.0, record["with_s"] - record["alone_s"])
    return delay / (record["messages"] * (MAX_SLEEP + wake))


def fitted(record: dict, m, n: int, rpn: int) -> float:
    """The machine's oversubscribed.unexpected: the value at which the predictor, on
    machine m, delays rank 1 of the measured layout by what the run measured (bisection:
    the delay grows with the figure; at most MOST_TESTS). A taken test delays the
    all-to-all only where one of its steps was due, so the predictor's delay at 1 is
    below the messages' 8 tests, and the fit above `tests_taken`'s count."""
    from dataclasses import replace

    from proxies.core.network import Topology
    from proxies.core.predict import predict
    from proxies.core.prediction import chooser

    want = record["with_s"] - record["alone_s"]
    if want <= 0:  # no slower with the messages (Open MPI): none
        return 0.0
    plans = [_plan(q, n, record["bytes"], True) for q in range(n)]

    def rank1_end(x: float) -> float:
        mx = replace(m, oversub_unexpected=x)
        topo = Topology(mx, rpn, "yield")
        return predict(plans, topo, lambda r, op: op.seconds or 0.0, chooser(mx, "mpi")).finish[1]

    base = rank1_end(0.0)
    if rank1_end(MOST_TESTS) <= base:  # the model sees nothing to delay: count by hand
        return tests_taken(record, m.oversub_wake or 0.0)
    lo, hi = 0.0, MOST_TESTS
    for _ in range(30):
        mid = (lo + hi) / 2
        if rank1_end(mid) - base < want:
            lo = mid
        else:
            hi = mid
    return hi
