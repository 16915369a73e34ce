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

from collections.abc import Sequence
from functools import lru_cache

from proxies.core.collectives.common import TAG
from proxies.core.collectives.program import EMPTY, Builder, Program, S

TAG_UP, TAG_DOWN = TAG + 30, TAG + 31


def reduce_steps(b: Builder, peers: Sequence[int], i: int, count: int) -> None:
    """Member i of `peers` (group ranks; member 0 the root): the sum of every member's
    buffer into member 0's (others': partial sums)."""
    n, mask = len(peers), 1
    while mask < n:
        if i & mask:
            b.wait(b.send(peers[i - mask], TAG_UP, 0, count))
            return
        if i + mask < n:
            b.wait(b.recv(peers[i + mask], TAG_UP, 0, count, S))
            b.add(0, count, 0)
        mask <<= 1


def bcast_steps(b: Builder, peers: Sequence[int], i: int, count: int) -> None:
    """Member 0's buffer to every member of `peers`."""
    n = len(peers)
    # -- receive from the parent: i minus i's lowest set bit (member 0 receives nothing)
    mask = 1
    while mask < n:
        if i & mask:
            b.wait(b.recv(peers[i - mask], TAG_DOWN, 0, count))
            break
        mask <<= 1
    # -- send to the children: i + every lower power of two, largest subtree first
    mask >>= 1
    sends = []
    while mask:
        if i + mask < n:
            sends.append(b.send(peers[i + mask], TAG_DOWN, 0, count))
        mask >>= 1
    b.wait(*sends)


def _program(n: int, r: int, count: int, up: bool, down: bool) -> Program:
    if n == 1 or count == 0:
        return EMPTY
    b, peers = Builder(), range(n)
    if up:
        reduce_steps(b, peers, r, count)
    if down:
        bcast_steps(b, peers, r, count)
    return b.program()


@lru_cache(maxsize=4096)
def allreduce(n: int, r: int, count: int) -> Program:
    return _program(n, r, count, True, True)


@lru_cache(maxsize=4096)
def reduce(n: int, r: int, count: int) -> Program:
    """Binomial reduce to rank 0 (MPICH's MPI_Reduce for short messages)."""
    return _program(n, r, count, True, False)


@lru_cache(maxsize=4096)
def bcast(n: int, r: int, count: int) -> Program:
    """Binomial broadcast from rank 0 (MPICH's MPI_Bcast for short messages)."""
    return _program(n, r, count, False, True)
