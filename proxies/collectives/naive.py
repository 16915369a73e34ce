"""Naive allreduce: every rank sends its buffer to rank 0, which sums and sends it back.

Rank 0 receives the n - 1 buffers one after the other (one scratch buffer), then sends the
result to each rank. It moves (n - 1) x count through rank 0 in each direction: the
baseline the other algorithms are measured against, not something to use.

Summation order (deterministic): rank order, ((x_0 + x_1) + x_2) + ... + x_{n-1}.
"""

from __future__ import annotations

import numpy as np

from proxies.collectives.common import TAG, Wait, flat, scratch, waitall, words

TAG_UP, TAG_DOWN = TAG + 20, TAG + 21


def allreduce(comm, buf: np.ndarray, wait: Wait | None = None) -> None:
    x, n, r = flat(buf), comm.size, comm.rank
    if n == 1 or x.size == 0:
        return
    wait = waitall(wait)
    if r == 0:
        # -- reduce: add the others' buffers in rank order
        tmp = scratch(x.size, x.dtype)
        for src in range(1, n):
            wait([comm.Irecv(words(tmp), src, TAG_UP)])
            np.add(x, tmp, out=x)
        # -- broadcast: one send per rank
        wait([comm.Isend(words(x), dst, TAG_DOWN) for dst in range(1, n)])
    else:
        wait([comm.Isend(words(x), 0, TAG_UP)])
        wait([comm.Irecv(words(x), 0, TAG_DOWN)])
