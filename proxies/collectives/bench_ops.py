"""The collectives of `python -m proxies.collectives`, as nccl-tests counts them.

Each op (OPS) names its bus-bandwidth factor (nccl-tests' doc/PERFORMANCE.md), the
algorithms that run it (ours over point-to-point, `mpi` the library's own), whether it
reduces (-o) and whether it has a root (-r). Sizes follow nccl-tests' per-op convention:
`size` is the whole buffer a rank holds, the larger of its input and output:

    op              size per rank                 count (column)      busbw factor
    allreduce       the array                     elements            2(n-1)/n
    reduce_scatter  the input: n blocks           elements per block  (n-1)/n
    allgather       the output: n blocks          elements per block  (n-1)/n
    alltoall        n blocks, one per peer        elements per block  (n-1)/n
    broadcast       the array                     elements            1
    reduce          the array                     elements            1
    sendrecv        what each rank sends          elements            1

For the blocked ops the count is rounded down to a whole block per rank (nccl-tests does
the same, to 16-byte blocks). Collectives run in place on one buffer, as our algorithms
do, except MPI's all-to-all, which receives into a second buffer as the proxies' (and
nccl-tests') all-to-alls do; sendrecv sends to rank r+1 and receives from rank r-1 into a
second buffer (nccl-tests' ring of pairs).

The check (-c): every rank fills its buffer from check_inputs(op, redop, count, rank), one
call runs, and each rank counts the elements of its result that differ from what NumPy
computes from all ranks' inputs (check_wrong). The inputs are small integers whose
reductions are exact in every order and dtype: sums and min/max of |v| <= 15 (|v| <= 1 for
16-bit floats), products of +-1 and +-2 (exact up to 2^14 in float16, far beyond
elsewhere), and for data movement values up to +-127, exact even in bfloat16 and distinct
enough that a block from the wrong rank shows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from proxies.core import wire
from proxies.core.collectives import ALGORITHMS, allreduce, bounds, run, steps
from proxies.core.collectives.common import words


@dataclass(frozen=True)
class Op:
    name: str
    kind: str  # the predictor's collective kind ("" for point-to-point)
    ours: tuple[str, ...]  # our algorithms for it
    reduces: bool
    rooted: bool
    blocked: bool  # the buffer is n blocks (count a multiple of n)

    def factor(self, n: int) -> float:
        """nccl-tests' bus-bandwidth factor at n ranks (doc/PERFORMANCE.md)."""
        if self.name == "allreduce":
            return 2 * (n - 1) / n
        if self.name in ("reduce_scatter", "allgather", "alltoall"):
            return (n - 1) / n
        return 1.0

    @property
    def algorithms(self) -> tuple[str, ...]:
        return (*self.ours, "mpi")


OPS: dict[str, Op] = {
    "allreduce": Op(
        "allreduce", "allreduce", tuple(a for a in ALGORITHMS if a != "mpi"), True, False, False
    ),
    "allgather": Op("allgather", "allgather", steps.algorithms("allgather"), False, False, True),
    "reduce_scatter": Op(
        "reduce_scatter", "reduce_scatter", steps.algorithms("reduce_scatter"), True, False, True
    ),
    "alltoall": Op("alltoall", "alltoall", steps.algorithms("alltoall"), False, False, True),
    "broadcast": Op("broadcast", "bcast", steps.algorithms("bcast"), False, True, False),
    "reduce": Op("reduce", "reduce", steps.algorithms("reduce"), True, True, False),
    "sendrecv": Op("sendrecv", "", (), False, False, False),
}
# nccl-tests' binary names (all_gather_perf ...) and MPI's spellings, for the op argument
ALIASES = {
    "all_reduce": "allreduce",
    "all_gather": "allgather",
    "reducescatter": "reduce_scatter",
    "all_to_all": "alltoall",
    "bcast": "broadcast",
    "send_recv": "sendrecv",
}
REDOPS = ("sum", "prod", "min", "max")


def counts(op: Op, size: int, itemsize: int, n: int) -> tuple[int, int]:
    """(elements in the buffer, the count column) for a row of `size` bytes."""
    elements = size // itemsize
    if not op.blocked:
        return elements, elements
    block = elements // n
    return block * n, block


# -- MPI's own ---------------------------------------------------------------------------
_ops16: dict = {}


def mpi_op(MPI, redop: str, dtype):
    """MPI's reduction; for 16-bit floats (sent as uint16 words) a user-defined one that
    widens to float32 and rounds back, as wire.sum_op does for sums."""
    if redop == "sum":
        return wire.sum_op(MPI, dtype)
    if not wire.is_sixteen(dtype):
        return {"prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}[redop]
    key = (redop, np.dtype(dtype))
    if key not in _ops16:
        fn = {"prod": np.multiply, "min": np.minimum, "max": np.maximum}[redop]
        dt = np.dtype(dtype)

        def apply(inbuf, inoutbuf, datatype, dtype=dt, fn=fn):
            a = np.frombuffer(inbuf, dtype=dtype)
            b = np.frombuffer(inoutbuf, dtype=dtype)
            b[...] = fn(a.astype(np.float32), b.astype(np.float32)).astype(dtype)

        _ops16[key] = MPI.Op.Create(apply, commute=True)
    return _ops16[key]


def _mpi_call(MPI, op: str, comm, x, redop: str, root: int, recv, wait):
    """One blocking call, or the non-blocking one + wait([request]) when wait is given."""
    nb = wait is not None
    w, n, r = words(x), comm.size, comm.rank
    red = mpi_op(MPI, redop, x.dtype) if OPS[op].reduces else None
    if op == "allreduce":
        args = (MPI.IN_PLACE, w)
        req = comm.Iallreduce(*args, op=red) if nb else comm.Allreduce(*args, op=red)
    elif op == "reduce_scatter":
        off = bounds(x.size, n)
        spec = (MPI.IN_PLACE, w, [off[i + 1] - off[i] for i in range(n)])
        req = comm.Ireduce_scatter(*spec, op=red) if nb else comm.Reduce_scatter(*spec, op=red)
        # MPI leaves this rank's block at the front; ours (and the check) want it in place
        if nb:
            wait([req])
            req = nb = None
        x[off[r] : off[r + 1]] = x[: off[r + 1] - off[r]].copy()
    elif op == "allgather":
        off = bounds(x.size, n)
        spec = [w, ([off[i + 1] - off[i] for i in range(n)], off[:-1])]
        req = comm.Iallgatherv(MPI.IN_PLACE, spec) if nb else comm.Allgatherv(MPI.IN_PLACE, spec)
    elif op == "alltoall":  # out of place, as nccl-tests and the proxies call it
        into = words(recv)
        req = comm.Ialltoall(w, into) if nb else comm.Alltoall(w, into)
    elif op == "broadcast":
        req = comm.Ibcast(w, root=root) if nb else comm.Bcast(w, root=root)
    elif op == "reduce":
        send, into = (MPI.IN_PLACE, w) if r == root else (w, None)
        req = (
            comm.Ireduce(send, into, op=red, root=root)
            if nb
            else comm.Reduce(send, into, op=red, root=root)
        )
    else:  # sendrecv: a ring of pairs, as nccl-tests' sendrecv_perf
        dst, src = (r + 1) % n, (r - 1) % n
        if nb:
            req = [comm.Isend(w, dst, tag=77), comm.Irecv(words(recv), src, tag=77)]
            wait(req)
            return
        comm.Sendrecv(w, dst, 77, words(recv), src, 77)
        return
    if nb:
        wait([req])


def caller(
    MPI, op: str, alg: str, comm, root: int, redop: str, wait, ranks_per_node: int | None
) -> Callable[[np.ndarray, np.ndarray | None], None]:
    """fn(buf, recv) running one `op` with `alg` on buf in place (recv: sendrecv's)."""
    if alg == "mpi":
        return lambda buf, recv: _mpi_call(MPI, op, comm, buf, redop, root, recv, wait)
    if op == "allreduce":
        return lambda buf, recv: allreduce(comm, buf, alg, wait=wait, ranks_per_node=ranks_per_node)
    group = comm
    if OPS[op].rooted and root != 0:
        # our trees start at group rank 0: renumber so the root is rank 0 (split once)
        group = comm.Split(0, (comm.rank - root) % comm.size)
    kind = OPS[op].kind
    return lambda buf, recv: run(kind, alg, group, buf, wait)


# -- the check ---------------------------------------------------------------------------
def check_inputs(op: str, redop: str, count: int, rank: int, dtype) -> np.ndarray:
    """Rank `rank`'s input for the checked call (module docstring: why exact)."""
    i = np.arange(count, dtype=np.int64) * 7 + rank * 13
    if redop == "prod" and OPS[op].reduces:
        ints = np.array([1, 2, -1, -2])[i % 4]
    elif OPS[op].reduces:
        span = 3 if wire.is_sixteen(dtype) else 31
        ints = i % span - span // 2
    else:
        ints = i % 255 - 127
    return ints.astype(dtype)


def _reduced(op, redop, count, n, dtype) -> np.ndarray:
    X = np.array([check_inputs(op, redop, count, i, dtype) for i in range(n)], dtype=np.float64)
    fn = {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max}[redop]
    return fn(X, axis=0)


def check_wrong(
    op: str, redop: str, root: int, buf: np.ndarray, recv: np.ndarray | None, n: int, r: int
) -> int:
    """Elements of this rank's result that differ from NumPy's (only the part nccl-tests
    checks: rank r's block of a reduce-scatter, the root's buffer of a reduce)."""
    count, dtype = buf.size, buf.dtype
    off = bounds(count, n)
    mine = slice(off[r], off[r + 1])
    if op in ("allreduce", "reduce", "reduce_scatter"):
        if op == "reduce" and r != root:
            return 0
        want, got = _reduced(op, redop, count, n, dtype), buf
        if op == "reduce_scatter":
            want, got = want[mine], buf[mine]
    elif op == "allgather":
        want = np.concatenate(
            [check_inputs(op, redop, count, i, dtype)[off[i] : off[i + 1]] for i in range(n)]
        )
        got = buf
    elif op == "alltoall":
        want = np.concatenate([check_inputs(op, redop, count, j, dtype)[mine] for j in range(n)])
        got = buf
    elif op == "broadcast":
        want, got = check_inputs(op, redop, count, root, dtype), buf
    else:
        want, got = check_inputs(op, redop, count, (r - 1) % n, dtype), recv
    return int(np.count_nonzero(got != np.asarray(want).astype(dtype)))


# -- the table's words -------------------------------------------------------------------
def iter_stats(times: list[float], skip: int) -> dict:
    """nccl-tests' -I summary over times[skip:] (seconds in, microseconds out)."""
    t = sorted(times[skip:])
    n = len(t)
    avg = sum(t) / n
    sd = (sum((x - avg) ** 2 for x in t) / n) ** 0.5
    p = lambda q: t[min(n - 1, (n * q + 99) // 100 - 1)]  # noqa: E731 nearest rank
    return {
        "skipped_iterations": skip,
        "min_us": t[0] * 1e6,
        "max_us": t[-1] * 1e6,
        "avg_us": avg * 1e6,
        "p50_us": t[n // 2] * 1e6,
        "p95_us": p(95) * 1e6,
        "p99_us": p(99) * 1e6,
        "stdev_us": sd * 1e6,
        "cv_pct": sd / avg * 100 if avg > 0 else 0.0,
        "times_us": [x * 1e6 for x in times],
    }


def describe(name: str, redop: str, root: int, n: int) -> str:
    """The header's line: the op, its reduction and root, its busbw factor."""
    op = OPS[name]
    what = op.name + (f" ({redop})" if op.reduces else "")
    what += {"broadcast": f" from root {root}", "reduce": f" to root {root}"}.get(op.name, "")
    f = {"allreduce": "2(n-1)/n", "broadcast": "1", "reduce": "1", "sendrecv": "1"}
    f = f.get(op.name, "(n-1)/n")
    return f"{what} on {n} ranks · busbw = algbw x {f} = algbw x {op.factor(n):.3f}"


# -- prediction --------------------------------------------------------------------------
def predicted_seconds(
    machine,
    op: str,
    alg: str,
    n: int,
    count: int,
    dtype: str,
    root: int,
    rpn,
    detail: str,
    wait: str = "auto",
) -> float:
    """One call on `machine`: our algorithm as named, `mpi` as the machine file says the
    library runs it; sendrecv as one send and one receive per rank posted together; waits
    as --wait says (auto: yielding where ranks outnumber cores)."""
    from proxies.core.mpi_choice import mpi_algorithm
    from proxies.core.plan import P2P, Collective, Msg, Plan
    from proxies.core.predict import Topology, predict

    if not OPS[op].kind:
        plans = [
            Plan(
                r,
                (
                    P2P(
                        "sendrecv",
                        (Msg((r + 1) % n, 0, "x", 0, count, dtype),),
                        (Msg((r - 1) % n, 0, "x", 0, count, dtype),),
                    ),
                ),
                {},
            )
            for r in range(n)
        ]
    else:
        # the group starts at the root, so group rank 0 (our trees' root) is world rank root
        group = tuple((root + i) % n for i in range(n))
        coll = Collective(OPS[op].kind, "world", "x", count, dtype)
        plans = [Plan(r, (coll,), {"world": group}) for r in range(n)]

    def pick(kind: str, nbytes: int) -> str:
        return mpi_algorithm(machine, kind, nbytes) if alg == "mpi" else alg

    # "mpi": the library runs it (its temporaries may be fresh memory, its steps on a
    # crowded node advance inside the waits), as the proxies' predictions price it
    pick.library = lambda kind: alg == "mpi"  # type: ignore[attr-defined]
    topo = Topology(machine, rpn, wait)
    return predict(plans, topo, lambda r, o: 0.0, pick, detail=detail).time
