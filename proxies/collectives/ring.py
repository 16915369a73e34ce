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

import numpy as np

from proxies.collectives.common import TAG, Wait, bounds, flat, scratch, waitall, words

TAG_RS, TAG_AG = TAG + 10, TAG + 11


def reduce_scatter(comm, buf: np.ndarray, wait: Wait | None = None) -> None:
    """Leave the sum of block comm.rank at its own position in buf (other blocks: partial)."""
    x, n, r = flat(buf), comm.size, comm.rank
    if n == 1 or x.size == 0:
        return
    wait = waitall(wait)
    off = bounds(x.size, n)

    def block(i: int) -> np.ndarray:
        return x[off[i % n] : off[i % n + 1]]

    tmp = scratch(off[1], x.dtype)  # block 0 is a largest block
    right, left = (r + 1) % n, (r - 1) % n
    # -- reduce-scatter: the partial sum of a block travels right, each rank adding its own
    for s in range(n - 1):
        out, mine = block(r - s - 1), block(r - s - 2)
        got = tmp[: mine.size]
        wait([comm.Isend(words(out), right, TAG_RS), comm.Irecv(words(got), left, TAG_RS)])
        np.add(mine, got, out=mine)


def allgather(comm, buf: np.ndarray, wait: Wait | None = None) -> None:
    """Every rank contributes block comm.rank of buf; afterwards all blocks are filled."""
    x, n, r = flat(buf), comm.size, comm.rank
    if n == 1 or x.size == 0:
        return
    wait = waitall(wait)
    off = bounds(x.size, n)

    def block(i: int) -> np.ndarray:
        return x[off[i % n] : off[i % n + 1]]

    right, left = (r + 1) % n, (r - 1) % n
    # -- allgather: finished blocks travel right, received straight into place
    for s in range(n - 1):
        wait(
            [
                comm.Isend(words(block(r - s)), right, TAG_AG),
                comm.Irecv(words(block(r - s - 1)), left, TAG_AG),
            ]
        )


def allreduce(comm, buf: np.ndarray, wait: Wait | None = None) -> None:
    reduce_scatter(comm, buf, wait)
    allgather(comm, buf, wait)
