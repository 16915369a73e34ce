"""Executes a Plan with mpi4py's buffer API and times every op.

Where time goes, per iteration and rank:
- compute: Compute ops (real kernels, replayed sleeps, or modelled sleeps);
- <category> of a P2P batch (e.g. "pp"): posting the sends, receiving, completing the sends;
- <category> of a collective (e.g. "dp_allreduce"): the collective itself, as the group's
  fastest member saw it (the last to arrive waits least);
- idle: waiting for a peer. For a receive, the time until the message is there at all
  (MPI_Mprobe returns): the pipeline bubble. For a collective, the time beyond the group's
  fastest member: waiting for stragglers. After the run, the runner adds the time from this
  rank's last op to the slowest rank's (the pipeline cool-down), so every rank's categories
  add up to the iteration. All measured, not modelled;
- dtype_cast: rounding float32 compute buffers to a 16-bit wire dtype and widening what
  arrives (--dtype/--grad-dtype with real compute; see wire.py). Kept out of the
  communication it serves, which it would otherwise inflate;
- overhead: the rest of the iteration: the engine's own Python between ops and around a
  communication op's MPI calls (its buffers found and staged, --check's own exchanges,
  what the watchdog is told), which an op's category does not include, so that it
  compares with the same calls in a plain loop (benchmarks/engine_overhead.py). Waiting
  for the progress thread's lock is not overhead: the thread is inside MPI moving the
  pending ops' data then, booked to their categories by their bytes (_locked).

Point-to-point batches, blocking and non-blocking, are p2p.py's.

How a rank waits (spinning in MPI or test-and-sleep) and the progress thread of non-blocking
collectives are in waiting.py; what the waits are attributed to after the run, in waits.py.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from proxies.core import check, collectives, p2p, wire
from proxies.core.p2p import CAST, MAX_COUNT  # noqa: F401  (engine.MAX_COUNT)
from proxies.core.p2p import pieces as _pieces
from proxies.core.plan import P2P, Collective, Compute, Msg, Plan, Wait
from proxies.core.report import HIDDEN, union_seconds
from proxies.core.waiting import Progress, Waiter, test_each


class CheckError(RuntimeError):
    """--check found a message or reduction that is not what it must be."""


class Runtime(Protocol):
    """What a proxy gives the engine: buffers by name and the real compute."""

    def buffer(self, name: str, mb: int, chunk: int) -> np.ndarray: ...

    def compute(self, op: Compute, iteration: int) -> None: ...

    def finish_iteration(self, iteration: int) -> tuple[float, int]:
        """(sum of losses, number of losses) this rank computed in the iteration."""
        ...


@dataclass
class IterationTimes:
    total: float = 0.0
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    # Per blocking collective, in order: (group, category, seconds); split after the run.
    collectives: list[tuple[str, str, float]] = field(default_factory=list)
    # Per category, (start, end) of each non-blocking op's time under other work.
    inflight: dict[str, list[tuple[float, float]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    # Idle per peer waited for (world rank -> seconds); see waits.py.
    waited: dict[int, float] = field(default_factory=lambda: defaultdict(float))

    def booked(self) -> float:
        """Seconds booked to the ops (hidden spans aside), blocking collectives whole: as
        run_iteration leaves them, before the runner splits the collectives' waits."""
        own = sum(v for k, v in self.seconds.items() if not k.endswith(HIDDEN))
        return own + sum(c[2] for c in self.collectives)


def describe(op, rank: int | None = None) -> str:
    """One line naming an op, for the watchdog and error messages."""
    if isinstance(op, Compute):
        return f"compute {op.name}" + (f" mb {op.mb}" if op.mb >= 0 else "")
    if isinstance(op, P2P):
        parts = [f"send {m.buf} mb {m.mb} to {m.peer} (tag {m.tag})" for m in op.sends]
        parts += [f"recv {m.buf} mb {m.mb} from {m.peer} (tag {m.tag})" for m in op.recvs]
        return f"{op.name}" + (f" {op.req}" if op.req else "") + ": " + ", ".join(parts)
    if isinstance(op, Collective):
        return f"{op.kind} of {op.count} x {op.dtype} over group {op.group} ({op.buf})"
    if isinstance(op, Wait):
        return f"wait {op.req}"
    return repr(op)


def _who(op, plan: Plan, reqs: dict) -> tuple[str, tuple[int, ...]]:
    """An op's description naming whom it waits on, and those world ranks (`reqs`: request
    name -> the op that started it, a collective or a P2P batch)."""
    if isinstance(op, Wait) and isinstance(reqs.get(op.req), P2P):
        started = reqs[op.req]
        peers = tuple(sorted({m.peer for m in started.sends + started.recvs}))
        return f"wait {describe(started)}", peers
    if isinstance(op, P2P):
        return describe(op), tuple(sorted({m.peer for m in op.sends + op.recvs}))
    group = op.group if isinstance(op, Collective) else None
    if isinstance(op, Wait):
        group = getattr(reqs.get(op.req), "group", None)
    members = tuple(plan.groups.get(group, ())) if group else ()
    peers = tuple(r for r in members if r != plan.rank)
    if not members:
        return describe(op), ()
    return f"{describe(op)} with ranks {','.join(map(str, members))}", peers


class Engine:
    def __init__(
        self,
        MPI,
        plan: Plan,
        runtime: Runtime,
        comms: dict,
        *,
        mode: str = "real",
        device_tflops: float = 150.0,
        replay: dict | None = None,
        check: bool = False,
        watchdog=None,
        fault: str = "",
        wait: str = "spin",
        allreduce: str = "mpi",
        progress: str = "thread",
        faults=None,
    ):
        self.MPI = MPI
        self.world = MPI.COMM_WORLD
        self.plan, self.runtime, self.comms = plan, runtime, comms
        self.mode, self.rate = mode, device_tflops * 1e12
        self.replay = replay or {}
        self.check = check
        self.check_comm = self.world.Dup() if check else None
        self.watchdog = watchdog
        # test hook on this rank: "corrupt", "stall", "crash", "kill" or _corrupt_result's
        self.fault = fault
        self._described: list | None = None  # per op: (text, peer world ranks), for beats
        self.said: dict = {}  # p2p.texts: what a batch's waits tell the watchdog, per op
        self.iteration = 0
        self.pending: dict[str, list] = {}
        self.waiter = Waiter(MPI, wait)
        self.allreduce = allreduce  # algorithm name, see proxies.core.collectives
        # "thread": a Progress thread while non-blocking collectives are pending; "test":
        # they advance only when the engine tests them between ops.
        multiple = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        self.progress_mode = progress if multiple else "test"
        self.progress: Progress | None = None
        self.staging = wire.Staging()
        self._sent: dict[int, np.ndarray] = {}  # all-to-all receive buffer id -> staged send
        self.faults = faults  # faults.RankFaults of this rank: --slow-rank, --jitter ...
        # --trace: a trace.Recorder while an iteration is traced, else None. Every hook is
        # behind one `is not None` check: nothing else is added to an untraced op.
        self.trace = None
        # --chakra on a run: per plan op, the seconds its compute took, summed over the
        # iterations the runner counts (it sets the list); None: nothing is accumulated.
        self.durations: list[float] | None = None

    def close(self) -> None:
        """Stop the progress thread (before MPI_Finalize)."""
        if self.progress is not None:
            self.progress.close()
            self.progress = None

    # -- compute ---------------------------------------------------------------------------
    def _compute(self, op: Compute) -> None:
        if self.faults is not None and self.faults.touches_compute:
            return self.faults.compute(self, op)
        if self.mode == "real":
            self.runtime.compute(op, self.iteration)
        elif self.mode == "replay":
            time.sleep(self.replay.get((op.name, op.chunk), 0.0))
        elif self.mode == "model":
            duration = op.model_seconds(self.rate)
            if duration:
                time.sleep(min(duration, 1e6))  # cli.TIMEOUT_MAX_S; past ~9e9 s sleep overflows

    def _beat(self, what: str, peers=None) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(f"iteration {self.iteration}: {what}", peers)

    def _announce(self, iteration: int, i: int, n: int, op) -> None:
        """Tell the watchdog what op `i` is: a compute op is local work (the rank is busy,
        not stuck: no timer), anything else waits on the peers it names."""
        if self._described is None:
            ops = self.plan.ops
            reqs = {c.req: c for c in ops if isinstance(c, (Collective, P2P)) and c.req}
            self._described = [_who(op, self.plan, reqs) for op in ops]
        what, peers = self._described[i]
        what = f"iteration {iteration} op {i + 1}/{n}: {what}"
        if isinstance(op, Compute):
            self.watchdog.busy(what)
        else:
            self.watchdog.beat(what, peers)

    def _buffer(self, m: Msg) -> np.ndarray:
        buf = self.runtime.buffer(m.buf, m.mb, m.chunk)
        want = wire.numpy_dtype(m.dtype)
        # A float32 compute buffer may travel as a 16-bit wire dtype (staged).
        castable = buf.dtype == np.float32 and wire.is_sixteen(want)
        if buf.size != m.count or (buf.dtype != want and not castable):
            raise CheckError(
                f"buffer {m.buf} mb {m.mb} is {buf.size} x {buf.dtype}, "
                f"the plan says {m.count} x {m.dtype}"
            )
        return buf

    # -- 16-bit wire dtypes ----------------------------------------------------------------
    def _narrow(self, buf: np.ndarray, dtype: str, t: IterationTimes, copy: bool = True):
        """`buf` itself when it already has the wire dtype, else a staging buffer (holding
        its values rounded, when `copy`), the conversion timed as dtype_cast."""
        want = wire.numpy_dtype(dtype)
        if buf.dtype == want:
            return buf
        t0 = time.perf_counter()
        # Without real compute the values mean nothing: no rounding pass is owed.
        out = self.staging.narrow(buf, want, copy and self.mode == "real")
        t.seconds[CAST] += time.perf_counter() - t0
        return out

    def _widen(self, out: np.ndarray, buf: np.ndarray, t: IterationTimes) -> None:
        """Back from the wire: copy a staged result into the compute buffer (a conversion
        timed as dtype_cast; an all-to-all's float32 result is a plain copy, the engine's
        own time)."""
        if out is buf:
            return
        if self.mode != "real":
            self.staging.release(out)
            return
        t0 = time.perf_counter()
        cast = out.dtype != buf.dtype
        self.staging.widen(out, buf)
        if cast:
            t.seconds[CAST] += time.perf_counter() - t0

    # -- collectives -----------------------------------------------------------------------
    def _start(self, op: Collective, blocking: bool, t: IterationTimes):
        """Prepare a collective; return (buffer, wire buffer, check state, calls): the
        engine's own work, before its time starts. The wire buffer is the buffer itself, or
        its 16-bit staging copy (wire.py). `_issue(calls)` makes the MPI calls (non-blocking
        ones where not `blocking`, or where waits yield). The whole array splits into
        check.blocks: sizes differing by at most one, so reduce_scatter and allgather take
        any count (the v-variants when uneven); alltoall needs equal blocks."""
        MPI = self.MPI
        comm = self.comms[op.group]
        buf = self.runtime.buffer(op.buf, op.mb, 0)
        if op.kind == "alltoallv":  # integer ids: never retyped, never staged
            if self.check and self.mode != "real":
                check.fill(buf, self._seed(op))
            return self._start_v(op, comm, blocking)
        out = self._narrow(buf, op.dtype, t)
        n, flat = comm.size, out.reshape(-1)
        if op.kind == "alltoall" and flat.size % n:
            raise CheckError(
                f"alltoall of {flat.size} elements over {n} ranks ({op.buf}): "
                "not a multiple of the group size"
            )
        if self.check and self.mode != "real":
            check.fill(flat, self._seed(op))
        state = check.before(MPI, op.kind, comm, flat, op.unit) if self.check else None
        x, SUM = wire.transport(flat), wire.sum_op(MPI, flat.dtype)  # what MPI is given
        spin = blocking and not self.waiter.yielding
        # Beyond 2^31 elements mpi4py 4 calls MPI-4's large-count (_c) variants; allreduce,
        # being elementwise, is also cut into pieces.
        if op.kind == "allreduce" and self.allreduce != "mpi":
            # Our algorithms over point-to-point (proxies.core.collectives) run to completion
            # here: a non-blocking allreduce becomes blocking at its start.
            wait = self.waiter.waitall if self.waiter.yielding else None
            ours = functools.partial(collectives.allreduce, comm, flat, self.allreduce, wait=wait)
            return buf, out, state, [(ours, ())]
        if op.kind == "allreduce":
            calls = [("Allreduce", (MPI.IN_PLACE, piece, SUM)) for piece in _pieces(x)]
        elif op.kind in ("allgather", "reduce_scatter") and check.uneven(flat.size, n, op.unit):
            counts, displs = check.block_counts(flat.size, n, op.unit)
            spec = [x, (counts, displs), wire.mpi_type(MPI, flat.dtype)]
            calls = [
                ("Allgatherv", (MPI.IN_PLACE, spec))
                if op.kind == "allgather"
                else ("Reduce_scatter", (MPI.IN_PLACE, x, counts, SUM))
            ]
        elif op.kind == "alltoall":
            # Out of place, as frameworks and the C++ proxies call it (in place MPICH runs
            # another, 1.2-5x slower: alltoall_place.py): into a pool, put back by _finish.
            recv = self.staging.narrow(flat, flat.dtype, copy=False)
            if out is not buf:  # a 16-bit staging copy: back to the pool at _finish
                self._sent[id(recv)] = out
            calls = [("Alltoall", (x, wire.transport(recv)))]
            out = recv
        else:
            calls = [
                {
                    "allgather": ("Allgather", (MPI.IN_PLACE, x)),
                    "reduce_scatter": ("Reduce_scatter_block", (MPI.IN_PLACE, x, SUM)),
                    "bcast": ("Bcast", (x, 0)),
                    "reduce": (
                        "Reduce",
                        (MPI.IN_PLACE, x, SUM, 0) if comm.rank == 0 else (x, None, SUM, 0),
                    ),
                }[op.kind]
            ]
        # MPI's blocking call, or its non-blocking one
        calls = [(getattr(comm, n if spin else "I" + n[0].lower() + n[1:]), a) for n, a in calls]
        return buf, out, state, calls

    @staticmethod
    def _issue(calls: list) -> list:
        """Make a collective's MPI calls: the requests of the non-blocking ones."""
        reqs = []
        for fn, args in calls:
            req = fn(*args)
            if req is not None:
                reqs.append(req)
        return reqs

    def _start_v(self, op: Collective, comm, blocking: bool):
        """alltoallv: the runtime's `alltoallv(name, iteration)` gives (send, scounts, recv,
        rcounts) for this iteration (send may be the array `buffer` returns); the plan's
        count is what this rank sends. Returns what _start does, with (recv, rcounts, check
        state) as the state."""
        MPI = self.MPI
        send, scounts, recv, rcounts = self.runtime.alltoallv(op.buf, self.iteration)
        scounts, rcounts = [int(c) for c in scounts], [int(c) for c in rcounts]
        if send.size != op.count or sum(scounts) != op.count or recv.size != sum(rcounts):
            raise CheckError(
                f"alltoallv {op.buf}: sends {sum(scounts)} of a {send.size}-element buffer "
                f"and receives {sum(rcounts)} into {recv.size}; the plan says {op.count} sent"
            )
        state = check.before_v(comm, send, scounts) if self.check else None
        T = wire.mpi_type(MPI, send.dtype)
        sd, rd = (np.cumsum([0] + c[:-1]).tolist() for c in (scounts, rcounts))
        args = ([send, (scounts, sd), T], [recv, (rcounts, rd), T])
        fn = comm.Alltoallv if blocking and not self.waiter.yielding else comm.Ialltoallv
        return send, send, (recv, rcounts, state), [(fn, args)]

    def _finish(self, op: Collective, buf: np.ndarray, out: np.ndarray, state, t) -> None:
        """After completion: place the reduce-scatter shard, run --check, widen a staged
        result into the compute buffer."""
        comm = self.comms[op.group]
        if op.kind == "reduce_scatter" and comm.rank:
            # MPI leaves this rank's reduced block at the front; it belongs at its position
            # (past the front block's end: no overlap)
            counts, displs = check.block_counts(out.size, comm.size, op.unit)
            flat, lo, size = out.reshape(-1), displs[comm.rank], counts[comm.rank]
            flat[lo : lo + size] = flat[:size]
        if self.fault in ("corrupt-nan", "corrupt-add") and op.kind in check.REDUCTIONS:
            _corrupt_result(op, comm, out, self.fault)
        error = None
        if self.check and op.kind == "alltoallv":
            error = check.verify_v(*state)
        elif self.check:
            error = check.verify(self.MPI, op.kind, comm, out, state, op.unit)
        if error:
            raise CheckError(
                f"--check: {op.kind} over group {op.group} ({op.buf}, iteration "
                f"{self.iteration}) on rank {self.world.rank}: {error}"
            )
        self._widen(out, buf, t)  # alltoallv's `out` is its send buffer: nothing to widen
        if (sent := self._sent.pop(id(out), None)) is not None:  # an all-to-all's staged send
            self.staging.release(sent)

    def _collective(self, op: Collective, t: IterationTimes) -> None:
        MPI = self.MPI
        buf, out, state, calls = self._start(op, blocking=True, t=t)
        t0 = MPI.Wtime()
        self.waiter.waitall(self._issue(calls), self._others(locked=False))
        t1 = MPI.Wtime()
        t.collectives.append((op.group, op.category, t1 - t0))
        if self.trace is not None:
            self.trace.collective(op, t0, t1)
        self._finish(op, buf, out, state, t)

    def new_request(self, req: str) -> None:
        """Before a non-blocking op starts `req`: refuse a request in flight, start the
        progress thread."""
        if req in self.pending:
            raise CheckError(f"request {req!r} started twice")
        if self.progress_mode == "thread" and self.progress is None:
            self.progress = Progress(self.MPI, self.pending)

    def _post(self, op: Collective, t: IterationTimes) -> None:
        """Start a non-blocking collective; it completes at Wait(op.req)."""
        self.new_request(op.req)
        with self._locked(t):
            buf, out, state, calls = self._start(op, blocking=False, t=t)
            t0 = self.MPI.Wtime()
            reqs = self._issue(calls)  # issuing it is exposed time
            t1 = self.MPI.Wtime()
            t.seconds[op.category] += t1 - t0
            self.pending[op.req] = [op, buf, reqs, state, t0, None, out]
        if self.trace is not None:
            self.trace.post(op, t0, t1)
        if self.progress is not None:
            self.progress.resume()

    @contextlib.contextmanager
    def _locked(self, t: IterationTimes):
        """The progress thread's lock, taken to start or wait for requests. The thread holds
        it inside MPI's tests, moving the pending ops' data on this rank's core: waiting for
        it is communication, booked to the incomplete pending ops by their bytes, since a
        test moves whatever is pending (2 ranks: a 4 KB Iallreduce's 3 tests, with a 16 MiB
        Ialltoall posted after it, took 1.4 - 1.5 ms, the all-to-all then all but done)."""
        if self.progress is None:
            yield
            return
        t0 = self.MPI.Wtime()
        with self.progress.lock:
            waited = self.MPI.Wtime() - t0
            moving = [e[0] for e in self.pending.values() if e[5] is None]
            total = sum(op.nbytes for op in moving)
            for op in moving:
                t.seconds[op.category] += waited * (op.nbytes / total if total else 1 / len(moving))
            yield

    def _progress(self, t: IterationTimes) -> None:
        """Test pending requests: drives MPI progress between ops and notes completion.

        Without a progress thread, MPI moves a non-blocking collective's data inside these
        tests, so their time is the collective's exposed time (this rank was not computing).
        """
        if self.progress is not None:
            return  # the thread tests them
        Wtime = self.MPI.Wtime
        for entry in self.pending.values():
            if entry[5] is None:
                t0 = Wtime()
                done = self.MPI.Request.Testall(entry[2])
                t1 = Wtime()
                t.seconds[entry[0].category] += t1 - t0
                if self.trace is not None:
                    self.trace.test(entry[0], t0, t1)
                if done:
                    entry[5] = t1

    def _others(self, locked: bool = True):
        """What a yielding wait tests between its own tests: the other pending requests,
        each with its own call (waiting._poll), noting when each completes, as the progress
        thread does. None where nothing is pending, or where the thread may be testing
        them (this rank does not hold its lock)."""
        if not self.pending or (self.progress is not None and not locked):
            return None
        MPI, entries = self.MPI, list(self.pending.values())
        return lambda: test_each(MPI, entries)

    def _wait(self, op: Wait, t: IterationTimes) -> None:
        MPI = self.MPI
        if op.req not in self.pending:
            raise CheckError(f"wait for {op.req!r}, which was never started")
        with self._locked(t):
            coll, buf, reqs, state, started, done, out = self.pending.pop(op.req)
            t0 = MPI.Wtime()
            self.waiter.waitall(reqs, self._others())
            t1 = MPI.Wtime()
        # Exposed: the time blocked here. Hidden: from the start until it was seen complete
        # (or until this wait began), while this rank did other work.
        t.seconds[coll.category] += t1 - t0
        t.inflight[coll.category].append((started, done if done is not None else t0))
        if isinstance(coll, P2P):  # its arrivals are traced before the wait that shows them
            p2p.finish(self, coll, state, done if done is not None else t1, t)
        if self.trace is not None:
            self.trace.wait(coll, started, done if done is not None else t0, t0, t1)
        if not isinstance(coll, P2P):
            self._finish(coll, buf, out, state, t)

    # -- --check ---------------------------------------------------------------------------
    def _seed(self, key) -> int:
        return zlib.crc32(repr((self.iteration, self.world.rank, key)).encode())

    # -- one iteration ---------------------------------------------------------------------
    def run_iteration(self, iteration: int) -> IterationTimes:
        MPI = self.MPI
        self.iteration = iteration
        t = IterationTimes()
        n = len(self.plan.ops)
        if self.faults is not None:
            self.faults.start_iteration(iteration)  # --kill-rank ends this process here
        start = MPI.Wtime()
        if self.trace is not None:
            self.trace.begin(iteration, start)
        for i, op in enumerate(self.plan.ops):
            if self.watchdog is not None:
                self._announce(iteration, i, n, op)
            if self.fault == "stall" and isinstance(op, P2P):
                time.sleep(1e9)
            if self.fault == "crash" and i == n // 2:
                raise RuntimeError("fault injected by PROXIES_FAULT")
            if self.fault == "kill" and i == n // 2:
                os.kill(os.getpid(), signal.SIGKILL)  # fail-stop, as --kill-rank
            t0 = MPI.Wtime()
            if isinstance(op, Compute):
                self._compute(op)
                t1 = MPI.Wtime()
                t.seconds[op.category] += t1 - t0
                if self.trace is not None:
                    self.trace.compute(op, t0, t1)
                if self.durations is not None:
                    self.durations[i] += t1 - t0
            elif isinstance(op, P2P):
                if op.req:
                    p2p.post(self, op, t)
                else:
                    p2p.run(self, op, t)
            elif isinstance(op, Collective):
                (self._post if op.req else self._collective)(op, t)
            elif isinstance(op, Wait):
                self._wait(op, t)
            else:
                raise NotImplementedError(f"op {op!r}")
            if self.pending:
                self._progress(t)
        if self.pending:
            raise CheckError(f"requests never waited for: {', '.join(self.pending)}")
        for category, spans in t.inflight.items():
            t.seconds[category + HIDDEN] = union_seconds(spans)
        t.total = MPI.Wtime() - start
        if self.trace is not None:
            self.trace.end(t.total)
        return t


def _corrupt_result(op: Collective, comm, out: np.ndarray, fault: str) -> None:
    """Test hook (PROXIES_FAULT=corrupt-nan:RANK or corrupt-add:RANK, RANK may be "all"):
    after a reduction, the middle element of this rank's result (its own block of a
    reduce_scatter) becomes NaN or gains 0.5. With "all", every rank's result is corrupted
    identically, which only --check's sums can notice (the ranks' crc32s agree)."""
    flat = out.reshape(-1)
    part = (
        check.blocks(flat, comm.size, op.unit)[comm.rank] if op.kind == "reduce_scatter" else flat
    )
    if part.size:
        k = part.size // 2
        part[k] = np.nan if fault == "corrupt-nan" else float(part[k]) + 0.5
