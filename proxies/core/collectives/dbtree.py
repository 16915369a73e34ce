r"""Double binary tree (NCCL, MPICH): two complementary binary trees, each reducing and then
broadcasting half of the buffer, pipelined in chunks.

Tree construction (NCCL's ncclGetBtree / ncclGetDtree). Tree 0 is an in-order binary tree
on rank indices: a rank's level is its lowest set bit b; its parent is (r ^ b) | 2b, or
r ^ b when that is out of range; its children are r - b/2 and r + b/2 (b/2 halved until
in range). Rank 0 is the root, with the single child (the power of two >= n) / 2:

    0 ---------- 8          n = 12: odd ranks are leaves, even ranks inner nodes
           _____/ \
          4        10
        /   \     /  \
       2     6   9   11
      / \   / \
     1   3 5   7

Tree 1 is tree 0 mirrored (r -> n-1-r) when n is even, shifted (r -> r+1 mod n) when n
is odd. Mirroring turns the leaves (odd ranks) into inner nodes, so most ranks are a leaf
in one tree and inner in the other: each rank forwards about one half-buffer up and down,
spreading the load that a single tree puts on its inner nodes, at log2 n depth.

Schedule: half h (np.array_split into 2) goes over tree h in K chunks (chunk_count).
  reduce, chunk k = 0, 1, ..., both trees interleaved: receive chunk k from the children
      (chunk k + 1 already posted into a second slot), add, send it up (Isend: a rank does
      not wait for its parent, so chunks stream up the tree);
  broadcast: every chunk's receive from the parent is posted up front (chunk by chunk,
      both trees interleaved, the order the parent sends them); as each arrives it goes
      to the children.
Every wait is on a message whose sender never waits on this rank within the phase, so the
schedule cannot deadlock; separate tags per tree and phase keep the streams apart.

Summation order (deterministic): post-order on the half's tree: a rank's partial sum is
(x_r + sum of its first child's subtree) + sum of its second child's subtree, children in
the order (r - b/2, r + b/2); the root's partial is the result.
"""

from __future__ import annotations

import math
from functools import lru_cache

from proxies.core.collectives.common import TAG, bounds
from proxies.core.collectives.program import EMPTY, Builder, Program, S

# Pipeline: in K chunks a phase takes K + h - 1 steps over a tree of h hops, each step
# costing chunk / bandwidth + o (o: the per-message overhead). For S bytes that is least
# at K = sqrt((h - 1) S / (bandwidth o)), the classic pipelined-broadcast optimum.
# bandwidth x o = 1 MiB is measured, not derived: on the 2-core dev box (4 ranks, 16 MiB)
# it ran 1.5-3x faster than 64-256 KiB (each wait there can cost a context switch); with
# a core per rank ~100 KiB (20 us at 5 GB/s) would fit better.
OVERHEAD_BYTES = 1 << 20


def chunk_count(n: int, nbytes: int) -> int:
    """K for a half of nbytes over n ranks (from n and the size only: every rank agrees)."""
    hops = (n - 1).bit_length()  # tree height: 0 -> 2^k / 2 -> ... -> a leaf
    return max(1, math.ceil(math.sqrt((hops - 1) * nbytes / OVERHEAD_BYTES)))


TAG_UP, TAG_DOWN = TAG + 50, TAG + 52  # + tree index


def btree(n: int, r: int) -> tuple[int, list[int]]:
    """(parent or -1, children) of rank r in NCCL's binary tree rooted at 0."""
    bit = 1
    while bit < n and not r & bit:
        bit <<= 1
    if r == 0:
        return -1, ([bit >> 1] if n > 1 else [])
    parent = (r ^ bit) | (bit << 1)
    if parent >= n:
        parent = r ^ bit
    low, children = bit >> 1, []
    if low:
        children.append(r - low)
    while low and r + low >= n:
        low >>= 1
    if low:
        children.append(r + low)
    return parent, children


def trees(n: int, r: int) -> list[tuple[int, list[int]]]:
    """[(parent, children) in tree 0, the same in tree 1] for rank r."""
    if n % 2 == 0:
        there = back = lambda u: n - 1 - u  # noqa: E731 (mirror is its own inverse)
    else:
        there, back = (lambda u: (u - 1) % n), (lambda u: (u + 1) % n)
    parent, children = btree(n, there(r))
    mirrored = (back(parent) if parent >= 0 else -1, [back(c) for c in children])
    return [btree(n, r), mirrored]


def chunking(n: int, count: int, itemsize: int) -> tuple[int, list[list[tuple[int, int]]]]:
    """(step, chunks): chunks[t][k] = element range [lo, hi) of chunk k of half t; tree t
    moves half t in chunks of `step` elements (the last one shorter)."""
    half = bounds(count, 2)
    step = math.ceil(half[1] / chunk_count(n, half[1] * itemsize))  # half 0 is the larger
    return step, [
        [(lo, min(lo + step, half[t + 1])) for lo in range(half[t], half[t + 1], step)]
        for t in (0, 1)
    ]


@lru_cache(maxsize=4096)
def allreduce(n: int, r: int, count: int, itemsize: int, overhead: int = OVERHEAD_BYTES) -> Program:
    """`overhead` is OVERHEAD_BYTES at the call (part of the cache key: tests change it)."""
    if n == 1 or count == 0:
        return EMPTY
    b = Builder()
    step, chunks = chunking(n, count, itemsize)
    tree = trees(n, r)
    K = max(len(chunks[0]), len(chunks[1]))

    def slot(k: int, t: int, j: int) -> int:  # scratch[k % 2, t, child j]: step elements
        return ((k % 2 * 2 + t) * 2 + j) * step

    # -- reduce up both trees, chunk by chunk
    def post(k: int) -> list[list[int]]:
        out: list[list[int]] = [[], []]
        for t in (0, 1):
            if k < len(chunks[t]):
                size = chunks[t][k][1] - chunks[t][k][0]
                for j, c in enumerate(tree[t][1]):
                    out[t].append(b.recv(c, TAG_UP + t, slot(k, t, j), slot(k, t, j) + size, S))
        return out

    sends, recvs = [], post(0)
    for k in range(K):
        ahead = post(k + 1) if k + 1 < K else [[], []]
        for t in (0, 1):
            if k >= len(chunks[t]):
                continue
            lo, hi = chunks[t][k]
            b.wait(*recvs[t])
            for j in range(len(tree[t][1])):
                b.add(lo, hi, slot(k, t, j))
            if tree[t][0] >= 0:
                sends.append(b.send(tree[t][0], TAG_UP + t, lo, hi))
        recvs = ahead
    b.wait(*sends)  # before the broadcast overwrites what they send

    # -- broadcast down both trees: all receives posted, forwarded as they arrive
    down: list[list[int]] = [[], []]
    for k in range(K):
        for t in (0, 1):
            if k < len(chunks[t]) and tree[t][0] >= 0:
                down[t].append(b.recv(tree[t][0], TAG_DOWN + t, *chunks[t][k]))
    sends = []
    for k in range(K):
        for t in (0, 1):
            if k >= len(chunks[t]):
                continue
            if down[t]:
                b.wait(down[t][k])
            sends += [b.send(c, TAG_DOWN + t, *chunks[t][k]) for c in tree[t][1]]
    b.wait(*sends)
    return b.program()
