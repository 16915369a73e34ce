"""Collectives over point-to-point messages, in place, SUM, each algorithm described once.

Every algorithm is a pure function giving rank r's *program* (program.py: post a send or a
receive of an element range, wait for posted requests, add or copy a scratch range into
the buffer) for a group of n ranks and `count` elements. One interpreter runs any program
over mpi4py; the predictor reads the same programs (steps.trace) or their closed-form
phases (steps.coarse). Tables keyed (kind, alg): steps.PROGRAMS, steps.algorithms(kind).

    allreduce (ALGORITHMS, --allreduce):
    naive   rank 0 gathers, sums, sends back         (n-1) x count through rank 0
    tree    binomial reduce + broadcast (tree.py)    log2 n rounds of count
    ring    reduce-scatter + allgather (ring.py)     2(n-1) steps of count/n
    rhd     recursive halving + doubling (rhd.py)    2 log2 p steps, 2(p-1)/p x count
    rd      recursive doubling (rd.py)               log2 p steps of count
    dbtree  two complementary binary trees           half each, pipelined in chunks
    hier    node reduce, leaders' ring, node bcast   ring's traffic across nodes only
    mpi     the library's MPI_Allreduce              whatever MPI picks

    reduce_scatter: ring, rh (recursive halving, rhd.py), mpi
    allgather:      ring, rd (recursive doubling, rd.py), mpi
    alltoall pairwise (alltoall.py), bcast and reduce binomial (tree.py): what MPICH runs,
                    for the predictor; runnable through `run`.

(p: the largest power of two <= n; the others fold into it first.) Each module states its
steps and its summation order.

Conventions shared by all (common.py): `buf` is a C-contiguous NumPy array of `count`
elements (any dtype MPI knows: float32, float64, int32, int64, ...), reduced in place.
For reduce_scatter and allgather it is the whole array, cut into comm.size blocks as
np.array_split cuts it; reduce_scatter leaves rank r's reduced block at block r's position
(the other blocks hold partial sums), allgather takes rank r's block at that position and
fills the others. Any world size and any count, 0 and counts smaller than the group
included. `wait(requests)` completes requests (default MPI.Request.Waitall); the engine
passes its Waiter.waitall so oversubscribed ranks sleep instead of spinning. Every
algorithm but `mpi` leaves identical bytes on all ranks in a documented order, which is
why results are reproducible run to run but differ from MPI's in the last bits.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from proxies.core.collectives import hier, steps
from proxies.core.collectives.common import Wait, bounds, flat, waitall, words
from proxies.core.collectives.program import execute
from proxies.core.wire import sum_op


def mpi_allreduce(comm, buf: np.ndarray, wait: Wait | None = None) -> None:
    """MPI's own: Allreduce(IN_PLACE), or Iallreduce + wait when a wait is given."""
    from mpi4py import MPI

    x, op = flat(buf), sum_op(MPI, buf.dtype)
    if wait is None:
        comm.Allreduce(MPI.IN_PLACE, words(x), op=op)
    else:
        wait([comm.Iallreduce(MPI.IN_PLACE, words(x), op=op)])


def run(
    kind: str,
    alg: str,
    comm,
    buf: np.ndarray,
    wait: Wait | None = None,
    *,
    ranks_per_node: int | None = None,
) -> None:
    """Run algorithm `alg` of collective `kind` (a key of steps.PROGRAMS) on buf in place.
    ranks_per_node only matters to hier (default: MPI's shared-memory split)."""
    x = flat(buf)
    nodes = hier.nodes_of(comm, ranks_per_node) if alg == "hier" and comm.size > 1 else None
    prog = steps.program(kind, alg, comm.size, comm.rank, x.size, x.itemsize, nodes)
    execute(comm, x, prog, waitall(wait))


def _ours(kind: str, alg: str) -> Callable[..., None]:
    def fn(comm, buf: np.ndarray, wait: Wait | None = None, **kw) -> None:
        run(kind, alg, comm, buf, wait, **kw)

    fn.__name__ = f"{kind}_{alg}"
    return fn


ALGORITHMS: dict[str, Callable[..., None]] = {
    **{alg: _ours("allreduce", alg) for alg in steps.algorithms("allreduce")},
    "mpi": mpi_allreduce,
}
# The names --allreduce accepts (core/cli.py): MPI's own, the default, first.
ALLREDUCE_NAMES: tuple[str, ...] = ("mpi", *steps.algorithms("allreduce"))


def _algorithm(table: dict, alg: str, what: str):
    if alg not in table:
        raise ValueError(f"unknown {what} algorithm {alg!r} (choose from {', '.join(table)})")
    return table[alg]


def allreduce(
    comm,
    buf: np.ndarray,
    alg: str = "ring",
    *,
    wait: Wait | None = None,
    ranks_per_node: int | None = None,
) -> None:
    """Sum `buf` over `comm` in place with algorithm `alg` (a key of ALGORITHMS).
    ranks_per_node only matters to hier (default: MPI's shared-memory split)."""
    fn = _algorithm(ALGORITHMS, alg, "allreduce")
    if alg == "mpi":
        fn(comm, buf, wait)
    else:
        fn(comm, buf, wait, ranks_per_node=ranks_per_node)


def _mpi_reduce_scatter(comm, buf: np.ndarray, wait: Wait | None = None) -> None:
    from mpi4py import MPI

    x, n, r = flat(buf), comm.size, comm.rank
    off = bounds(x.size, n)
    counts = [off[i + 1] - off[i] for i in range(n)]
    op = sum_op(MPI, x.dtype)
    if wait is None:
        comm.Reduce_scatter(MPI.IN_PLACE, words(x), counts, op=op)
    else:
        wait([comm.Ireduce_scatter(MPI.IN_PLACE, words(x), counts, op=op)])
    # MPI leaves the block at the front; ours belongs at its own position
    x[off[r] : off[r + 1]] = x[: counts[r]].copy()


def _mpi_allgather(comm, buf: np.ndarray, wait: Wait | None = None) -> None:
    from mpi4py import MPI

    x, n = flat(buf), comm.size
    off = bounds(x.size, n)
    spec = [words(x), ([off[i + 1] - off[i] for i in range(n)], off[:-1])]
    if wait is None:
        comm.Allgatherv(MPI.IN_PLACE, spec)
    else:
        wait([comm.Iallgatherv(MPI.IN_PLACE, spec)])


REDUCE_SCATTER = {
    **{alg: _ours("reduce_scatter", alg) for alg in steps.algorithms("reduce_scatter")},
    "mpi": _mpi_reduce_scatter,
}
ALLGATHER = {
    **{alg: _ours("allgather", alg) for alg in steps.algorithms("allgather")},
    "mpi": _mpi_allgather,
}


def reduce_scatter(comm, buf: np.ndarray, alg: str = "ring", *, wait: Wait | None = None) -> None:
    """Sum block comm.rank of `buf` over `comm`, left at its own position in buf."""
    _algorithm(REDUCE_SCATTER, alg, "reduce_scatter")(comm, buf, wait)


def allgather(comm, buf: np.ndarray, alg: str = "ring", *, wait: Wait | None = None) -> None:
    """Fill every block of `buf` with the block its rank holds at that position."""
    _algorithm(ALLGATHER, alg, "allgather")(comm, buf, wait)


__all__ = [
    "ALGORITHMS",
    "ALLREDUCE_NAMES",
    "allgather",
    "allreduce",
    "bounds",
    "reduce_scatter",
    "run",
    "steps",
    "waitall",
]
