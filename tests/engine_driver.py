"""Run under mpiexec by tests/core/test_engine.py: every collective kind and a ring of
point-to-point messages, blocking and non-blocking, through the Engine with --check on,
compared with NumPy on every rank; the all-to-all out of place (MPI's in-place one is
another algorithm).

Arguments: elements per rank, spin|yield, extra elements, and optionally a wire dtype
(float32, bfloat16, float16), whether the runtime's buffers are float32 and staged
("stage") or already of the wire dtype ("direct"), and the allreduce algorithm. With a
16-bit wire dtype, inputs are rounded to it first; sums carry its rounding; a ring of
point-to-point messages must arrive bit for bit."""

import sys

import numpy as np

from proxies.core import mpi
from proxies.core.engine import Engine
from proxies.core.plan import P2P, Collective, Compute, Msg, Plan, Wait
from proxies.core.wire import epsilon, numpy_dtype

MPI = mpi.init()
world = MPI.COMM_WORLD
n, r = world.size, world.rank
EVEN = int(sys.argv[1]) * n  # elements of the whole array
EXTRA = int(sys.argv[3])  # added to all but alltoall: blocks of unequal sizes
WAIT = sys.argv[2]  # spin or yield
WIRE = sys.argv[4] if len(sys.argv) > 4 else "float32"
STAGE = len(sys.argv) > 5 and sys.argv[5] == "stage"
ALG = sys.argv[6] if len(sys.argv) > 6 else "mpi"
KINDS = ("allreduce", "allgather", "reduce_scatter", "alltoall", "bcast", "reduce")
HELD = np.float32 if STAGE else numpy_dtype(WIRE)  # the runtime's buffers
RTOL = max(1e-5, 2 * n * epsilon(numpy_dtype(WIRE)))


def count(kind: str) -> int:
    return EVEN if kind == "alltoall" else EVEN + EXTRA


def data(rank: int, kind: str) -> np.ndarray:
    """Rank's input, as the wire carries it (rounded to the wire dtype), in float32."""
    seed = [rank, KINDS.index(kind) if kind in KINDS else 99]
    x = np.random.default_rng(seed).standard_normal(count(kind)).astype(numpy_dtype(WIRE))
    return x.astype(np.float32)


def block(x: np.ndarray, i: int) -> np.ndarray:
    return np.array_split(x, n)[i]


class Runtime:
    def __init__(self):
        self.bufs = {k: data(r, k).astype(HELD) for k in (*KINDS, "p2p")}
        self.bufs["recv"] = np.zeros(count("p2p"), dtype=HELD)

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
        ops.append(Collective(kind, "world", kind, count(kind), dtype=WIRE, req=req))
        ops.append(Compute("forward"))
    ops += [Wait(f"{kind}-req") for kind in KINDS] if nonblocking else []
    if n > 1:  # a ring: send to the right, receive from the left (posted, then waited)
        right, left = (r + 1) % n, (r - 1) % n
        size = count("p2p")
        send = Msg(right, 7, "p2p", 0, size, WIRE)
        req = "ring-req" if nonblocking else ""
        ops.append(P2P("ring", (send,), (Msg(left, 7, "recv", 0, size, WIRE),), req=req))
        ops += [Compute("forward"), Wait(req)] if nonblocking else []
    plan = Plan(r, tuple(ops), {"world": tuple(range(n))})
    rt = Runtime()
    # mode "real": the engine keeps our buffers (other modes fill checked ones with noise).
    engine = Engine(
        MPI, plan, rt, {"world": world}, mode="real", check=True, wait=WAIT, allreduce=ALG
    )
    times = engine.run_iteration(0)
    for kind in KINDS:
        got = rt.bufs[kind].astype(np.float64)
        if kind == "reduce_scatter":
            got = block(got, r)
        want = expected(kind)
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * n, err_msg=kind)
    # the all-to-all ran out of place: its result came through a pooled receive buffer of
    # the wire dtype, back in the pool now, and nothing is left in flight
    assert engine.staging.free[(np.dtype(numpy_dtype(WIRE)), count("alltoall"))], "in place?"
    assert not engine._sent
    if n > 1:
        got = rt.bufs["recv"].astype(np.float32)
        assert np.array_equal(got, data((r - 1) % n, "p2p")), "p2p message changed"
    if STAGE and WIRE != "float32":
        assert "dtype_cast" in times.seconds, times.seconds
    if nonblocking:
        assert "world_allreduce_hidden" in times.seconds, times.seconds
        assert n == 1 or "pp_hidden" in times.seconds, times.seconds
    world.Barrier()
if r == 0:
    print("engine collectives OK")
