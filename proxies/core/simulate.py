"""Run the plans of all ranks without MPI: find deadlocks and mismatched messages, predict time.

Semantics, the worst case MPI allows (every send is synchronous, i.e. rendezvous):
- each rank runs its ops in order; a Compute takes cost(rank, op) (default 0);
- a P2P batch is posted when its rank reaches it. Messages pair FIFO per channel (src world
  rank, dst world rank, tag): the k-th send on a channel with the k-th recv on it. A message
  is matched once both sides are posted; the batch ends cost(rank, op) after its last match,
  and its rank is blocked until then;
- the n-th Collective a rank posts on group g pairs with the n-th of every other member of g;
  it ends cost(rank, op) after the last member posts. Blocking collectives block their rank
  until then; one with `req` is only posted, and the rank blocks at Wait(req) instead;
- a P2P batch with `req` is posted likewise without blocking its rank, which blocks at
  Wait(req) until the batch has ended. Until that Wait no other op of the rank may use the
  batch's buffers: none may write one it receives into or read it, none may write one it
  sends from (what MPI forbids for a pending Isend/Irecv); the same buffer is (name,
  micro-batch, chunk), a collective's chunk 0 (as the engine resolves them).

Times then follow from dependencies alone, so ranks are run in any order (each until it
blocks, then the next runnable one): O(ops + messages) in all, no global time steps.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .plan import P2P, Collective, Compute, Msg, Op, Plan, Wait
from .schedules import format_grid

GRID_RANKS = 16  # columns of the Step x Rank grid in a deadlock report


class PlanError(Exception):
    """The plans cannot run as written (deadlock, mismatched message or collective ...)."""


@dataclass
class Simulation:
    time: float  # when the last rank finishes
    finish: dict[int, float]  # per world rank: when it finishes its last op
    spans: dict[int, list[tuple[float, float, Op]]]  # per rank: (start, end, op), in plan order
    idle: dict[int, float]  # per rank: time minus its Compute time (comm, waiting, done early)


def _zero(rank: int, op: Op) -> float:
    return 0.0


def _label(op: Compute) -> str:
    """Grid cell of a compute op, as schedules.Action prints it: "F3", "1B2", "optimizer"."""
    kind = {"forward": "F", "backward": "B"}.get(op.name)
    if kind is None:
        return op.name if op.mb < 0 else f"{op.name}{op.mb}"
    return f"{op.chunk or ''}{kind}{op.mb}"


def _describe(msg: Msg) -> str:
    return f"{msg.count} {msg.dtype} ({msg.buf} mb {msg.mb} chunk {msg.chunk})"


class _Batch:
    """A posted P2P batch: `left` messages still unmatched, `ready` the latest match time;
    `end` once it has ended (non-blocking batches, which their rank does not wait in)."""

    __slots__ = ("rank", "index", "op", "start", "left", "ready", "open", "end")

    def __init__(self, rank: int, index: int, op: P2P, start: float) -> None:
        self.rank, self.index, self.op, self.start = rank, index, op, start
        self.left = len(op.sends) + len(op.recvs)
        self.ready = start
        self.open = [True] * self.left  # per message: sends first, then recvs
        self.end: float | None = None


class _Coll:
    """The n-th collective on one group: what each member posted, and when it ends."""

    __slots__ = ("gid", "n", "posts", "ends")

    def __init__(self, gid: int, n: int) -> None:
        self.gid, self.n = gid, n
        self.posts: list[tuple[int, int, Collective, float]] = []  # (rank, op index, op, t)
        self.ends: dict[int, float] | None = None  # per rank, once every member has posted


class _Sim:
    def __init__(self, plans: Sequence[Plan], cost: Callable[[int, Op], float]) -> None:
        self.plans = {p.rank: p for p in plans}
        if len(self.plans) != len(plans):
            ranks = sorted(p.rank for p in plans)
            dup = sorted({r for r in ranks if ranks.count(r) > 1})
            raise PlanError(f"more than one plan for rank(s) {dup}")
        self.cost = cost
        self.pc = {r: 0 for r in self.plans}
        self.clock = {r: 0.0 for r in self.plans}
        self.busy = {r: 0.0 for r in self.plans}
        self.spans: dict[int, list] = {r: [] for r in self.plans}
        self.labels: dict[int, list[str]] = {r: [] for r in self.plans}
        self.blocked: dict[int, object] = {}  # rank -> _Batch, _Coll or the awaited req
        # rank -> req -> [its _Coll or _Batch, index of its span]
        self.reqs: dict[int, dict[str, list]] = {r: {} for r in self.plans}
        # rank -> buffer key -> (req, True when the batch receives into it): the buffers of
        # its non-blocking P2P batches in flight
        self.held: dict[int, dict[tuple, tuple[str, bool]]] = {r: {} for r in self.plans}
        self.sends: dict[tuple[int, int, int], deque] = {}  # channel -> unmatched sends
        self.recvs: dict[tuple[int, int, int], deque] = {}  # channel -> unmatched recvs
        self.colls: dict[tuple[int, int], _Coll] = {}  # (group id, n) -> instance
        self.ncoll: dict[int, dict[str, int]] = {r: {} for r in self.plans}
        self.runnable = deque(self.plans)
        self._check_groups()

    # --- groups -------------------------------------------------------------------------

    def _check_groups(self) -> None:
        """Give each distinct group a number; members must have plans and agree on it."""
        self.gids: dict[tuple[str, tuple[int, ...]], int] = {}
        self.group_of: list[tuple[str, tuple[int, ...]]] = []
        self.rank_gid: dict[int, dict[str, int]] = {}
        for r, plan in self.plans.items():
            for name, members in plan.groups.items():
                if r not in members:
                    raise PlanError(f"rank {r}'s group {name!r} = {list(members)} omits rank {r}")
            mine = self.rank_gid[r] = {}
            for op in plan.ops:
                if isinstance(op, Collective) and op.group not in mine:
                    if op.group not in plan.groups:
                        raise PlanError(
                            f"rank {r} runs {op.kind} on group {op.group!r}, which its plan does "
                            f"not define (groups: {sorted(plan.groups)})"
                        )
                    mine[op.group] = self._gid(op.group, tuple(plan.groups[op.group]), r)

    def _gid(self, name: str, members: tuple[int, ...], r: int) -> int:
        gid = self.gids.get((name, members))
        if gid is not None:
            return gid
        for q in members:
            if q not in self.plans:
                raise PlanError(f"rank {r}'s group {name!r} = {list(members)}: no plan for {q}")
            theirs = self.plans[q].groups.get(name)
            if theirs is None or tuple(theirs) != members:
                raise PlanError(
                    f"ranks disagree on group {name!r}: rank {r} has {list(members)}, rank {q} "
                    f"has {list(theirs) if theirs is not None else 'no such group'}"
                )
        gid = self.gids[name, members] = len(self.group_of)
        self.group_of.append((name, members))
        return gid

    # --- running ------------------------------------------------------------------------

    def run(self) -> None:
        while self.runnable:
            self._advance(self.runnable.popleft())
        unfinished = [r for r in self.plans if self.pc[r] < len(self.plans[r].ops)]
        if unfinished:
            raise PlanError(self._deadlock_report(unfinished))
        for r, reqs in self.reqs.items():
            for _, i in reqs.values():  # a rank's i-th span is its op i
                op = self.plans[r].ops[i]
                raise PlanError(f"rank {r} op {i}: non-blocking {op_name(op)} is never waited")

    def _advance(self, r: int) -> None:
        """Run rank r until it blocks or finishes."""
        ops, pc, t = self.plans[r].ops, self.pc[r], self.clock[r]
        spans, cost = self.spans[r], self.cost
        while pc < len(ops):
            op = ops[pc]
            if type(op) is Compute:
                d = cost(r, op)
                spans.append((t, t + d, op))
                self.busy[r] += d
                self.labels[r].append(_label(op))
                t += d
                pc += 1
                continue
            self.pc[r], self.clock[r] = pc, t
            if type(op) is not Wait:
                if getattr(op, "req", "") in self.reqs[r]:
                    raise PlanError(f"rank {r} op {pc}: request {op.req!r} is already in flight")
                if self.held[r]:
                    self._check_held(r, pc, op)
            if type(op) is P2P:
                if not op.req:
                    self._post_p2p(r, pc, op, t)
                    return
                self._hold(r, op)
                in_flight = self.reqs[r][op.req] = [None, len(spans)]  # batch, its span
                spans.append((t, t, op))  # end filled in when the batch ends
                in_flight[0] = self._post_p2p(r, pc, op, t)
                pc += 1
                continue
            if type(op) is Collective:
                if not op.req:
                    self._post_collective(r, pc, op, t)
                    return
                in_flight = self.reqs[r][op.req] = [None, len(spans)]  # collective, its span
                spans.append((t, t, op))  # end filled in when the collective ends
                in_flight[0] = self._post_collective(r, pc, op, t)
                pc += 1
                continue
            if type(op) is Wait:
                if op.req not in self.reqs[r]:
                    raise PlanError(f"rank {r} op {pc}: Wait({op.req!r}) has no op in flight")
                started, _ = self.reqs[r][op.req]
                done = started.end if isinstance(started, _Batch) else started.ends
                if done is None:
                    self.blocked[r] = op.req
                    return
                del self.reqs[r][op.req]
                self._release(r, op.req)
                end = max(t, done if isinstance(started, _Batch) else done[r])
                spans.append((t, end, op))
                t = end
                pc += 1
                continue
            raise PlanError(f"rank {r} op {pc}: unknown op {op!r}")
        self.pc[r], self.clock[r] = pc, t

    def _resume(self, r: int, end: float, op: Op) -> None:
        """Rank r's blocking op ends at `end`: record it and make r runnable again."""
        self.spans[r].append((self.clock[r], end, op))
        self.clock[r] = end
        self.pc[r] += 1
        self.blocked.pop(r, None)
        self.runnable.append(r)

    # --- point-to-point -----------------------------------------------------------------

    def _hold(self, r: int, op: P2P) -> None:
        """Note the buffers of a non-blocking batch until its Wait."""
        held = self.held[r]
        for m in op.sends:
            held.setdefault((str(m.buf), m.mb, m.chunk), (op.req, False))
        for m in op.recvs:
            key = (str(m.buf), m.mb, m.chunk)
            if key in held:  # a batch sending and receiving in one buffer
                raise PlanError(
                    f"rank {r}: non-blocking {op.name} {op.req!r} uses buffer {m.buf} mb {m.mb} "
                    f"chunk {m.chunk} twice, receiving into it"
                )
            held[key] = (op.req, True)

    def _release(self, r: int, req: str) -> None:
        held = self.held[r]
        for key in [k for k, (q, _) in held.items() if q == req]:
            del held[key]

    def _check_held(self, r: int, index: int, op: Op) -> None:
        """Refuse an op that touches a buffer of a non-blocking batch in flight."""
        if isinstance(op, P2P):
            uses = [((str(m.buf), m.mb, m.chunk), False) for m in op.sends]
            uses += [((str(m.buf), m.mb, m.chunk), True) for m in op.recvs]
        elif isinstance(op, Collective):  # collectives write their buffer in place
            uses = [((str(op.buf), op.mb, 0), True)]
        else:
            return
        for key, writes in uses:
            owner = self.held[r].get(key)
            if owner is not None and (writes or owner[1]):
                raise PlanError(
                    f"rank {r} op {index} {op_name(op)} uses buffer {key[0]} mb {key[1]} "
                    f"chunk {key[2]} while non-blocking {owner[0]!r} "
                    f"{'receives into' if owner[1] else 'sends from'} it (before its Wait)"
                )

    def _post_p2p(self, r: int, index: int, op: P2P, t: float) -> _Batch:
        batch = _Batch(r, index, op, t)
        if not op.req:
            self.blocked[r] = batch
        nsend, plans, sends, recvs = len(op.sends), self.plans, self.sends, self.recvs
        for pos, m in enumerate(op.sends + op.recvs):
            if m.peer not in plans:
                raise PlanError(
                    f"rank {r} op {index}: message with rank {m.peer}, which has no plan"
                )
            sending = pos < nsend
            channel = (r, m.peer, m.tag) if sending else (m.peer, r, m.tag)
            mine, others = (sends, recvs) if sending else (recvs, sends)
            queue = others.get(channel)
            if not queue:  # the other side is not posted yet
                mine.setdefault(channel, deque()).append((batch, pos, m))
                continue
            other, other_pos, om = queue.popleft()
            if not queue:
                del others[channel]
            if m.count != om.count or m.dtype != om.dtype:
                self._mismatch(batch, m, other, om, sending)
            when = max(t, other.start)
            batch.open[pos] = other.open[other_pos] = False
            batch.left -= 1
            other.left -= 1
            batch.ready = max(batch.ready, when)
            other.ready = max(other.ready, when)
            if other.left == 0 and other is not batch:
                self._batch_done(other)
        if batch.left == 0:
            self._batch_done(batch)
        return batch

    def _batch_done(self, batch: _Batch) -> None:
        """Every message of the batch is matched: it ends cost(rank, op) after the last."""
        q, op = batch.rank, batch.op
        end = batch.ready + self.cost(q, op)
        if not op.req:
            self._resume(q, end, op)
            return
        batch.end = end
        self._complete(q, op, end)

    def _complete(self, q: int, op, end: float) -> None:
        """Non-blocking `op` (its req) of rank q ends at `end`: its span closes, and q
        resumes if it is already waiting for it."""
        span = self.reqs[q][op.req][1]
        self.spans[q][span] = (self.spans[q][span][0], end, op)
        if self.blocked.get(q) == op.req:  # q is already waiting for it
            del self.reqs[q][op.req]
            self._release(q, op.req)
            self._resume(q, max(self.clock[q], end), self.plans[q].ops[self.pc[q]])

    def _mismatch(self, a: _Batch, am: Msg, b: _Batch, bm: Msg, sending: bool) -> None:
        (s, sm), (d, dm) = ((a, am), (b, bm)) if sending else ((b, bm), (a, am))
        raise PlanError(
            f"message mismatch on rank {s.rank} -> rank {d.rank} tag {sm.tag}: "
            f"rank {s.rank} op {s.index} {s.op.name} sends {_describe(sm)}, "
            f"rank {d.rank} op {d.index} {d.op.name} receives {_describe(dm)}"
        )

    # --- collectives --------------------------------------------------------------------

    def _post_collective(self, r: int, index: int, op: Collective, t: float) -> _Coll:
        gid = self.rank_gid[r][op.group]
        n = self.ncoll[r].get(op.group, 0)
        self.ncoll[r][op.group] = n + 1
        coll = self.colls.get((gid, n))
        if coll is None:
            coll = self.colls[gid, n] = _Coll(gid, n)
        elif coll.posts:
            q, qi, qop, _ = coll.posts[0]
            if (qop.kind, qop.count, qop.dtype, qop.unit) != (op.kind, op.count, op.dtype, op.unit):
                name, members = self.group_of[gid]
                raise PlanError(
                    f"collective #{n} on group {name!r} (ranks {list(members)}) does not match: "
                    f"rank {q} op {qi} posts {qop.kind} of {qop.count} {qop.dtype}, "
                    f"rank {r} op {index} posts {op.kind} of {op.count} {op.dtype}"
                )
        coll.posts.append((r, index, op, t))
        if not op.req:
            self.blocked[r] = coll
        if len(coll.posts) == len(self.group_of[gid][1]):
            self._end_collective(coll)
        return coll

    def _end_collective(self, coll: _Coll) -> None:
        last = max(t for _, _, _, t in coll.posts)
        coll.ends = {}
        for q, _, op, _ in coll.posts:
            end = coll.ends[q] = last + self.cost(q, op)
            if not op.req:
                self._resume(q, end, op)
                continue
            self._complete(q, op, end)

    # --- diagnosis ----------------------------------------------------------------------

    def _where(self, q: int) -> str:
        ops = self.plans[q].ops
        if self.pc[q] >= len(ops):
            return f"rank {q} has finished"
        return f"rank {q} is blocked at op {self.pc[q]} {op_name(ops[self.pc[q]])}"

    def _deadlock_report(self, unfinished: list[int]) -> str:
        lines = [f"deadlock: {len(unfinished)} of {len(self.plans)} ranks cannot progress"]
        for r in unfinished:
            op = self.plans[r].ops[self.pc[r]]
            lines.append(f"  rank {r} at op {self.pc[r]} {op_name(op)}: {self._waits_for(r)}")
        shown = unfinished[:GRID_RANKS] if len(self.plans) > GRID_RANKS else list(self.plans)
        lines.append("Compute actions executed so far (Step x Rank):")
        lines.append(format_grid({f"Rank {q}": self.labels[q] for q in sorted(shown)}))
        return "\n".join(lines)

    def _waits_for(self, r: int) -> str:
        state = self.blocked.get(r)
        if isinstance(state, _Batch):
            return self._open(r, state)
        if isinstance(state, str):  # Wait(req)
            started, _ = self.reqs[r][state]
            if isinstance(started, _Batch):
                return f"Wait({state!r}) for {started.op.name}: {self._open(r, started)}"
            return f"Wait({state!r}) for {self._missing(started)}"
        return self._missing(state)

    def _open(self, r: int, batch: _Batch) -> str:
        op, parts = batch.op, []
        for pos, m in enumerate(op.sends + op.recvs):
            if batch.open[pos]:
                parts.append(self._unmatched(r, m, sending=pos < len(op.sends)))
        return "; ".join(parts)

    def _unmatched(self, r: int, m: Msg, sending: bool) -> str:
        what = "send to" if sending else "recv from"
        other = "recv" if sending else "send"
        text = f"{what} rank {m.peer} tag {m.tag} has no matching {other} ({self._where(m.peer)}"
        later = self._posted_later(m.peer, r, m.tag, want_send=not sending)
        if later is not None:
            text += f"; it posts one at op {later}"
        return text + ")"

    def _posted_later(self, q: int, peer: int, tag: int, want_send: bool) -> int | None:
        """First op of rank q after its current one with a message to/from peer on tag."""
        ops = self.plans[q].ops
        for i in range(self.pc[q] + 1, len(ops)):
            op = ops[i]
            if isinstance(op, P2P):
                for m in op.sends if want_send else op.recvs:
                    if m.peer == peer and m.tag == tag:
                        return i
        return None

    def _missing(self, coll: _Coll) -> str:
        name, members = self.group_of[coll.gid]
        op = coll.posts[0][2]
        posted = {q for q, _, _, _ in coll.posts}
        absent = [q for q in members if q not in posted]
        shown = "; ".join(self._where(q) for q in absent[:8])
        more = f"; and {len(absent) - 8} more" if len(absent) > 8 else ""
        return (
            f"{op.kind} #{coll.n} on group {name!r} ({len(members)} ranks) waits for "
            f"rank(s) {absent[:8]}{'...' if more else ''} ({shown}{more})"
        )


def op_name(op: Op) -> str:
    """One op in a diagnosis: "forward", "allreduce(dp) req 'dp0'", "Wait('dp0')" ..."""
    if isinstance(op, P2P):
        return op.name + (f" req {op.req!r}" if op.req else "")
    if isinstance(op, Compute):
        return op.name
    if isinstance(op, Collective):
        return f"{op.kind}({op.group})" + (f" req {op.req!r}" if op.req else "")
    if isinstance(op, Wait):
        return f"Wait({op.req!r})"
    return type(op).__name__


def simulate(plans: Sequence[Plan], cost: Callable[[int, Op], float] | None = None) -> Simulation:
    """Run every rank's plan; raise PlanError with a diagnosis if they cannot run.

    cost(rank, op) is the duration of a Compute, a P2P batch (after its last message is
    matched, blocking or not) or a Collective (after its last member posts); default 0
    for everything.
    """
    sim = _Sim(plans, cost or _zero)
    sim.run()
    finish = dict(sim.clock)
    time = max(finish.values(), default=0.0)
    idle = {r: time - sim.busy[r] for r in sim.plans}
    return Simulation(time, finish, sim.spans, idle)
