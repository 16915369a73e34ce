"""Non-blocking point-to-point batches (a P2P with `req`): the engine's half of them.

`post` issues the batch: Isend of every send (with its --check checksum on the check
communicator), Irecv of every receive (and of its checksum). The requests join the
engine's pending table beside the non-blocking collectives', so the progress thread
(waiting.py) tests them while the rank computes and notes when they completed; the
engine's Wait blocks on them as on a collective's. `finish` runs after that Wait: --check
compares each received block with its sender's checksum, staged 16-bit copies go back.

--slow-link does not hold a non-blocking batch's messages (nor does the predictor): its
transfer is not measured apart from the time in flight, which includes the wait for the
peer and the compute it ran under; holding (F - 1) x that fed each neighbour's lateness
into the next hold and grew without bound.

Time: posting is exposed time of the batch's category (like starting a collective); the
Wait's blocked time is exposed; from the post until it was seen complete is
<category>_hidden. Unlike a blocking batch (Mprobe, then Mrecv), nothing here tells the
wait for the sender from the transfer, so a non-blocking batch books no idle: as for a
non-blocking collective, all its exposed time is its category's.

Received sizes: the plans' validation (simulate.py) has matched every message's count and
dtype with its sender's; a longer message than the receive is MPI's truncation error.
"""

from __future__ import annotations

import numpy as np

from proxies.core import check, wire
from proxies.core.plan import P2P

CAST = "dtype_cast"  # the engine's category of float32 <-> 16-bit wire conversions

# Largest count per MPI call: MPI counts are C ints (2^31 - 1), so longer messages go as
# consecutive pieces on the same tag (MPI keeps their order).
MAX_COUNT = 1 << 30


def pieces(buf: np.ndarray):
    """A message's consecutive pieces of at most MAX_COUNT elements."""
    flat = buf.reshape(-1)
    for lo in range(0, max(flat.size, 1), MAX_COUNT):
        yield flat[lo : lo + MAX_COUNT]


def isend_all(engine, sends, t) -> tuple[list, list]:
    """Start every send of a batch (16-bit wire copies staged; with --check its checksum
    first, and the `corrupt` fault after it): (the requests, the staged copies to keep
    alive until they complete)."""
    comm = engine.world
    reqs, staged = [], []
    for m in sends:
        buf = engine._buffer(m)
        out = engine._narrow(buf, m.dtype, t)
        if out is not buf:
            staged.append(out)
        if engine.check:
            if engine.mode != "real":
                check.fill(out, engine._seed(m))
            reqs.append(engine.check_comm.Isend(check.checksum(out), m.peer, m.tag))
            if engine.fault == "corrupt":  # after the checksum: the receiver must notice
                out.reshape(-1)[:1].view(np.uint8)[:1] ^= 1
        reqs += [comm.Isend(wire.transport(p), m.peer, m.tag) for p in pieces(out)]
    return reqs, staged


def post(engine, op: P2P, t) -> None:
    """Issue `op`'s sends and receives (engine: engine.Engine, t: its IterationTimes); it
    completes at Wait(op.req)."""
    MPI, comm = engine.MPI, engine.world
    engine.new_request(op.req)
    with engine._locked(t):
        t0 = MPI.Wtime()
        cast0 = t.seconds.get(CAST, 0.0)
        reqs, staged, recvs = *isend_all(engine, op.sends, t), []
        for m in op.recvs:
            buf = engine._buffer(m)
            into = engine._narrow(buf, m.dtype, t, copy=False)
            want = None
            if engine.check:
                want = np.empty(2, dtype=np.int64)
                reqs.append(engine.check_comm.Irecv(want, m.peer, m.tag))
            reqs += [comm.Irecv(wire.transport(p), m.peer, m.tag) for p in pieces(into)]
            recvs.append((m, buf, into, want))
        t1 = MPI.Wtime()
        t.seconds[op.category] += t1 - t0 - (t.seconds.get(CAST, 0.0) - cast0)
        # the pending table's layout: [op, buffer, requests, state, posted, completed, out]
        engine.pending[op.req] = [op, None, reqs, (recvs, staged), t0, None, None]
    if engine.trace is not None:
        engine.trace.post(op, t0, t1)
    if engine.progress is not None:
        engine.progress.resume()


def finish(engine, op: P2P, state, done: float, t) -> None:
    """After the Wait: verify (--check), widen, release the staging."""
    recvs, staged = state
    for m, buf, into, want in recvs:
        if engine.trace is not None:
            engine.trace.arrived(m, done)
        if want is not None:
            got = check.checksum(into)
            if not np.array_equal(got, want):
                from proxies.core.engine import CheckError

                raise CheckError(
                    f"--check: rank {engine.world.rank} received {m.buf} mb {m.mb} from rank "
                    f"{m.peer} (tag {m.tag}, iteration {engine.iteration}, non-blocking "
                    f"{op.req!r}) with crc32 {got[0]:#010x}, the sender sent {want[0]:#010x}"
                )
        engine._widen(into, buf, t)
    for out in staged:
        engine.staging.release(out)
