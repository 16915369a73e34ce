"""The engine's own time around and inside a communication op, side by side with the same
MPI calls in a plain mpi4py loop: what a proxy's breakdown books to the op, what it books
to `overhead`, and what MPI alone takes.

    mpiexec -n R python benchmarks/engine_overhead.py [--ops N] [--rounds N] [--elements N]
                                                      [--flush MiB]

R even: ranks 2i and 2i + 1 are partners. Four kinds of op, each `--ops` times (500) in one
plan run through the real engine (modelled compute, spinning waits, a watchdog as runs
have), and the same MPI calls in a loop:

- exchange: a blocking batch, one send to and one receive from the partner (Isend, Mprobe +
  Mrecv, Wait: the engine's calls);
- exchange, non-blocking: the batch posted (Isend + Irecv) and then waited for;
- allreduce: a blocking MPI_Allreduce over all ranks, in place;
- allreduce, non-blocking: MPI_Iallreduce, then its Wait.

Messages are `--elements` float32 (16). Each way runs once per round, after a barrier, timed
by its slowest rank; the ways alternate, so drifting load touches them alike; medians over
`--rounds` rounds (15) after 2. Columns, microseconds per op: the plain loop; the engine's
wall time; what the engine booked to the op (its category plus idle); the rest of the
engine's time (its `overhead`).

Caches: the rows marked `warm` run the ops back to back, as calibrate measures the
engine's cost per op. The rows marked `cold` first copy `--flush` MiB (32; 0: none) before
each op, as a proxy's ranks move megabytes between their small ops: the copy evicts the
interpreter's and MPI's code and data from the caches. After its copy each rank meets its
partner (MPI_Barrier), so that no op waits for the other's copy. The copies and barriers
are left out (in the loop timed apart, in the engine its runtime's compute op); the
engine's `overhead` then also holds that op's own cost (a compute op: about a
microsecond warm).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KINDS = ("exchange", "exchange, non-blocking", "allreduce", "allreduce, non-blocking")
WARMUP = 2


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="engine_overhead", description=__doc__.splitlines()[0])
    p.add_argument("--ops", type=int, default=500)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--elements", type=int, default=16)
    p.add_argument("--flush", type=float, default=32.0)
    args = p.parse_args(argv)
    if not (1 <= args.ops <= 100_000 and 1 <= args.rounds <= 1000 and 1 <= args.elements):
        p.error("--ops in [1, 100000], --rounds in [1, 1000], --elements >= 1")
    if not 0 <= args.flush <= 4096:
        p.error("--flush in [0, 4096] MiB")
    return args


def plans(rank: int, partner: int, ops: int, count: int, cold: bool) -> dict:
    """Each kind's plan of `ops` ops on this rank (`cold`: each op after a copy)."""
    from proxies.core.plan import P2P, Collective, Compute, Msg, Wait

    flush = (Compute("flush"),) if cold else ()

    def batch(i, req=""):
        return P2P(
            "exchange",
            sends=(Msg(partner, i, "send", 0, count),),
            recvs=(Msg(partner, i, "recv", 0, count),),
            req=req,
        )

    ar = Collective("allreduce", "world", "x", count)
    nb = Collective("allreduce", "world", "x", count, req="q")
    return {
        "exchange": tuple(op for i in range(ops) for op in (*flush, batch(i))),
        "exchange, non-blocking": tuple(
            op for i in range(ops) for op in (*flush, batch(i, "p"), Wait("p"))
        ),
        "allreduce": (*flush, ar) * ops,
        "allreduce, non-blocking": (*flush, nb, Wait("q")) * ops,
    }


class Buffers:
    """The engine's runtime: named buffers; its one compute op copies `flush` (a pair of
    arrays, or None) and meets the other ranks."""

    def __init__(self, np, count: int, flush, comm):
        self.np, self.flush, self.comm = np, flush, comm
        self.bufs = {name: np.ones(count, np.float32) for name in ("send", "recv", "x")}

    def buffer(self, name, mb, chunk):
        return self.bufs[name]

    def compute(self, op, iteration):
        if self.flush is not None:
            self.np.copyto(*self.flush)
            self.comm.Barrier()

    def finish_iteration(self, iteration):
        return 0.0, 0


def loops(comm, MPI, np, partner: int, ops: int, count: int, flush) -> dict:
    """Each kind's MPI calls, `ops` times, in a plain loop; with `flush` (a pair of arrays)
    each after a copy and a barrier, whose seconds each loop returns (else 0)."""
    import time

    send, recv, x = (np.ones(count, np.float32) for _ in range(3))
    copies = [0.0]

    def copy():
        if flush is not None:
            c0 = time.perf_counter()
            np.copyto(*flush)
            comm.Barrier()
            copies[0] += time.perf_counter() - c0

    def timed(loop):
        def run():
            copies[0] = 0.0
            loop()
            return copies[0]

        return run

    def exchange():
        for i in range(ops):
            copy()
            req = comm.Isend(send, partner, i)
            comm.Mprobe(partner, i, MPI.Status()).Recv(recv)
            req.Wait()

    def exchange_nb():
        for i in range(ops):
            copy()
            MPI.Request.Waitall([comm.Isend(send, partner, i), comm.Irecv(recv, partner, i)])

    def allreduce():
        for _ in range(ops):
            copy()
            comm.Allreduce(MPI.IN_PLACE, x)

    def allreduce_nb():
        for _ in range(ops):
            copy()
            comm.Iallreduce(MPI.IN_PLACE, x).Wait()

    ways = (exchange, exchange_nb, allreduce, allreduce_nb)
    return {kind: timed(loop) for kind, loop in zip(KINDS, ways, strict=True)}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import numpy as np
    from mpi4py import MPI

    from proxies.core.engine import Engine
    from proxies.core.mpi import Watchdog
    from proxies.core.plan import Plan

    comm = MPI.COMM_WORLD
    if comm.size % 2:
        if comm.rank == 0:
            print("engine_overhead: needs an even number of ranks (partners 2i, 2i + 1)",
                  file=sys.stderr)  # fmt: skip
        return 2
    partner = comm.rank ^ 1
    groups = {"world": tuple(range(comm.size))}
    watchdog = Watchdog(comm, "engine_overhead", 600)
    n = int(args.flush * (1 << 20)) // 4
    flush = (np.empty(n, np.float32), np.ones(n, np.float32)) if n else None
    states = ("warm", "cold") if flush is not None else ("warm",)
    engines, plain = {}, {}
    for state in states:
        arrays = flush if state == "cold" else None
        built = plans(comm.rank, partner, args.ops, args.elements, arrays is not None)
        for kind, ops in built.items():
            engines[kind, state] = Engine(
                MPI,
                Plan(comm.rank, ops, groups),
                Buffers(np, args.elements, arrays, comm),
                {"world": comm},
                mode="real",  # the copy is the runtime's one compute op
                wait="spin",
                watchdog=watchdog,
            )
        for kind, loop in loops(comm, MPI, np, partner, args.ops, args.elements, arrays).items():
            plain[kind, state] = loop
    times: dict = {key + (w,): [] for key in engines for w in ("mpi", "engine", "booked")}
    try:
        for r in range(WARMUP + args.rounds):
            for key in engines:
                for way in ("mpi", "engine"):
                    comm.Barrier()
                    t0 = MPI.Wtime()
                    if way == "mpi":
                        copies = plain[key]()
                    else:
                        t = engines[key].run_iteration(r)
                        copies = t.seconds.get("compute", 0.0)
                    took = MPI.Wtime() - t0 - copies
                    if way == "engine":
                        booked = comm.allreduce(t.booked() - copies, op=MPI.MAX)
                    took = comm.allreduce(took, op=MPI.MAX)
                    if r >= WARMUP:
                        times[key + (way,)].append(took)
                        if way == "engine":
                            times[key + ("booked",)].append(booked)
    finally:
        for engine in engines.values():
            engine.close()
        watchdog.stop()
    if comm.rank == 0:
        print(f"# {comm.size} ranks, {args.elements} float32 per message, "
              f"{args.ops} ops per call, median of {args.rounds} calls, slowest rank, "
              f"us per op; cold: after a copy of {args.flush:g} MiB")  # fmt: skip
        print(f"{'op':<24}{'caches':>7}{'mpi':>8}{'engine':>8}{'booked':>8}{'overhead':>10}")
        for kind, state in engines:
            mpi, eng, booked = (
                statistics.median(times[kind, state, w]) / args.ops * 1e6
                for w in ("mpi", "engine", "booked")
            )
            print(f"{kind:<24}{state:>7}{mpi:8.2f}{eng:8.2f}{booked:8.2f}{eng - booked:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
