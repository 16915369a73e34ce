"""Run under mpiexec by tests/collectives/test_algorithms.py: every algorithm of
proxies.collectives against NumPy, on awkward counts, float32 and float64, with MPI's wait
and with the engine's sleeping one.

Two checks per result:
- value: |got - sum| <= (n-1) * eps(dtype) * sum|x_i| + tiny, against the float64 sum:
  the worst-case rounding of n-1 additions in any order (any algorithm, MPI's included);
- order: bit for bit equal to the summation order the algorithm's docstring states,
  replayed here with NumPy in the same dtype (every algorithm but mpi), and identical
  bytes on every rank.

Also the programs of what MPI runs (alltoall pairwise, bcast and reduce binomial), executed
and compared with NumPy, and hier's program on nodes that are not contiguous rank ranges.
"""

import sys
import time
import zlib

import numpy as np

from proxies.core import mpi
from proxies.core.collectives import (
    ALGORITHMS,
    allgather,
    allreduce,
    bounds,
    dbtree,
    reduce_scatter,
    run,
    steps,
)
from proxies.core.collectives.program import execute
from proxies.core.waiting import Waiter

MPI = mpi.init()
comm = MPI.COMM_WORLD
Waitall = MPI.Request.Waitall
n, r = comm.size, comm.rank
WAITS = sys.argv[1].split(",")  # "mpi" (default Waitall) and/or "yield" (Waiter)


# -- the documented summation orders, replayed on the inputs X[0..n-1] ------------------
def naive_order(X):
    acc = X[0].copy()
    for x in X[1:]:
        acc = acc + x
    return acc


def tree_order(X):
    def part(i, m):  # sum over ranks [i, i + m)
        if m == 1:
            return X[i]
        h = m // 2
        return part(i, h) + part(i + h, h) if i + h < len(X) else part(i, h)

    top = 1
    while top < len(X):
        top *= 2
    return part(0, top).copy()


def ring_order(X):
    m, out = len(X), np.empty_like(X[0])
    off = bounds(X[0].size, m)
    for b in range(m):
        s = slice(off[b], off[b + 1])
        acc = X[(b + 1) % m][s].copy()
        for j in range(2, m + 1):
            acc = acc + X[(b + j) % m][s]
        out[s] = acc
    return out


def rhd_order(X):
    p = 1 << (len(X).bit_length() - 1)
    rem = len(X) - p
    y = [X[2 * v] + X[2 * v + 1] if v < rem else X[v + rem] for v in range(p)]
    m = p // 2
    while m:
        y = [y[v] + y[v ^ m] for v in range(p)]
        m //= 2
    return y[0].copy()


def rd_order(X):
    p = 1 << (len(X).bit_length() - 1)
    rem = len(X) - p
    y = [X[2 * v] + X[2 * v + 1] if v < rem else X[v + rem] for v in range(p)]
    m = 1
    while m < p:
        y = [y[v] + y[v ^ m] for v in range(p)]
        m *= 2
    return y[0].copy()


def dbtree_order(X):
    out, half = np.empty_like(X[0]), bounds(X[0].size, 2)
    for t in (0, 1):
        s = slice(half[t], half[t + 1])
        tr = [dbtree.trees(n, u)[t] for u in range(n)]

        def sub(u, s=s, tr=tr):
            acc = X[u][s].copy()
            for c in tr[u][1]:
                acc = acc + sub(c)
            return acc

        out[s] = sub(next(u for u in range(n) if tr[u][0] < 0))
    return out


def hier_order(X, rpn):
    rpn = rpn or n  # one machine: MPI's shared-memory split is one node
    nodes = [X[k : k + rpn] for k in range(0, n, rpn)]
    return ring_order([tree_order(node) for node in nodes])


def labels_order(X, labels):
    """hier over any node labels: each node's members in rank order, nodes by lowest rank."""
    members = {}
    for i, k in enumerate(labels):
        members.setdefault(k, []).append(X[i])
    return ring_order([tree_order(m) for m in members.values()])


ORDERS = {
    "naive": naive_order,
    "tree": tree_order,
    "ring": ring_order,
    "rhd": rhd_order,
    "rd": rd_order,
    "dbtree": dbtree_order,
}


# -- checks ------------------------------------------------------------------------------
def inputs(count, dtype, salt=0):
    seed = [count, np.dtype(dtype).num, salt]
    return [
        np.random.default_rng([*seed, i]).standard_normal(count).astype(dtype) for i in range(n)
    ]


def check_value(what, got, X):
    want = np.sum(np.array(X, dtype=np.float64), axis=0) if X[0].size else np.zeros(0)
    scale = np.sum(np.abs(np.array(X, dtype=np.float64)), axis=0) if X[0].size else 0
    tol = (n - 1) * np.finfo(X[0].dtype).eps * scale + 1e-300
    bad = np.flatnonzero(np.abs(got.astype(np.float64) - want) > tol)
    assert bad.size == 0, f"{what}: {bad.size} wrong, e.g. {got[bad[0]]} vs {want[bad[0]]}"


def check_same_everywhere(what, got):
    crcs = comm.allgather(zlib.crc32(got.tobytes()))
    assert len(set(crcs)) == 1, f"{what}: ranks differ"


def run_allreduce(alg, count, dtype, wait, rpn=None, salt=0):
    X = inputs(count, dtype, salt)
    buf = X[r].copy()
    allreduce(comm, buf, alg, wait=wait, ranks_per_node=rpn)
    what = f"{alg} n={n} count={count} {np.dtype(dtype).name} rpn={rpn}"
    check_value(what, buf, X)
    if alg != "mpi":
        want = hier_order(X, rpn) if alg == "hier" else ORDERS[alg](X)
        assert np.array_equal(buf, want), f"{what}: not in the documented order"
        check_same_everywhere(what, buf)


def run_reduce_scatter(alg, count, dtype, wait):
    X = inputs(count, dtype, 1)
    buf = X[r].copy()
    reduce_scatter(comm, buf, alg, wait=wait)
    off = bounds(count, n)
    s = slice(off[r], off[r + 1])
    what = f"reduce_scatter {alg} n={n} count={count}"
    check_value(what, buf[s], [x[s] for x in X])
    if alg != "mpi":
        want = (ring_order if alg == "ring" else rhd_order)(X)[s]
        assert np.array_equal(buf[s], want), f"{what}: not in the documented order"


def run_allgather(alg, count, dtype, wait):
    X = inputs(count, dtype, 2)
    off = bounds(count, n)
    buf = np.zeros(count, dtype)
    buf[off[r] : off[r + 1]] = X[r][off[r] : off[r + 1]]
    allgather(comm, buf, alg, wait=wait)
    want = np.concatenate([X[i][off[i] : off[i + 1]] for i in range(n)])
    assert np.array_equal(buf, want), f"allgather {alg} n={n} count={count}"


def run_hier_labels(count, labels):
    """hier's program on nodes that are not contiguous ranges (execute, not the MPI split)."""
    X = inputs(count, np.float32, 4)
    buf = X[r].copy()
    execute(comm, buf, steps.program("allreduce", "hier", n, r, count, 4, labels), Waitall)
    what = f"hier n={n} count={count} nodes={labels}"
    check_value(what, buf, X)
    assert np.array_equal(buf, labels_order(X, labels)), f"{what}: not in the documented order"


def run_mpich_kinds(count, wait):
    """The programs of what MPI runs, executed: alltoall, bcast and reduce against NumPy."""
    X = inputs(count * n, np.float32, 5)
    buf = X[r].copy()
    run("alltoall", "pairwise", comm, buf, wait)
    want = np.concatenate([X[j][r * count : (r + 1) * count] for j in range(n)])
    assert np.array_equal(buf, want), f"alltoall pairwise n={n} count={count}"
    buf = X[r].copy()
    run("alltoall", "inplace", comm, buf, wait)
    assert np.array_equal(buf, want), f"alltoall inplace n={n} count={count}"
    buf = X[r].copy()
    run("bcast", "binomial", comm, buf, wait)
    assert np.array_equal(buf, X[0]), f"bcast binomial n={n}"
    buf = X[r].copy()
    run("reduce", "binomial", comm, buf, wait)
    if r == 0:
        assert np.array_equal(buf, tree_order(X)), f"reduce binomial n={n}"


t0 = time.time()
counts = sorted({c for c in (0, 1, 2, n - 1, n, n + 1, 2 * n + 3, 7 * n + 5, 1000 + n) if c >= 0})
for name in WAITS:
    wait = None if name == "mpi" else Waiter(MPI, "yield").waitall
    # every awkward count in float32; float64 (the same code, another MPI type) on two
    for dtype, some in ((np.float32, counts), (np.float64, (n + 1, 7 * n + 5))):
        for count in some:
            for alg in ALGORITHMS:
                run_allreduce(alg, count, dtype, wait)
            for rpn in (2, 3):
                run_allreduce("hier", count, dtype, wait, rpn)
            for alg in ("ring", "rh", "mpi"):
                run_reduce_scatter(alg, count, dtype, wait)
            for alg in ("ring", "rd", "mpi"):
                run_allgather(alg, count, dtype, wait)
    # dbtree's pipeline: many chunks per half, so chunks stream through the trees
    saved, dbtree.OVERHEAD_BYTES = dbtree.OVERHEAD_BYTES, 4
    for count in (n + 1, 7 * n + 5, 1000 + n):
        run_allreduce("dbtree", count, np.float32, wait, salt=3)
    dbtree.OVERHEAD_BYTES = saved
    for count in (0, 1, 3, 2 * n + 1):
        run_mpich_kinds(count, wait)

for labels in ([i % 2 for i in range(n)], [(i * 7) % 3 for i in range(n)], [5] * n):
    for count in (1, n + 1, 7 * n + 5):
        run_hier_labels(count, labels)

# integers sum exactly in any order: every algorithm must equal NumPy exactly
for alg in ALGORITHMS:
    for dtype in (np.int32, np.int64):
        X = [np.arange(i, i + 37, dtype=dtype) * (i + 1) for i in range(n)]
        buf = X[r].copy()
        allreduce(comm, buf, alg)
        assert np.array_equal(buf, np.sum(X, axis=0, dtype=dtype)), f"{alg} {dtype}"

# N-d contiguous buffers reduce in place; non-contiguous ones are refused
grid = np.full((3, 5), float(r + 1))
allreduce(comm, grid, "rhd")
assert np.array_equal(grid, np.full((3, 5), n * (n + 1) / 2))
try:
    allreduce(comm, np.zeros((4, 4))[:, 1], "ring")
    raise AssertionError("a strided buffer was accepted")
except ValueError:
    pass

comm.Barrier()
if r == 0:
    print(f"collectives OK on {n} ranks ({time.time() - t0:.1f} s)")
