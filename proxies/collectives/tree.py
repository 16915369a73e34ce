"""Binomial tree allreduce: reduce to rank 0, then broadcast from it, ceil(log2 n) rounds
each way, each round moving the whole buffer.

  reduce, rounds mask = 1, 2, 4, ...: a rank with bit `mask` set sends its partial sum to
      r - mask and is done; the others receive from r + mask (if it exists) and add.
  broadcast: the same rounds in reverse, r sending to r + mask.

Latency log2 n, traffic log2 n x count per rank on the busiest path: good for small
messages, poor for large ones. `reduce` and `bcast` are also the intra-node steps of hier.

Summation order (deterministic): a fixed binary tree over rank indices: the sum over
ranks [r, r + 2m) is (sum over [r, r + m)) + (sum over [r + m, r + 2m)), so for 8 ranks
((x_0 + x_1) + (x_2 + x_3)) + ((x_4 + x_5) + (x_6 + x_7)).
"""

from __future__ import annotations

import numpy as np

from proxies.collectives.common import TAG, Wait, flat, scratch, waitall, words

TAG_UP, TAG_DOWN = TAG + 30, TAG + 31


def reduce(comm, x: np.ndarray, wait: Wait) -> None:
    """Sum of every rank's x into rank 0's x (others' x: partial sums)."""
    n, r = comm.size, comm.rank
    tmp = scratch(x.size, x.dtype) if n > 1 else None
    mask = 1
    while mask < n:
        if r & mask:
            wait([comm.Isend(words(x), r - mask, TAG_UP)])
            return
        if r + mask < n:
            wait([comm.Irecv(words(tmp), r + mask, TAG_UP)])
            np.add(x, tmp, out=x)
        mask <<= 1


def bcast(comm, x: np.ndarray, wait: Wait) -> None:
    """Rank 0's x to every rank."""
    n, r = comm.size, comm.rank
    # -- receive from the parent: r minus r's lowest set bit (rank 0 receives nothing)
    mask = 1
    while mask < n:
        if r & mask:
            wait([comm.Irecv(words(x), r - mask, TAG_DOWN)])
            break
        mask <<= 1
    # -- send to the children: r + every lower power of two, largest subtree first
    mask >>= 1
    reqs = []
    while mask:
        if r + mask < n:
            reqs.append(comm.Isend(words(x), r + mask, TAG_DOWN))
        mask >>= 1
    wait(reqs)


def allreduce(comm, buf: np.ndarray, wait: Wait | None = None) -> None:
    x = flat(buf)
    if comm.size == 1 or x.size == 0:
        return
    wait = waitall(wait)
    reduce(comm, x, wait)
    bcast(comm, x, wait)
