"""An op's category is what its MPI calls take; the engine's own work on the op (finding
its buffers, staging 16-bit copies, telling the watchdog what it waits for) is `overhead`.
Deterministic: the runtime's buffer lookup sleeps SLEEP each time, a lower bound on the
engine's own time that must land in `overhead`, never in the op's category, for a blocking
and a non-blocking exchange and a blocking and a non-blocking allreduce, plain and 16-bit
wires; the iteration still adds up. Also benchmarks/engine_overhead.py end to end."""

import os
import sys

import pytest
from launch import ROOT, mpiexec, run

SLEEP = 0.02

DRIVER = f"""
import sys, time
import numpy as np
from proxies.core import mpi
from proxies.core.engine import Engine
from proxies.core.mpi import Watchdog
from proxies.core.plan import P2P, Collective, Msg, Plan, Wait
MPI = mpi.init()
w = MPI.COMM_WORLD
peer, dtype = 1 - w.rank, sys.argv[1]

class Slow:
    def __init__(self):
        self.bufs = {{k: np.ones(64, np.float32) for k in ("s", "r", "x")}}
    def buffer(self, name, mb, chunk):
        time.sleep({SLEEP})
        return self.bufs[name]
    def compute(self, op, it):
        pass
    def finish_iteration(self, it):
        return 0.0, 0

def batch(req=""):
    return P2P("exchange", (Msg(peer, 5, "s", 0, 64, dtype),), (Msg(peer, 5, "r", 0, 64, dtype),),
               category="pp", req=req)
plans = {{
    "exchange": (batch(),),
    "exchange, non-blocking": (batch("p"), Wait("p")),
    "allreduce": (Collective("allreduce", "world", "x", 64, dtype, category="ar"),),
    "allreduce, non-blocking": (Collective("allreduce", "world", "x", 64, dtype, req="q",
                                           category="ar"), Wait("q")),
}}
dog = Watchdog(w, "t", 600)
rows = []
for kind, ops in plans.items():
    e = Engine(MPI, Plan(w.rank, ops, {{"world": (0, 1)}}), Slow(), {{"world": w}},
               mode="real", watchdog=dog)
    w.Barrier()
    t = e.run_iteration(0)
    e.close()
    own = sum(t.seconds.values()) + sum(c[2] for c in t.collectives)
    looked = 2 if kind.startswith("exchange") else 1
    rows.append((kind, looked, t.total, own, t.seconds.get("pp", 0.0), t.seconds.get("ar", 0.0),
                 sum(c[2] for c in t.collectives)))
dog.stop()
gathered = w.gather(rows)
for row in sum(gathered, []) if w.rank == 0 else []:  # one writer: lines stay whole
    print(*row)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_finding_the_buffers_is_overhead_not_communication(dtype):
    r = run([mpiexec(), "-n", "2", sys.executable, "-c", DRIVER, dtype], 120)
    assert r.returncode == 0, r.stderr
    rows = [line.rsplit(" ", 6) for line in r.stdout.splitlines()]
    assert len(rows) == 8, r.stdout  # four kinds on each of two ranks
    for kind, looked, total, own, pp, ar, blocking in rows:
        looked, total, own = int(looked), float(total), float(own)
        comm = float(pp) + float(ar) + float(blocking)
        # the op's own category never holds the lookups; the iteration does
        assert comm < SLEEP, (kind, comm)
        assert total - own >= looked * SLEEP, (kind, total, own)


@pytest.mark.mpi
def test_the_benchmark_times_each_op_kind_both_ways_warm_and_cold():
    path = os.path.join(ROOT, "benchmarks", "engine_overhead.py")
    argv = ["--ops", "20", "--rounds", "2", "--flush", "1"]
    r = run([mpiexec(), "-n", "2", sys.executable, path, *argv], 120)
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines()[2:]]
    kinds = ["exchange", "exchange, non-blocking", "allreduce", "allreduce, non-blocking"]
    assert [(row[:24].strip(), row[24:31].strip()) for row in rows] == [
        (kind, state) for state in ("warm", "cold") for kind in kinds
    ], r.stdout
    for row in rows:
        mpi, engine, booked, overhead = (float(x) for x in row[31:].split())
        assert mpi > 0 and booked > 0 and engine >= booked
        assert overhead == pytest.approx(engine - booked, abs=0.011)
    # --flush 0: the warm rows only
    r = run([mpiexec(), "-n", "2", sys.executable, path, *argv[:-1], "0"], 120)
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 2 + 4, r.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv", [["--ops", "0"], ["--rounds", "-1"], ["--elements", "x"], ["--flush", "-2"]]
)
def test_the_benchmarks_bad_arguments_are_one_line_and_exit_2(argv):
    path = os.path.join(ROOT, "benchmarks", "engine_overhead.py")
    r = run([sys.executable, path, *argv], 60)
    assert r.returncode == 2 and r.stderr.count("\n") <= 3 and "Traceback" not in r.stderr


@pytest.mark.mpi
def test_the_benchmark_refuses_an_odd_world_in_one_line():
    path = os.path.join(ROOT, "benchmarks", "engine_overhead.py")
    r = run([mpiexec(), "-n", "3", sys.executable, path, "--ops", "2", "--rounds", "1"], 120)
    assert r.returncode == 2 and "even number of ranks" in r.stderr
    assert "Traceback" not in r.stderr
