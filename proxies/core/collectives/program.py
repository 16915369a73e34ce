"""Programs: one rank's steps of a collective as data, and the one interpreter that runs them.

Every algorithm of this package is a pure function (n, r, count, ...) -> Program: rank r's
instructions for a group of n ranks and a buffer of `count` elements. The interpreter
(`execute`) runs any program over mpi4py; `proxies.core.collectives.steps.trace` reads the same
programs for the predictor. So what is executed and what is priced cannot drift apart.

Instruction set (tuples, first field the opcode; element ranges [lo, hi) are half-open):

    (SEND, h, peer, tag, buf, lo, hi)  post Isend of buf[lo:hi] to group rank `peer`
    (RECV, h, peer, tag, buf, lo, hi)  post Irecv into buf[lo:hi] from `peer`
    (WAIT, (h, ...))                   complete those requests (the caller's wait)
    (ADD, lo, hi, s)                   x[lo:hi] += scratch[s : s + hi - lo]
    (COPY, lo, hi, s)                  x[lo:hi] = scratch[s : s + hi - lo]

`buf` is X (the caller's buffer, reduced in place) or S (the program's scratch, `scratch`
elements, reused across calls). `h` is a request handle: an int unique within the program,
< `requests`. Posting and waiting are separate so that any overlap can be written down:
dbtree's chunk k + 1 is posted before chunk k is waited for, and its sends up the tree are
completed long after the receives that follow them. Every receive into scratch is waited
for before the ADD or COPY that reads it, and a buffer range is never read by a pending
send while written by another instruction: the builders keep that discipline (the tests
run every program against NumPy).

Summation is always x + scratch with NumPy (16-bit floats: widened to float32 and rounded
back per add, see proxies.core.wire), so the order of the ADDs is the summation order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from proxies.core.collectives.common import Wait, scratch, words

SEND, RECV, WAIT, ADD, COPY = range(5)
X, S = 0, 1  # the caller's buffer, the scratch buffer


@dataclass(frozen=True)
class Program:
    ops: tuple[tuple, ...]
    scratch: int = 0  # elements of scratch the program uses
    requests: int = 0  # handles 0 .. requests-1


EMPTY = Program(())


class Builder:
    """Appends instructions; hands out request handles; tracks the scratch size."""

    def __init__(self) -> None:
        self.ops: list[tuple] = []
        self.handles = 0
        self.scratch = 0

    def _post(self, code: int, peer: int, tag: int, buf: int, lo: int, hi: int) -> int:
        h = self.handles
        self.handles += 1
        self.ops.append((code, h, peer, tag, buf, lo, hi))
        if buf == S:
            self.scratch = max(self.scratch, hi)
        return h

    def send(self, peer: int, tag: int, lo: int, hi: int, buf: int = X) -> int:
        return self._post(SEND, peer, tag, buf, lo, hi)

    def recv(self, peer: int, tag: int, lo: int, hi: int, buf: int = X) -> int:
        return self._post(RECV, peer, tag, buf, lo, hi)

    def wait(self, *handles: int) -> None:
        # an empty wait completes nothing: not written down
        if handles:
            self.ops.append((WAIT, tuple(handles)))

    def add(self, lo: int, hi: int, s: int) -> None:
        self.scratch = max(self.scratch, s + hi - lo)
        self.ops.append((ADD, lo, hi, s))

    def copy(self, lo: int, hi: int, s: int) -> None:
        self.scratch = max(self.scratch, s + hi - lo)
        self.ops.append((COPY, lo, hi, s))

    def program(self) -> Program:
        return Program(tuple(self.ops), self.scratch, self.handles)


def execute(comm, x: np.ndarray, prog: Program, wait: Wait) -> None:
    """Run `prog` on the 1-D buffer x over comm (peers are comm's ranks)."""
    if not prog.ops:
        return
    tmp = scratch(prog.scratch, x.dtype)
    bufs = (words(x), words(tmp))  # what MPI is given: 16-bit floats as uint16 words
    reqs: list = [None] * prog.requests
    isend, irecv, add = comm.Isend, comm.Irecv, np.add
    for op in prog.ops:
        code = op[0]
        if code == SEND:
            _, h, peer, tag, b, lo, hi = op
            reqs[h] = isend(bufs[b][lo:hi], peer, tag)
        elif code == RECV:
            _, h, peer, tag, b, lo, hi = op
            reqs[h] = irecv(bufs[b][lo:hi], peer, tag)
        elif code == WAIT:
            wait([reqs[h] for h in op[1]])
        elif code == ADD:
            _, lo, hi, s = op
            y = x[lo:hi]
            add(y, tmp[s : s + hi - lo], out=y)
        else:  # COPY
            _, lo, hi, s = op
            x[lo:hi] = tmp[s : s + hi - lo]
