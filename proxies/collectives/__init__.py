"""Allreduce, reduce-scatter and allgather over point-to-point messages, in place, SUM.

One module per algorithm, each with its steps and its summation order in the docstring:

    naive   rank 0 gathers, sums, sends back         (n-1) x count through rank 0
    tree    binomial reduce + broadcast (tree.py)    log2 n rounds of count
    ring    reduce-scatter + allgather (ring.py)     2(n-1) steps of count/n
    rhd     recursive halving + doubling (rhd.py)    2 log2 p steps, 2(p-1)/p x count
    dbtree  two complementary binary trees           half each, pipelined in chunks
    hier    node reduce, leaders' ring, node bcast   ring's traffic across nodes only
    mpi     the library's MPI_Allreduce              whatever MPI picks

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

from proxies.collectives import dbtree, hier, naive, rhd, ring, tree
from proxies.collectives.common import Wait, bounds, flat, waitall, words
from proxies.core.wire import sum_op


def mpi_allreduce(comm, buf: np.ndarray, wait: Wait | None = None) -> None:
    """MPI's own: Allreduce(IN_PLACE), or Iallreduce + wait when a wait is given."""
    from mpi4py import MPI

    x, op = flat(buf), sum_op(MPI, buf.dtype)
    if wait is None:
        comm.Allreduce(MPI.IN_PLACE, words(x), op=op)
    else:
        wait([comm.Iallreduce(MPI.IN_PLACE, words(x), op=op)])


ALGORITHMS: dict[str, Callable[..., None]] = {
    "naive": naive.allreduce,
    "tree": tree.allreduce,
    "ring": ring.allreduce,
    "rhd": rhd.allreduce,
    "dbtree": dbtree.allreduce,
    "hier": hier.allreduce,
    "mpi": mpi_allreduce,
}


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
    if alg == "hier":
        fn(comm, buf, wait, ranks_per_node=ranks_per_node)
    else:
        fn(comm, buf, wait)


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


REDUCE_SCATTER = {"ring": ring.reduce_scatter, "mpi": _mpi_reduce_scatter}
ALLGATHER = {"ring": ring.allgather, "mpi": _mpi_allgather}


def reduce_scatter(comm, buf: np.ndarray, alg: str = "ring", *, wait: Wait | None = None) -> None:
    """Sum block comm.rank of `buf` over `comm`, left at its own position in buf."""
    _algorithm(REDUCE_SCATTER, alg, "reduce_scatter")(comm, buf, wait)


def allgather(comm, buf: np.ndarray, alg: str = "ring", *, wait: Wait | None = None) -> None:
    """Fill every block of `buf` with the block its rank holds at that position."""
    _algorithm(ALLGATHER, alg, "allgather")(comm, buf, wait)


__all__ = ["ALGORITHMS", "allgather", "allreduce", "bounds", "reduce_scatter", "waitall"]
