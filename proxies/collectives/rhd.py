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

import numpy as np

from proxies.collectives.common import TAG, Wait, bounds, flat, scratch, waitall, words

TAG_FOLD, TAG_RS, TAG_AG = TAG + 40, TAG + 41, TAG + 42


def allreduce(comm, buf: np.ndarray, wait: Wait | None = None) -> None:
    x, n, r = flat(buf), comm.size, comm.rank
    if n == 1 or x.size == 0:
        return
    wait = waitall(wait)
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    tmp = scratch(x.size, x.dtype)

    # -- fold the extra ranks into their odd neighbours
    if r < 2 * rem:
        if r % 2 == 0:
            wait([comm.Isend(words(x), r + 1, TAG_FOLD)])
            wait([comm.Irecv(words(x), r + 1, TAG_FOLD)])  # the result, after the unfold
            return
        wait([comm.Irecv(words(tmp), r - 1, TAG_FOLD)])
        np.add(x, tmp, out=x)
        v = r // 2
    else:
        v = r - rem

    def rank_of(u: int) -> int:
        return 2 * u + 1 if u < rem else u + rem

    off = bounds(x.size, p)

    def blocks(lo: int, hi: int) -> np.ndarray:
        return x[off[lo] : off[hi]]

    # -- reduce-scatter by recursive halving: window [lo, hi) of blocks halves each step
    lo, hi, mask = 0, p, p >> 1
    while mask:
        mid = (lo + hi) // 2
        (klo, khi), (slo, shi) = ((mid, hi), (lo, mid)) if v & mask else ((lo, mid), (mid, hi))
        keep, got = blocks(klo, khi), tmp[: off[khi] - off[klo]]
        peer = rank_of(v ^ mask)
        wait(
            [
                comm.Isend(words(blocks(slo, shi)), peer, TAG_RS),
                comm.Irecv(words(got), peer, TAG_RS),
            ]
        )
        np.add(keep, got, out=keep)
        lo, hi, mask = klo, khi, mask >> 1

    # -- allgather by recursive doubling: the partner's window is our window's sibling
    mask = 1
    while mask < p:
        size = hi - lo
        olo, ohi = (lo - size, lo) if v & mask else (hi, hi + size)
        peer = rank_of(v ^ mask)
        wait(
            [
                comm.Isend(words(blocks(lo, hi)), peer, TAG_AG),
                comm.Irecv(words(blocks(olo, ohi)), peer, TAG_AG),
            ]
        )
        lo, hi, mask = min(lo, olo), max(hi, ohi), mask << 1

    # -- unfold: give the folded neighbour its result
    if r < 2 * rem:
        wait([comm.Isend(words(x), r - 1, TAG_FOLD)])
