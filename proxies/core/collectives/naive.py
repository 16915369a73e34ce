"""Naive allreduce: every rank sends its buffer to rank 0, which sums and sends it back.

Rank 0 receives the n - 1 buffers one after the other (one scratch buffer), then sends the
result to each rank. It moves (n - 1) x count through rank 0 in each direction: the
baseline the other algorithms are measured against, not something to use.

Summation order (deterministic): rank order, ((x_0 + x_1) + x_2) + ... + x_{n-1}.
"""

from __future__ import annotations

from functools import lru_cache

from proxies.core.collectives.common import TAG
from proxies.core.collectives.program import EMPTY, Builder, Program, S

TAG_UP, TAG_DOWN = TAG + 20, TAG + 21


@lru_cache(maxsize=4096)
def allreduce(n: int, r: int, count: int) -> Program:
    if n == 1 or count == 0:
        return EMPTY
    b = Builder()
    if r == 0:
        # -- reduce: add the others' buffers in rank order, one scratch buffer
        for src in range(1, n):
            b.wait(b.recv(src, TAG_UP, 0, count, S))
            b.add(0, count, 0)
        # -- broadcast: one send per rank
        b.wait(*[b.send(dst, TAG_DOWN, 0, count) for dst in range(1, n)])
    else:
        b.wait(b.send(0, TAG_UP, 0, count))
        b.wait(b.recv(0, TAG_DOWN, 0, count))
    return b.program()
