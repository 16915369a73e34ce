"""Recursive doubling: allreduce (MPICH's choice for short messages) and allgather.

n ranks, p the largest power of two <= n, rem = n - p; the fold and the virtual ranks are
rhd's (rhd.fold, rhd.virtual).

  allreduce: fold (even r < 2 rem send the whole buffer to r + 1, which adds it); then
      for mask = 1, 2, ..., p/2 virtual v exchanges its whole buffer with v ^ mask and adds
      the partner's; unfold (odd r < 2 rem send the result to r - 1). log2 p steps of the
      whole buffer (+ 2 when n is not a power of two): latency-optimal, n times the
      traffic of ring, so for small messages only.
  allgather: the buffer is bounds(count, n)'s n blocks, rank r holding block r. fold:
      even r < 2 rem send their block to r + 1; virtual v then holds the contiguous share
      rhd.virtual_blocks gives it, and for mask = 1, 2, ..., p/2 exchanges its window of
      shares with v ^ mask, the window doubling; unfold: odd r < 2 rem send the whole
      buffer to r - 1. (MPICH runs this for power-of-two groups below 512 KiB.)

Summation order (allreduce, deterministic): fold y_i = x_{2i} + x_{2i+1} (i < rem),
y_v = x_{v+rem} otherwise; then a butterfly over the lowest bit first: for p = 4,
(y_0 + y_1) + (y_2 + y_3). Both partners of a step add the same two values (IEEE addition
commutes), so every rank ends with identical bytes.
"""

from __future__ import annotations

from functools import lru_cache

from proxies.core.collectives.common import TAG, bounds
from proxies.core.collectives.program import EMPTY, Builder, Program, S
from proxies.core.collectives.rhd import doubling, fold, rank_of, virtual, virtual_blocks

TAG_FOLD, TAG_RD, TAG_AG_FOLD, TAG_AG = TAG + 60, TAG + 61, TAG + 62, TAG + 63


@lru_cache(maxsize=4096)
def allreduce(n: int, r: int, count: int) -> Program:
    if n == 1 or count == 0:
        return EMPTY
    b = Builder()
    p, rem = fold(n)
    if r < 2 * rem:
        if r % 2 == 0:
            b.wait(b.send(r + 1, TAG_FOLD, 0, count))
            b.wait(b.recv(r + 1, TAG_FOLD, 0, count))
            return b.program()
        b.wait(b.recv(r - 1, TAG_FOLD, 0, count, S))
        b.add(0, count, 0)
    v, mask = virtual(r, rem), 1
    while mask < p:
        peer = rank_of(v ^ mask, rem)
        b.wait(b.send(peer, TAG_RD, 0, count), b.recv(peer, TAG_RD, 0, count, S))
        b.add(0, count, 0)
        mask <<= 1
    if r < 2 * rem:
        b.wait(b.send(r - 1, TAG_FOLD, 0, count))
    return b.program()


@lru_cache(maxsize=4096)
def allgather(n: int, r: int, count: int) -> Program:
    if n == 1 or count == 0:
        return EMPTY
    b = Builder()
    p, rem = fold(n)
    off = bounds(count, n)
    if r < 2 * rem:
        if r % 2 == 0:
            b.wait(b.send(r + 1, TAG_AG_FOLD, off[r], off[r + 1]))
            b.wait(b.recv(r + 1, TAG_AG_FOLD, 0, count))
            return b.program()
        b.wait(b.recv(r - 1, TAG_AG_FOLD, off[r - 1], off[r]))
    v = virtual(r, rem)
    doubling(b, v, rem, p, virtual_blocks(n, count), TAG_AG, v, v + 1)
    if r < 2 * rem:
        b.wait(b.send(r - 1, TAG_AG_FOLD, 0, count))
    return b.program()
