"""Every collective algorithm's steps, keyed (kind, alg): the programs execution runs, their
trace for the predictor at small sizes, and (coarse.py) their phases at scale.

    kind            algorithms
    allreduce       naive, tree, ring, rhd, rd, dbtree, hier
    reduce_scatter  ring, rh (recursive halving)
    allgather       ring, rd (recursive doubling)
    alltoall        pairwise, inplace (MPICH's MPI_IN_PLACE order)
    bcast           binomial (from group rank 0)
    reduce          binomial (to group rank 0)

`program(kind, alg, n, r, count, itemsize, nodes)` is rank r's Program (program.py);
`trace(...)` lists every rank's posts, waits and reductions from those same programs:

    ("send", handle, peer, elements)   post a non-blocking send to group rank `peer`
    ("recv", handle, peer, elements)   post a non-blocking receive from `peer`
    ("wait", (handle, ...))            block until those complete
    ("reduce", elements)               add that many received elements
    ("copy", elements)                 copy that many elements locally (scratch into place)

Messages between one pair of ranks match in order (FIFO per (src, dst)), as MPI matches
them per tag: the programs post the receives of one pair in the order the peer sends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from proxies.core.collectives import alltoall, dbtree, hier, naive, rd, rhd, ring, tree
from proxies.core.collectives.coarse import Phase, coarse
from proxies.core.collectives.program import ADD, COPY, RECV, SEND, WAIT, Program

__all__ = ["KINDS", "PROGRAMS", "Phase", "algorithms", "coarse", "program", "trace"]

# (kind, alg) -> fn(n, r, count, itemsize, nodes) -> Program. The wrappers pass each
# builder only what it depends on, so its lru_cache keys stay small.
PROGRAMS: dict[tuple[str, str], Callable[..., Program]] = {
    ("allreduce", "naive"): lambda n, r, c, i, nodes: naive.allreduce(n, r, c),
    ("allreduce", "tree"): lambda n, r, c, i, nodes: tree.allreduce(n, r, c),
    ("allreduce", "ring"): lambda n, r, c, i, nodes: ring.allreduce(n, r, c),
    ("allreduce", "rhd"): lambda n, r, c, i, nodes: rhd.allreduce(n, r, c),
    ("allreduce", "rd"): lambda n, r, c, i, nodes: rd.allreduce(n, r, c),
    ("allreduce", "dbtree"): lambda n, r, c, i, nodes: dbtree.allreduce(
        n, r, c, i, dbtree.OVERHEAD_BYTES
    ),
    ("allreduce", "hier"): lambda n, r, c, i, nodes: hier.allreduce(
        n, r, c, tuple(nodes) if nodes else (0,) * n
    ),
    ("reduce_scatter", "ring"): lambda n, r, c, i, nodes: ring.reduce_scatter(n, r, c),
    ("reduce_scatter", "rh"): lambda n, r, c, i, nodes: rhd.reduce_scatter(n, r, c),
    ("allgather", "ring"): lambda n, r, c, i, nodes: ring.allgather(n, r, c),
    ("allgather", "rd"): lambda n, r, c, i, nodes: rd.allgather(n, r, c),
    ("alltoall", "pairwise"): lambda n, r, c, i, nodes: alltoall.pairwise(n, r, c),
    ("alltoall", "inplace"): lambda n, r, c, i, nodes: alltoall.inplace(n, r, c),
    ("bcast", "binomial"): lambda n, r, c, i, nodes: tree.bcast(n, r, c),
    ("reduce", "binomial"): lambda n, r, c, i, nodes: tree.reduce(n, r, c),
}

KINDS = tuple(dict.fromkeys(kind for kind, _ in PROGRAMS))


def algorithms(kind: str) -> tuple[str, ...]:
    """The algorithms described for collective `kind` (ValueError for an unknown kind)."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r} (choose from {', '.join(KINDS)})")
    return tuple(alg for k, alg in PROGRAMS if k == kind)


def program(
    kind: str,
    alg: str,
    n: int,
    r: int,
    count: int,
    itemsize: int = 4,
    nodes: Sequence[int] | None = None,
) -> Program:
    """Rank r's program. `nodes` (hier only): the node of each group rank; default one
    node. ValueError for an unknown (kind, alg) or an impossible size."""
    if (kind, alg) not in PROGRAMS:
        raise ValueError(
            f"unknown {kind} algorithm {alg!r} (choose from {', '.join(algorithms(kind))})"
        )
    if n < 1 or not 0 <= r < n or count < 0 or itemsize < 1:
        raise ValueError(f"{kind} {alg}: no program for n={n} r={r} count={count}")
    return PROGRAMS[kind, alg](n, r, count, itemsize, nodes)


def trace(
    kind: str,
    alg: str,
    n: int,
    count: int,
    itemsize: int = 4,
    nodes: Sequence[int] | None = None,
) -> list[list[tuple]]:
    """Per group rank, in program order: the posts, waits and reductions (module docstring).
    Read off the very programs `execute` runs; a local copy (COPY) is ("copy", elements)."""
    out = []
    for r in range(n):
        ops: list[tuple] = []
        for op in program(kind, alg, n, r, count, itemsize, nodes).ops:
            code = op[0]
            if code == SEND or code == RECV:
                _, h, peer, _tag, _buf, lo, hi = op
                ops.append(("send" if code == SEND else "recv", h, peer, hi - lo))
            elif code == WAIT:
                ops.append(("wait", op[1]))
            elif code == ADD:
                ops.append(("reduce", op[2] - op[1]))
            else:
                assert code == COPY
                ops.append(("copy", op[2] - op[1]))
        out.append(ops)
    return out
