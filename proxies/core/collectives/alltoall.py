"""Pairwise all-to-all (MPICH's MPI_Alltoall for long messages): n - 1 exchanges; and
MPICH's in-place all-to-all (what MPI_Alltoall(MPI_IN_PLACE, ...) and its non-blocking form
run whatever the size): pairs (i, j), i < j, in one global order, each a sendrecv_replace.

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


@lru_cache(maxsize=4096)
def inplace(n: int, r: int, count: int) -> Program:
    """MPICH's in-place algorithm: for i = 0 .. n-1, for j = i+1 .. n-1, ranks i and j swap
    their blocks for each other (MPIC_Sendrecv_replace: the block goes out, the peer's comes
    into a temporary and is copied back), every rank taking its pairs in that global order.
    Rank r's exchanges are therefore serialised behind other pairs': on 4 ranks the longest
    chain is 5 exchanges, not pairwise's 3. Same bytes as pairwise."""
    if count % n:
        raise ValueError(f"alltoall: {count} elements do not split into {n} equal blocks")
    if n == 1 or count == 0:
        return EMPTY
    b, m = Builder(), count // n
    for i in range(n):
        for j in range(i + 1, n):
            if r not in (i, j):
                continue
            peer = j if r == i else i
            b.wait(
                b.send(peer, TAG_A2A, peer * m, peer * m + m),
                b.recv(peer, TAG_A2A, 0, m, S),
            )
            b.copy(peer * m, peer * m + m, 0)
    return b.program()
