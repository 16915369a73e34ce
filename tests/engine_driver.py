"""Run under mpiexec by test_engine.py: every collective kind, blocking and non-blocking,
through the Engine with --check on, compared with NumPy on every rank."""

import sys

import numpy as np

from proxies.core import mpi
from proxies.core.engine import Engine
from proxies.core.plan import Collective, Compute, Plan, Wait

MPI = mpi.init()
world = MPI.COMM_WORLD
n, r = world.size, world.rank
EVEN = int(sys.argv[1]) * n  # elements of the whole array
EXTRA = int(sys.argv[3])  # added to all but alltoall: blocks of unequal sizes
WAIT = sys.argv[2]  # spin or yield
KINDS = ("allreduce", "allgather", "reduce_scatter", "alltoall", "bcast", "reduce")


def count(kind: str) -> int:
    return EVEN if kind == "alltoall" else EVEN + EXTRA


def data(rank: int, kind: str) -> np.ndarray:
    seed = [rank, KINDS.index(kind)]
    return np.random.default_rng(seed).standard_normal(count(kind)).astype(np.float32)


def block(x: np.ndarray, i: int) -> np.ndarray:
    return np.array_split(x, n)[i]


class Runtime:
    def __init__(self):
        self.bufs = {k: data(r, k) for k in KINDS}

    def buffer(self, name, mb, chunk):
        return self.bufs[name]

    def compute(self, op, iteration):
        pass

    def finish_iteration(self, iteration):
        return 0.0, 0


def expected(kind: str) -> np.ndarray:
    inputs = [data(i, kind) for i in range(n)]
    if kind == "allreduce":
        return np.sum(inputs, axis=0, dtype=np.float64)
    if kind == "reduce":
        return np.sum(inputs, axis=0, dtype=np.float64) if r == 0 else inputs[r]
    if kind == "allgather":
        return np.concatenate([block(inputs[i], i) for i in range(n)])
    if kind == "reduce_scatter":
        return block(np.sum(inputs, axis=0, dtype=np.float64), r)
    if kind == "alltoall":
        return np.concatenate([block(inputs[i], r) for i in range(n)])
    if kind == "bcast":
        return inputs[0]


for nonblocking in (False, True):
    ops = []
    for kind in KINDS:
        req = f"{kind}-req" if nonblocking else ""
        ops.append(Collective(kind, "world", kind, count(kind), req=req))
        ops.append(Compute("forward"))
    ops += [Wait(f"{kind}-req") for kind in KINDS] if nonblocking else []
    plan = Plan(r, tuple(ops), {"world": tuple(range(n))})
    rt = Runtime()
    # mode "real": the engine keeps our buffers (other modes fill checked ones with noise).
    engine = Engine(MPI, plan, rt, {"world": world}, mode="real", check=True, wait=WAIT)
    times = engine.run_iteration(0)
    for kind in KINDS:
        got = rt.bufs[kind]
        if kind == "reduce_scatter":
            got = block(got, r)
        want = expected(kind)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * n, err_msg=kind)
    if nonblocking:
        assert "world_allreduce_hidden" in times.seconds, times.seconds
    world.Barrier()
if r == 0:
    print("engine collectives OK")
