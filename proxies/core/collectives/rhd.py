"""Recursive halving / doubling (Rabenseifner): reduce-scatter by halving the buffer over
log2 p partners, then allgather by doubling it back.

n ranks, p the largest power of two <= n, rem = n - p.

  fold: ranks 2i and 2i+1 (i < rem) pair up; the even one sends its whole buffer to the
      odd one, which adds it, and waits for the result. The p remaining ranks get virtual
      ranks v = 0 .. p-1 (odd r < 2 rem: r // 2; the rest: r - rem).
  reduce-scatter, mask = p/2, p/4, ..., 1: the buffer is cut into p blocks; v owns a
      window of blocks that halves every step. With partner v ^ mask, v keeps the upper
      half of the window if its bit `mask` is set, else the lower half, sends the other
      half and adds the partner's copy of the kept half. After log2 p steps v owns block v.
  allgather, mask = 1, 2, ..., p/2: exchange windows with v ^ mask; the window doubles.
  unfold: odd r < 2 rem send the result to r - 1.

Per rank 2(p-1)/p of the buffer in 2 log2 p steps (plus the whole buffer twice on folded
ranks): bandwidth-optimal like ring with logarithmic latency; MPICH's large-message default.

Summation order (deterministic, the same for every element): fold y_i = x_{2i} + x_{2i+1}
(i < rem), y_v = x_{v+rem} otherwise; then a butterfly over the highest bit first: for
p = 8, ((y_0 + y_4) + (y_2 + y_6)) + ((y_1 + y_5) + (y_3 + y_7)).
"""

from __future__ import annotations

from functools import lru_cache

from proxies.core.collectives.common import TAG, bounds
from proxies.core.collectives.program import EMPTY, Builder, Program, S

TAG_FOLD, TAG_RS, TAG_AG = TAG + 40, TAG + 41, TAG + 42
TAG_RH_FOLD, TAG_RH = TAG + 43, TAG + 44  # reduce_scatter's recursive halving


def fold(n: int) -> tuple[int, int]:
    """(p, rem): the largest power of two p <= n, and the n - p ranks folded away."""
    p = 1 << (n.bit_length() - 1)
    return p, n - p


def virtual(r: int, rem: int) -> int:
    """r's virtual rank among the p that remain after the fold (-1: folded away)."""
    if r < 2 * rem:
        return r // 2 if r % 2 else -1
    return r - rem


def rank_of(v: int, rem: int) -> int:
    return 2 * v + 1 if v < rem else v + rem


def halving(b: Builder, v: int, rem: int, p: int, off: list[int], tag: int) -> tuple[int, int]:
    """Recursive halving among the p virtual ranks over shares `off` (p + 1 offsets): v's
    window [lo, hi) of shares halves each step, the half it keeps summed with its
    partner's copy. Returns the window left (v's own share)."""
    lo, hi, mask = 0, p, p >> 1
    while mask:
        mid = (lo + hi) // 2
        (klo, khi), (slo, shi) = ((mid, hi), (lo, mid)) if v & mask else ((lo, mid), (mid, hi))
        peer = rank_of(v ^ mask, rem)
        b.wait(
            b.send(peer, tag, off[slo], off[shi]),
            b.recv(peer, tag, 0, off[khi] - off[klo], S),
        )
        b.add(off[klo], off[khi], 0)
        lo, hi, mask = klo, khi, mask >> 1
    return lo, hi


def doubling(
    b: Builder, v: int, rem: int, p: int, off: list[int], tag: int, lo: int, hi: int
) -> None:
    """Recursive doubling among the p virtual ranks over shares `off`: v's window
    [lo, hi) of shares is exchanged with its partner's sibling window and doubles."""
    mask = 1
    while mask < p:
        size = hi - lo
        olo, ohi = (lo - size, lo) if v & mask else (hi, hi + size)
        peer = rank_of(v ^ mask, rem)
        b.wait(
            b.send(peer, tag, off[lo], off[hi]),
            b.recv(peer, tag, off[olo], off[ohi]),
        )
        lo, hi, mask = min(lo, olo), max(hi, ohi), mask << 1


@lru_cache(maxsize=4096)
def allreduce(n: int, r: int, count: int) -> Program:
    if n == 1 or count == 0:
        return EMPTY
    b = Builder()
    p, rem = fold(n)

    # -- fold the extra ranks into their odd neighbours
    if r < 2 * rem:
        if r % 2 == 0:
            b.wait(b.send(r + 1, TAG_FOLD, 0, count))
            b.wait(b.recv(r + 1, TAG_FOLD, 0, count))  # the result, after the unfold
            return b.program()
        b.wait(b.recv(r - 1, TAG_FOLD, 0, count, S))
        b.add(0, count, 0)
    v = virtual(r, rem)
    off = bounds(count, p)

    # -- reduce-scatter by recursive halving: window [lo, hi) of blocks halves each step
    lo, hi = halving(b, v, rem, p, off, TAG_RS)
    # -- allgather by recursive doubling: the partner's window is our window's sibling
    doubling(b, v, rem, p, off, TAG_AG, lo, hi)

    # -- unfold: give the folded neighbour its result
    if r < 2 * rem:
        b.wait(b.send(r - 1, TAG_FOLD, 0, count))
    return b.program()


def virtual_blocks(n: int, count: int) -> list[int]:
    """Element offsets of the p virtual ranks' shares of n blocks (bounds(count, n)):
    virtual rank v < rem holds blocks 2v and 2v+1 (its folded pair's), the others block
    v + rem; so virtual v's share is [voff[v], voff[v+1]), contiguous and in order."""
    p, rem = fold(n)
    off = bounds(count, n)
    return [off[2 * v if v < rem else v + rem] for v in range(p)] + [count]


@lru_cache(maxsize=4096)
def reduce_scatter(n: int, r: int, count: int) -> Program:
    """Recursive halving (MPICH's reduce_scatter for commutative ops below 512 KiB): rank
    r ends with the sum of block r of bounds(count, n) at its own position.

    fold: even r < 2 rem send the whole buffer to r + 1, which adds it; halving over the
    p virtual ranks, each keeping the half of its window of virtual shares that holds its
    own (virtual_blocks); unfold: odd r < 2 rem send block r - 1 to r - 1. Summation
    order: rhd's (fold pairs, then the butterfly, highest bit first)."""
    if n == 1 or count == 0:
        return EMPTY
    b = Builder()
    p, rem = fold(n)
    off = bounds(count, n)
    if r < 2 * rem:
        if r % 2 == 0:
            b.wait(b.send(r + 1, TAG_RH_FOLD, 0, count))
            b.wait(b.recv(r + 1, TAG_RH_FOLD, off[r], off[r + 1]))
            return b.program()
        b.wait(b.recv(r - 1, TAG_RH_FOLD, 0, count, S))
        b.add(0, count, 0)
    halving(b, virtual(r, rem), rem, p, virtual_blocks(n, count), TAG_RH)
    if r < 2 * rem:
        b.wait(b.send(r - 1, TAG_RH_FOLD, off[r - 1], off[r]))
    return b.program()
