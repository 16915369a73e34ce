"""Ring allreduce: reduce-scatter, then allgather, each n - 1 steps around the ring.

n ranks; rank r sends to r + 1 and receives from r - 1 (indices mod n). The buffer is cut
into blocks B_0 .. B_{n-1} (common.bounds: np.array_split boundaries, some maybe empty).

  reduce-scatter, step s = 0 .. n-2: send B_{r-s-1}, receive B_{r-s-2} and add it in.
      After n - 1 steps rank r holds the full sum of B_r, at B_r's own position.
  allgather, step s = 0 .. n-2: send B_{r-s}, receive B_{r-s-1} in place.

Each rank sends 2(n-1)/n of the buffer in 2(n-1) steps: bandwidth-optimal, so this is the
algorithm for large messages; latency grows with n, so small ones want tree or rhd.

Summation order (deterministic): block b starts at rank b+1 and collects the ranks in ring
order, ((x_{b+1} + x_{b+2}) + x_{b+3}) + ... + x_b. Each element is summed once, by its
block's owner, and copied to the others: every rank ends with identical bytes. MPI's own
Allreduce sums in another order, so the two agree to rounding, not bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from proxies.core.collectives.common import TAG, bounds
from proxies.core.collectives.program import EMPTY, Builder, Program, S

TAG_RS, TAG_AG = TAG + 10, TAG + 11


def reduce_scatter_steps(b: Builder, peers: Sequence[int], i: int, count: int) -> None:
    """Member i of the ring `peers` ends with the sum of block i at its own position."""
    n = len(peers)
    off = bounds(count, n)
    right, left = peers[(i + 1) % n], peers[(i - 1) % n]
    # -- the partial sum of a block travels right, each rank adding its own
    for s in range(n - 1):
        out, mine = (i - s - 1) % n, (i - s - 2) % n
        lo, hi = off[mine], off[mine + 1]
        b.wait(
            b.send(right, TAG_RS, off[out], off[out + 1]),
            b.recv(left, TAG_RS, 0, hi - lo, S),
        )
        b.add(lo, hi, 0)


def allgather_steps(b: Builder, peers: Sequence[int], i: int, count: int) -> None:
    """Member i contributes block i; afterwards every block is filled."""
    n = len(peers)
    off = bounds(count, n)
    right, left = peers[(i + 1) % n], peers[(i - 1) % n]
    # -- finished blocks travel right, received straight into place
    for s in range(n - 1):
        out, got = (i - s) % n, (i - s - 1) % n
        b.wait(
            b.send(right, TAG_AG, off[out], off[out + 1]),
            b.recv(left, TAG_AG, off[got], off[got + 1]),
        )


def allreduce_steps(b: Builder, peers: Sequence[int], i: int, count: int) -> None:
    reduce_scatter_steps(b, peers, i, count)
    allgather_steps(b, peers, i, count)


def _program(steps, n: int, r: int, count: int) -> Program:
    if n == 1 or count == 0:
        return EMPTY
    b = Builder()
    steps(b, range(n), r, count)
    return b.program()


@lru_cache(maxsize=4096)
def reduce_scatter(n: int, r: int, count: int) -> Program:
    """Leave the sum of block r at its own position (other blocks: partial sums)."""
    return _program(reduce_scatter_steps, n, r, count)


@lru_cache(maxsize=4096)
def allgather(n: int, r: int, count: int) -> Program:
    """Every rank contributes block r of the buffer; afterwards all blocks are filled."""
    return _program(allgather_steps, n, r, count)


@lru_cache(maxsize=4096)
def allreduce(n: int, r: int, count: int) -> Program:
    return _program(allreduce_steps, n, r, count)
