"""--trace FILE.json: the timed iterations of every rank as a Chrome / Perfetto timeline.

The file is the Trace Event Format (a JSON object whose "traceEvents" Perfetto's
ui.perfetto.dev and chrome://tracing open): one process per rank, named by its coordinates,
and in it one thread per kind of work, so an op's parts nest under it:
- "iterations": one slice per traced iteration, from its start to the slowest rank's end;
- "compute": forwards ("F3"), backwards ("B3", "1B2" for model chunk 1), optimizer ...;
  after the rank's last op, its wait for the slowest rank (idle);
- one thread per point-to-point category ("pp"): each batch, with its waits for the
  sender (idle) nested in it; a flow arrow joins each send to its matching receive;
- one thread per collective group ("group dp"): blocking collectives, with their wait for
  the group's last member (idle) nested at their start; a non-blocking collective's start,
  tests and wait, and its time in flight as an async slice.
Every slice's args hold its category (the breakdown's), bytes, peers, micro-batch, group.
A slice's self time (its duration less its children's) is what the breakdown books to its
category, so per category the trace adds up to the run's --json breakdown (16-bit wire
casts and the engine's own work on an op come before or after its MPI calls, outside its
slice; that and the time between ops is the engine's overhead, not drawn).

Clocks: before the first iteration rank 0 ping-pongs each rank (PING_ROUNDS times) and
keeps the round trip with the smallest time; that rank's offset is its clock at the reply
minus the midpoint of rank 0's send and receive, wrong by at most half that round trip
(the residual, per rank in "otherData"). Bounded memory: the first --trace-iters timed
iterations (default DEFAULT_ITERS), at most MAX_EVENTS records per rank (an iteration
that would pass it is dropped whole, and the ranks' entries say so), and the ranks of
--trace-ranks (default the first MAX_RANKS).

The engine calls a Recorder's hooks only while an iteration is traced (engine.trace is
None otherwise); the predicted timeline of --dry-run --machine is trace_predicted.py.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable

from proxies.core import cli, report
from proxies.core.plan import P2P, Collective, Compute, Msg

DEFAULT_ITERS = 3  # timed iterations traced unless --trace-iters says otherwise
MAX_ITERS = 1000
MAX_EVENTS = 200_000  # records per rank (one per op or wait): about 40 MB of JSON per rank
MAX_RANKS = 64  # ranks written unless --trace-ranks names them
PING_ROUNDS = 8  # clock offset: round trips per rank, the fastest kept
ITERATION = "iteration"  # category of the per-iteration slices (not a breakdown category)


def add_options(g) -> None:
    """--trace, --trace-iters, --trace-ranks (in the common options group)."""
    g.add_argument(
        "--trace",
        metavar="FILE.json",
        help="write a Chrome / Perfetto timeline (open in ui.perfetto.dev): the timed "
        "iterations of every rank, measured; with --dry-run --machine, the predicted one",
    )
    g.add_argument(
        "--trace-iters",
        type=cli.integer(min=1, max=MAX_ITERS, what="a positive integer"),
        metavar="N",
        help=f"with --trace: the first N timed iterations (default {DEFAULT_ITERS}, at most "
        f"{MAX_ITERS:,}; each rank keeps at most {MAX_EVENTS:,} events)",
    )
    g.add_argument(
        "--trace-ranks",
        metavar="LIST",
        help=f"with --trace: the ranks written, e.g. 0,3,7 or all (default: the first {MAX_RANKS})",
    )


def check_args(args) -> None:
    """Impossible combinations, before any work (exit 2)."""
    path = getattr(args, "trace", None)
    if path is None:
        for option in ("trace_iters", "trace_ranks"):
            if getattr(args, option, None) is not None:
                raise cli.UsageError(f"--{option.replace('_', '-')} goes with --trace FILE.json")
        return
    if args.dry_run and getattr(args, "machine", None) is None:
        raise cli.UsageError("--trace with --dry-run draws the prediction: give --machine FILE too")
    if args.dry_run and args.trace_iters is not None:
        raise cli.UsageError("--trace-iters: a prediction is one iteration (no --dry-run)")
    # the world as main() will size it: bad ranks are refused before any work
    ranks_of(args.trace_ranks, args.world_size or cli.env_world_size() or 1)


def ranks_of(spec: str | None, world: int) -> list[int]:
    """The ranks --trace-ranks names (default the first MAX_RANKS); bad input: UsageError."""
    if spec is None:
        return list(range(min(world, MAX_RANKS)))
    if spec.strip() == "all":
        return list(range(world))
    try:
        ranks = sorted({int(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        raise cli.UsageError(
            f"--trace-ranks {spec!r}: expected 'all' or ranks like 0,3,7"
        ) from None
    bad = [r for r in ranks if not 0 <= r < world]
    if bad or not ranks:
        raise cli.UsageError(
            f"--trace-ranks: rank {bad[0]} is outside 0..{world - 1}"
            if bad
            else "--trace-ranks: no rank"
        )
    return ranks


def process_name(rank: int, coords: dict) -> str:
    """ "rank 5: pp 1 dp 1 tp 0"."""
    where = " ".join(f"{k} {v}" for k, v in coords.items())
    return f"rank {rank}: {where}" if where else f"rank {rank}"


def compute_name(op: Compute) -> str:
    """A compute slice's name: "F3", "1B2" (as schedules.Action prints), else "optimizer"."""
    kind = {"forward": "F", "backward": "B"}.get(op.name)
    if kind is None:
        return op.name if op.mb < 0 else f"{op.name} mb {op.mb}"
    return f"{op.chunk or ''}{kind}{op.mb}"


def p2p_thread(category: str) -> str:
    """The thread of a point-to-point category: "pipeline send/recv (pp)"."""
    name = report.label(category)
    return f"{name} ({category})" if name != category else category


def _msg_text(m: Msg, way: str) -> str:
    return f"{m.buf} mb {m.mb} {way} rank {m.peer} (tag {m.tag}, {m.nbytes:,} B)"


class Track:
    """One rank's events, in microseconds from the trace's origin: threads named on first
    use, slices, async spans and the ends of flows (paired later, across ranks)."""

    THREADS = ("iterations", "compute")  # then p2p categories, then groups, as met

    def __init__(self, pid: int, name: str, sort: int) -> None:
        self.pid = pid
        self.events: list[dict] = [
            {"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": name}},
            {
                "ph": "M",
                "pid": pid,
                "tid": 0,
                "name": "process_sort_index",
                "args": {"sort_index": sort},
            },
        ]
        self.tids: dict[str, int] = {}
        self.flows: list[tuple[tuple, str, int, int, float]] = []  # (key, "s"/"f", pid, tid, ts)
        self.asyncs = 0
        for thread in self.THREADS:
            self.tid(thread)

    def tid(self, thread: str) -> int:
        tid = self.tids.get(thread)
        if tid is None:
            tid = self.tids[thread] = len(self.tids) + 1
            for what, value in (
                ("thread_name", {"name": thread}),
                ("thread_sort_index", {"sort_index": tid}),
            ):
                self.events.append(
                    {"ph": "M", "pid": self.pid, "tid": tid, "name": what, "args": value}
                )
        return tid

    def slice(self, thread: str, name: str, cat: str, t0: float, t1: float, **args) -> None:
        """A complete ("X") event from t0 to t1 (microseconds)."""
        self.events.append(
            {
                "ph": "X",
                "pid": self.pid,
                "tid": self.tid(thread),
                "name": name,
                "cat": cat,
                "ts": round(t0, 3),
                "dur": round(max(t1 - t0, 0.0), 3),
                "args": {"category": cat, **args},
            }
        )

    def span(self, name: str, cat: str, t0: float, t1: float, **args) -> None:
        """An async ("b"/"e") span: work in flight beside the rank's own ops."""
        self.asyncs += 1
        base = {"pid": self.pid, "tid": self.tid("compute"), "name": name, "cat": cat}
        ident = self.pid * 1_000_000 + self.asyncs
        self.events.append({**base, "ph": "b", "id": ident, "ts": round(t0, 3), "args": args})
        self.events.append({**base, "ph": "e", "id": ident, "ts": round(max(t1, t0), 3)})

    def flow(self, key: tuple, end: str, thread: str, ts: float) -> None:
        self.flows.append((key, end, self.pid, self.tid(thread), round(ts, 3)))

    def p2p(self, op: P2P, t0: float, t1: float, idles: Iterable, **args) -> None:
        """A point-to-point batch [t0, t1] on its category's thread, its waits nested."""
        thread = p2p_thread(op.category)
        self.slice(thread, op.name, op.category, t0, t1, **p2p_args(op), **args)
        for w0, w1, peer in idles:
            self.slice(thread, f"waiting for rank {peer}", "idle", w0, w1, peer=peer)

    def collective(self, op: Collective, t0: float, t1: float, wait: float, members: int) -> None:
        """A blocking collective [t0, t1]; its first `wait` microseconds waiting for the
        group's last member (idle, nested)."""
        thread = f"group {op.group}"
        self.slice(thread, f"{op.kind} {op.buf}", op.category, t0, t1, **coll_args(op, members))
        if wait > 0:
            self.slice(thread, "waiting for the last member", "idle", t0, t0 + wait, group=op.group)


def p2p_args(op: P2P) -> dict:
    return {
        "sends": [_msg_text(m, "to") for m in op.sends],
        "recvs": [_msg_text(m, "from") for m in op.recvs],
        "bytes_sent": op.nbytes_sent,
        "bytes_recv": op.nbytes_recv,
        "mb": sorted({m.mb for m in op.sends + op.recvs}),
    }


def nonblocking(op: Collective | P2P, groups: dict) -> tuple[str, str, dict]:
    """Thread, name and args of a non-blocking op's slices (start, test, wait) and of its
    span in flight: a collective's on its group's thread, a P2P batch's on its category's."""
    if isinstance(op, P2P):
        return p2p_thread(op.category), op.name, p2p_args(op)
    return f"group {op.group}", f"{op.kind} {op.buf}", coll_args(op, len(groups[op.group]))


def coll_args(op: Collective, members: int) -> dict:
    return {
        "kind": op.kind,
        "group": op.group,
        "ranks": members,
        "bytes": op.nbytes,
        "buffer": str(op.buf),
        "mb": op.mb,
    }


def document(tracks: list[dict], meta: dict) -> dict:
    """The trace: every rank's events, the flows whose two ends were both recorded (one "s"
    and one "f" per send, bound to the enclosing slices), and the metadata."""
    events: list[dict] = []
    ends: dict[tuple, dict[str, tuple]] = defaultdict(dict)
    for t in tracks:
        events += t["events"]
        for key, end, pid, tid, ts in t["flows"]:
            ends[tuple(key)][end] = (pid, tid, ts)
    paired = unpaired = 0
    for both in ends.values():
        if len(both) < 2:
            unpaired += 1
            continue
        paired += 1
        for end, (pid, tid, ts) in both.items():
            ev = {
                "ph": end,
                "id": paired,
                "pid": pid,
                "tid": tid,
                "ts": ts,
                "name": "message",
                "cat": "flow",
            }
            if end == "f":
                ev["bp"] = "e"  # bind to the enclosing slice (the receive), not the next one
            events.append(ev)
    meta = {**meta, "flows": paired, "flows_unpaired": unpaired}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta}


def write(path: str | None, doc: dict | None, prog: str) -> bool:
    """Write the trace (rank 0) atomically, as --json is written; False when nothing could
    be written (the caller exits non-zero). True when there is nothing to write."""
    if path is None or doc is None:
        return True
    return report.save(path, json.dumps(doc, separators=(",", ":")) + "\n", prog=prog) is not None


def category_seconds(doc: dict) -> dict[int, dict[str, float]]:
    """Per process (rank): category -> seconds of self time (a slice's duration less its
    direct children's), over every slice but the iteration markers. What the breakdown
    books, for the tests and for anyone checking a trace against its --json."""
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for ev in doc["traceEvents"]:
        if ev["ph"] == "X" and ev["cat"] != ITERATION:
            by_thread[ev["pid"], ev["tid"]].append(ev)
    out: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def inside(ev: dict, parent: dict) -> bool:
        end = parent["ts"] + parent["dur"]  # 0.002 us: the rounding of two numbers
        return ev["ts"] < end and ev["ts"] + ev["dur"] <= end + 0.002

    for (pid, _), evs in by_thread.items():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        for ev in evs:
            while stack and not inside(ev, stack[-1]):
                stack.pop()
            if stack:
                out[pid][stack[-1]["cat"]] -= ev["dur"] * 1e-6
            out[pid][ev["cat"]] += ev["dur"] * 1e-6
            stack.append(ev)
    return {pid: dict(c) for pid, c in out.items()}


# -- a measured run ----------------------------------------------------------------------


class Recorder:
    """The engine's hooks (engine.trace while an iteration is traced): raw records in this
    rank's clock, turned into events after the run. An append per op, nothing more."""

    def __init__(self, cap: int = MAX_EVENTS) -> None:
        self.records: list[tuple] = []
        self.cap = cap
        self.mark = 0
        self.dropped: int | None = None  # the iteration that passed the cap, dropped whole

    def begin(self, iteration: int, start: float) -> None:
        self.mark = len(self.records)
        self.records.append(("B", iteration, start))

    def end(self, total: float) -> None:
        if len(self.records) > self.cap:
            self.dropped = self.records[self.mark][1]
            del self.records[self.mark :]
        else:
            self.records.append(("E", total))

    def compute(self, op: Compute, t0: float, t1: float) -> None:
        self.records.append(("c", op, t0, t1))

    def idle(self, w0: float, w1: float, peer: int) -> None:
        self.records.append(("i", w0, w1, peer))

    def arrived(self, m: Msg, t: float) -> None:
        self.records.append(("r", m, t))

    def p2p(self, op: P2P, t0: float, t1: float, sent: float) -> None:
        self.records.append(("p", op, t0, t1, sent))

    def collective(self, op: Collective, t0: float, t1: float) -> None:
        self.records.append(("k", op, t0, t1))

    def post(self, op: Collective | P2P, t0: float, t1: float) -> None:
        self.records.append(("s", op, t0, t1))

    def test(self, op: Collective | P2P, t0: float, t1: float) -> None:
        self.records.append(("t", op, t0, t1))

    def wait(self, op: Collective | P2P, started: float, done: float, t0: float, t1: float) -> None:
        self.records.append(("w", op, started, done, t0, t1))


def clock_offsets(MPI, world) -> tuple[float, float]:
    """(this rank's clock minus rank 0's, half the round trip that measured it), in seconds.
    Rank 0 ping-pongs each rank in turn; the round trip with the least time wins."""
    import numpy as np

    comm = world.Dup()  # nothing else's messages can meet these
    mine = np.zeros(2)
    stamp = np.zeros(1)
    if comm.rank == 0:
        table = np.zeros((comm.size, 2))
        for r in range(1, comm.size):
            best = (float("inf"), 0.0)
            for _ in range(PING_ROUNDS):
                t0 = MPI.Wtime()
                comm.Send(stamp, r, 7)
                comm.Recv(stamp, r, 7)
                t1 = MPI.Wtime()
                best = min(best, (t1 - t0, float(stamp[0]) - (t0 + t1) / 2))
            table[r] = best[1], best[0] / 2
        comm.Scatter(table, mine, root=0)
    else:
        for _ in range(PING_ROUNDS):
            comm.Recv(stamp, 0, 7)
            stamp[0] = MPI.Wtime()
            comm.Send(stamp, 0, 7)
        comm.Scatter(None, mine, root=0)
    comm.Free()
    return float(mine[0]), float(mine[1])


class Tracer:
    """The runner's side of --trace: clocks aligned before the first iteration, a Recorder
    for the traced iterations of the ranks written, the events gathered to rank 0."""

    def __init__(self, MPI, world, plan, job, args) -> None:
        self.world, self.plan, self.job = world, plan, job
        self.first = args.warmup
        self.iters = min(args.trace_iters or DEFAULT_ITERS, args.iters)
        self.ranks = ranks_of(args.trace_ranks, world.size)
        self.offset, self.residual = clock_offsets(MPI, world)
        self.rec = Recorder() if world.rank in self.ranks else None

    def recorder(self, iteration: int) -> Recorder | None:
        """The engine's recorder for this iteration: None when it is not traced."""
        rec = self.rec
        traced = self.first <= iteration < self.first + self.iters
        return rec if traced and rec is not None and rec.dropped is None else None

    def gather(self, MPI, comms: dict, timed: list) -> dict | None:
        """After the run (timed: its IterationTimes, tails booked): the trace on rank 0,
        None elsewhere. Collective over the world and each group."""
        import numpy as np

        traced = timed[: self.iters]
        # Each blocking collective's wait for its group's last member, as the breakdown
        # splits it (waits.split_collective_waits): its time beyond the group's fastest.
        where: dict[tuple[int, str], list[int]] = defaultdict(list)
        by_group: dict[str, list[float]] = defaultdict(list)
        for i, t in enumerate(traced):
            for group, _, dt in t.collectives:
                where[i, group].append(len(by_group[group]))
                by_group[group].append(dt)
        beyond: dict[str, list[float]] = {}
        for group in sorted(comms):
            comm = comms[group]
            if comm is None or group not in by_group:
                continue
            mine = np.array(by_group[group])
            low = np.empty_like(mine)
            comm.Allreduce(mine, low, op=MPI.MIN)
            beyond[group] = (mine - low).tolist()
        # The origin: the first traced iteration's start on the earliest rank.
        origin = self.world.allreduce(self._first_start(), op=MPI.MIN)
        track = None
        if self.rec is not None:
            track = self._track(traced, origin, where, beyond)
        tracks = self.world.gather(track, root=0)
        if self.world.rank != 0:
            return None
        tracks = [t for t in tracks if t is not None]
        return document(tracks, self._meta(tracks))

    def _first_start(self) -> float:
        recs = self.rec.records if self.rec is not None else []
        return recs[0][2] - self.offset if recs else float("inf")

    def _track(self, traced, origin, where, beyond) -> dict:
        rank, plan = self.world.rank, self.plan
        tr = Track(rank, process_name(rank, self.job.grid.coords(rank)), rank)

        def us(t: float) -> float:
            return (t - self.offset - origin) * 1e6

        counts: dict[tuple, int] = defaultdict(int)
        pending: list[tuple] = []  # a P2P's waits and arrivals, until the P2P itself
        seen: dict[str, int] = defaultdict(int)
        it = i = -1
        start = 0.0
        for rec in self.rec.records:
            kind = rec[0]
            if kind == "B":
                it, start = rec[1], rec[2]
                i = it - self.first
                seen.clear()
                slowest = traced[i].total  # booked: the slowest rank's iteration
                tr.slice("iterations", f"iteration {it}", ITERATION, us(start), us(start + slowest))
            elif kind == "E":
                own, slowest = rec[1], traced[i].total
                if slowest > own:
                    tr.slice(
                        "compute",
                        "waiting for the slowest rank",
                        "idle",
                        us(start + own),
                        us(start + slowest),
                    )
            elif kind == "c":
                op = rec[1]
                tr.slice(
                    "compute",
                    compute_name(op),
                    op.category,
                    us(rec[2]),
                    us(rec[3]),
                    op=op.name,
                    mb=op.mb,
                    chunk=op.chunk,
                    flops=op.flops,
                )
            elif kind in ("i", "r"):
                pending.append(rec)
            elif kind == "p":
                op, t0, t1, sent = rec[1:]
                idles = [
                    (us(w0), us(w1), peer)
                    for _, w0, w1, peer in (r for r in pending if r[0] == "i")
                ]
                tr.p2p(op, us(t0), us(t1), idles)
                for m in op.sends:
                    k = counts[it, rank, m.peer, m.tag]
                    counts[it, rank, m.peer, m.tag] += 1
                    tr.flow((it, rank, m.peer, m.tag, k), "s", p2p_thread(op.category), us(sent))
                for _, m, t in (r for r in pending if r[0] == "r"):
                    k = counts[it, m.peer, rank, m.tag]
                    counts[it, m.peer, rank, m.tag] += 1
                    tr.flow((it, m.peer, rank, m.tag, k), "f", p2p_thread(op.category), us(t))
                pending.clear()
            elif kind == "k":
                op, t0, t1 = rec[1:]
                n = seen[op.group]
                seen[op.group] += 1
                wait = beyond[op.group][where[i, op.group][n]]
                tr.collective(op, us(t0), us(t1), wait * 1e6, len(plan.groups[op.group]))
            elif kind in ("s", "t"):
                op, t0, t1 = rec[1:]
                thread, name, args = nonblocking(op, plan.groups)
                name = f"{'start' if kind == 's' else 'test'} {name}"
                tr.slice(thread, name, op.category, us(t0), us(t1), **args)
                if kind == "s" and isinstance(op, P2P):  # its messages leave when posted
                    for m in op.sends:
                        k = counts[it, rank, m.peer, m.tag]
                        counts[it, rank, m.peer, m.tag] += 1
                        tr.flow((it, rank, m.peer, m.tag, k), "s", thread, us((t0 + t1) / 2))
            elif kind == "w":
                op, started, done, t0, t1 = rec[1:]
                thread, name, args = nonblocking(op, plan.groups)
                tr.span(
                    f"{name} in flight", op.category + report.HIDDEN, us(started), us(done), **args
                )
                tr.slice(thread, f"wait {name}", op.category, us(t0), us(t1), **args)
                # a P2P batch's arrivals, drawn at its wait (inside a slice of the thread)
                for _, m, t in (r for r in pending if r[0] == "r"):
                    k = counts[it, m.peer, rank, m.tag]
                    counts[it, m.peer, rank, m.tag] += 1
                    tr.flow((it, m.peer, rank, m.tag, k), "f", thread, us(min(max(t, t0), t1)))
                pending.clear()
        return {
            "events": tr.events,
            "flows": tr.flows,
            "rank": rank,
            "offset_us": self.offset * 1e6,
            "residual_us": self.residual * 1e6,
            "dropped_iteration": self.rec.dropped,
        }

    def _meta(self, tracks: list[dict]) -> dict:
        job = self.job
        return {
            "proxy": job.proxy,
            "kind": "measured",
            "world_size": self.world.size,
            "ranks": [t["rank"] for t in tracks],
            "iterations": list(range(self.first, self.first + self.iters)),
            "caps": {
                "iterations": self.iters,
                "events_per_rank": MAX_EVENTS,
                "ranks": f"--trace-ranks or the first {MAX_RANKS}",
            },
            "dropped_iterations": {
                str(t["rank"]): t["dropped_iteration"]
                for t in tracks
                if t["dropped_iteration"] is not None
            },
            "clock": {
                "method": f"offsets to rank 0 at start, fastest of {PING_ROUNDS} ping-pongs",
                "residual_us_max": max((t["residual_us"] for t in tracks), default=0.0),
                "offset_us": {str(t["rank"]): t["offset_us"] for t in tracks},
                "residual_us": {str(t["rank"]): t["residual_us"] for t in tracks},
            },
            "config": job.config,
        }


def start(MPI, world, plan, job, args) -> Tracer | None:
    """The Tracer of --trace (collective: every rank calls it), None without --trace."""
    return Tracer(MPI, world, plan, job, args) if getattr(args, "trace", None) else None


def gather(tracer: Tracer | None, MPI, comms: dict, timed: list) -> dict | None:
    """tracer.gather, None without --trace."""
    return None if tracer is None else tracer.gather(MPI, comms, timed)
