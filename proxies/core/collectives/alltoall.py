"""Pairwise all-to-all (MPICH's MPI_Alltoall for long messages): n - 1 exchanges.

The buffer is n equal blocks (count must be a multiple of n); block j goes to rank j, and
block j of the result is what rank j's block r was. At step s = 1 .. n-1 rank r sends
block (r + s) % n to r + s and receives block (r - s) % n from r - s, into scratch (a
block still to be sent may not be overwritten); the received blocks are copied into place
at the end. No arithmetic.
"""

from __future__ import annotations

from functools import lru_cache

from proxies.core.collectives.common import TAG
from proxies.core.collectives.program import EMPTY, Builder, Program, S

TAG_A2A = TAG + 70


@lru_cache(maxsize=4096)
def pairwise(n: int, r: int, count: int) -> Program:
    if count % n:
        raise ValueError(f"alltoall: {count} elements do not split into {n} equal blocks")
    if n == 1 or count == 0:
        return EMPTY
    b, m = Builder(), count // n
    for s in range(1, n):
        dst, src = (r + s) % n, (r - s) % n
        b.wait(
            b.send(dst, TAG_A2A, dst * m, dst * m + m),
            b.recv(src, TAG_A2A, src * m, src * m + m, S),
        )
    b.copy(0, r * m, 0)
    b.copy(r * m + m, count, r * m + m)
    return b.program()
