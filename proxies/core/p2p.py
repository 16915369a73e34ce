"""Point-to-point batches (P2P ops), blocking and non-blocking: the engine's half of them.

Time: a batch's category (e.g. "pp") gets what its MPI calls take. The engine's own work on
it comes before or after that span and is booked, with the rest of its time, as `overhead`:
finding the buffers and staging 16-bit copies (the conversions themselves are dtype_cast),
what the watchdog is told, --check's checksums of what it sends, widening what arrived. So
the category is comparable with the same calls in a plain loop: on 2 ranks a 64-byte
exchange measured 1.7 us in a loop, and the engine booked 12.5 us to it before this split
(benchmarks/engine_overhead.py).

Blocking (`run`): Isend of every send, then per receive Mprobe, which returns once the
message exists (until then: idle, the wait for the sender), and Mrecv; then the sends
complete. Receiving by probe is what lets the wait be split from the transfer; sends being
Isends that complete with their batch, a batch (Megatron's batch_isend_irecv) can never
deadlock against its mirror image.

Non-blocking (a P2P with `req`): `post` issues the batch: Isend of every send (with its
--check checksum on the check communicator), Irecv of every receive (and of its checksum).
The requests join the engine's pending table beside the non-blocking collectives', so the
progress thread (waiting.py) tests them while the rank computes and notes when they
completed; the engine's Wait blocks on them as on a collective's. `finish` runs after that
Wait: --check compares each received block with its sender's checksum, staged 16-bit
copies go back. Posting is exposed time of the batch's category (like starting a
collective); the Wait's blocked time is exposed; from the post until it was seen complete
is <category>_hidden. Unlike a blocking batch, nothing here tells the wait for the sender
from the transfer, so a non-blocking batch books no idle: as for a non-blocking
collective, all its exposed time is its category's.

--slow-link does not hold a non-blocking batch's messages (nor does the predictor): its
transfer is not measured apart from the time in flight, which includes the wait for the
peer and the compute it ran under; holding (F - 1) x that fed each neighbour's lateness
into the next hold and grew without bound.

Received sizes: the plans' validation (simulate.py) has matched every message's count and
dtype with its sender's; a longer message than the receive is MPI's truncation error.
"""

from __future__ import annotations

import numpy as np

from proxies.core import check, wire
from proxies.core.faults import DELAY
from proxies.core.plan import P2P

CAST = "dtype_cast"  # the engine's category of float32 <-> 16-bit wire conversions

# Largest count per MPI call: MPI counts are C ints (2^31 - 1), so longer messages go as
# consecutive pieces on the same tag (MPI keeps their order).
MAX_COUNT = 1 << 30


def pieces(buf: np.ndarray):
    """A message's consecutive pieces of at most MAX_COUNT elements."""
    flat = buf.reshape(-1)
    if flat.size <= MAX_COUNT:
        return (flat,)
    return [flat[lo : lo + MAX_COUNT] for lo in range(0, flat.size, MAX_COUNT)]


def stage(engine, msgs, t, send: bool) -> list[tuple]:
    """Per message: (msg, its compute buffer, what the wire carries: the buffer itself or a
    16-bit staging copy, rounded for a send; for a send under --check the checksum of what
    goes out, else None; for a receive under --check the array its checksum arrives in;
    the pieces MPI is given)."""
    out = []
    for m in msgs:
        buf = engine._buffer(m)
        wire_buf = engine._narrow(buf, m.dtype, t, copy=send)
        crc = None
        if engine.check and send:
            if engine.mode != "real":
                check.fill(wire_buf, engine._seed(m))
            crc = check.checksum(wire_buf)
            if engine.fault == "corrupt":  # after the checksum: the receiver must notice
                wire_buf.reshape(-1)[:1].view(np.uint8)[:1] ^= 1
        elif engine.check:
            crc = np.empty(2, dtype=np.int64)
        out.append((m, buf, wire_buf, crc, [wire.transport(p) for p in pieces(wire_buf)]))
    return out


def isend_all(engine, sends: list[tuple]) -> list:
    """Start every staged send (under --check its checksum first): the requests."""
    comm, reqs = engine.world, []
    for m, _, _, crc, parts in sends:
        if crc is not None:
            reqs.append(engine.check_comm.Isend(crc, m.peer, m.tag))
        reqs += [comm.Isend(p, m.peer, m.tag) for p in parts]
    return reqs


def release(engine, sends: list[tuple]) -> None:
    """The staged copies of completed sends back to the pool."""
    for _, buf, out, _, _ in sends:
        if out is not buf:
            engine.staging.release(out)


def texts(engine, op: P2P) -> tuple:
    """What the watchdog is told while `op` waits, worked out once per op: (op, one text
    per receive, the sends' text, the receivers)."""
    said = engine.said.get(id(op))
    if said is None or said[0] is not op:
        recvs = [
            f"{op.name}: waiting for {m.buf} mb {m.mb} from rank {m.peer} (tag {m.tag})"
            for m in op.recvs
        ]
        peers = ", ".join(f"{m.buf} mb {m.mb} to rank {m.peer}" for m in op.sends)
        sends = f"{op.name}: waiting for the receiver(s) to take {peers}"
        said = engine.said[id(op)] = (op, recvs, sends, tuple(sorted({m.peer for m in op.sends})))
    return said


def run(engine, op: P2P, t) -> None:
    """A blocking batch (engine: engine.Engine, t: its IterationTimes)."""
    MPI, comm, trace = engine.MPI, engine.world, engine.trace
    sends = stage(engine, op.sends, t, send=True)
    recvs = stage(engine, op.recvs, t, send=False)
    said = texts(engine, op) if engine.watchdog is not None else None
    others = engine._others(locked=False)
    idle = held = 0.0
    t0 = MPI.Wtime()
    reqs = isend_all(engine, sends)
    sent = MPI.Wtime() if trace is not None and sends else t0
    for k, (m, _, into, crc, parts) in enumerate(recvs):
        if said is not None:
            engine._beat(said[1][k], (m.peer,))
        mpi_type = wire.mpi_type(MPI, into.dtype)
        for piece in parts:
            w0 = MPI.Wtime()
            status = MPI.Status()
            msg = engine.waiter.probe(comm, m.peer, m.tag, status, others)
            w1 = MPI.Wtime()
            idle += w1 - w0
            t.waited[m.peer] += w1 - w0  # waiting for the sender
            if trace is not None:
                trace.idle(w0, w1, m.peer)
            n = status.Get_count(mpi_type)
            if n != piece.size:
                from proxies.core.engine import CheckError

                raise CheckError(
                    f"rank {comm.rank} expected {piece.size} x {into.dtype} for {m.buf} "
                    f"mb {m.mb} from rank {m.peer} (tag {m.tag}) but the message has {n}"
                )
            msg.Recv(piece)
            if engine.faults is not None and engine.faults.links:
                held += engine.faults.hold_message(m.peer, MPI.Wtime() - w1)
        if trace is not None:
            trace.arrived(m, MPI.Wtime())
        if crc is not None:
            engine.check_comm.Recv(crc, m.peer, m.tag)
    if sends and said is not None:
        engine._beat(said[2], said[3])
    engine.waiter.waitall(reqs, others)
    t1 = MPI.Wtime()
    t.seconds["idle"] += idle
    if held:
        t.seconds[DELAY] += held
    t.seconds[op.category] += t1 - t0 - idle - held
    if trace is not None:
        trace.p2p(op, t0, t1, sent)
    for m, buf, into, crc, _ in recvs:
        if crc is not None:
            verify(engine, op, m, into, crc)
        engine._widen(into, buf, t)
    release(engine, sends)


def verify(engine, op: P2P, m, into: np.ndarray, want: np.ndarray) -> None:
    """--check: what arrived against the checksum its sender sent."""
    got = check.checksum(into)
    if not np.array_equal(got, want):
        from proxies.core.engine import CheckError

        how = f", non-blocking {op.req!r}" if op.req else ""
        raise CheckError(
            f"--check: rank {engine.world.rank} received {m.buf} mb {m.mb} from rank "
            f"{m.peer} (tag {m.tag}, iteration {engine.iteration}{how}) with crc32 "
            f"{got[0]:#010x}, the sender sent {want[0]:#010x}"
        )


def post(engine, op: P2P, t) -> None:
    """Issue `op`'s sends and receives (engine: engine.Engine, t: its IterationTimes); it
    completes at Wait(op.req)."""
    MPI, comm = engine.MPI, engine.world
    engine.new_request(op.req)
    sends = stage(engine, op.sends, t, send=True)
    recvs = stage(engine, op.recvs, t, send=False)
    with engine._locked(t):
        t0 = MPI.Wtime()
        reqs = isend_all(engine, sends)
        for m, _, _, crc, parts in recvs:
            if crc is not None:
                reqs.append(engine.check_comm.Irecv(crc, m.peer, m.tag))
            reqs += [comm.Irecv(p, m.peer, m.tag) for p in parts]
        t1 = MPI.Wtime()
        t.seconds[op.category] += t1 - t0
        # the pending table's layout: [op, buffer, requests, state, posted, completed, out]
        engine.pending[op.req] = [op, None, reqs, (sends, recvs), t0, None, None]
    if engine.trace is not None:
        engine.trace.post(op, t0, t1)
    if engine.progress is not None:
        engine.progress.resume()


def finish(engine, op: P2P, state, done: float, t) -> None:
    """After the Wait: verify (--check), widen, release the staging."""
    sends, recvs = state
    for m, buf, into, crc, _ in recvs:
        if engine.trace is not None:
            engine.trace.arrived(m, done)
        if crc is not None:
            verify(engine, op, m, into, crc)
        engine._widen(into, buf, t)
    release(engine, sends)
