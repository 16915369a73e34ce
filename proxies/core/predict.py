"""Predict an iteration: every rank's plan run on a machine model, in simulated time.

The same plans the engine executes and simulate.py validates are run here as a
discrete-event simulation in global time order:
- a Compute takes what `compute(rank, op)` says (FLOPs at a rate, a replayed time, 0);
- a point-to-point message starts when both sides have posted it (rendezvous), costs its
  level's latency, then moves its bytes as a flow that shares links with every other flow
  in flight (network.py: max-min fair share, a node's interface shared by its flows),
  behind its pair's earlier messages and not while MPI on either rank adds or copies for
  a collective it runs (_transfer, _move);
- a collective runs the steps of the algorithm that executes it (proxies.core.collectives: the
  same description the executor reads), either message by message ("steps": each member
  starts its own steps when it posts, every message a flow) or phase by phase ("coarse":
  once every member has posted, each phase's aggregated flows share the links, plus the
  phase's latency and reduction time along its critical path). Steps is exact to the
  algorithm; coarse is what scales (a ring's 2(n-1) steps become one flow per edge), and
  the two agree where both run (tested).

The collectives' half of the simulation is predict_collectives.py; when a waiting rank
sees what it waits for (its tests, and the tests unexpected messages take) predict_waits.py.

Identical ranks once ("folding"): ranks whose coordinates differ only in dimensions whose
members run the same plan op for op (data-parallel replicas; tensor-parallel shards) are
images of one representative, the rank with those coordinates 0. Only representatives are
simulated. A collective over a group that reaches outside them runs coarse with all its
members' flows on their real links; a flow crossing a node's interface counts once per image
group on that node (eight tensor-parallel ranks each running their own data-parallel ring
through one interface: weight 8). The images run the same ops at the same times, so the
answer is the full simulation's; tests compare the two on worlds small enough for both.

Breakdown per rank, adding up to the iteration (the slowest rank's finish), as the engine
books a measured run: compute; a blocking P2P batch's wait, receive by receive in order,
until each message exists (its sender posted it, its latency passed and the pair's earlier
messages moved: the engine probes for it) is idle, the rest its category; a blocking
collective's category is the shortest time any member spent in it (the last to arrive waits
least), the rest of each member's time idle; a non-blocking collective's or P2P batch's
exposed time is its Wait, and the time it ran under
other work is <category>_hidden (not part of the sum; per category the union of its ops'
spans, as a run books it): a non-blocking batch's messages are
posted, matched and moved as a blocking one's, but its rank computes on until the Wait;
after its last op a rank is idle until the end. With the machine's engine.op_overhead
(or engine.<kind> for its kind of op, or oversubscribed.op_overhead on a crowded node)
every op first costs that much on its rank, booked as overhead, as the engine books its
own time around ops. A non-blocking collective's adds and copies take its rank's core:
what falls in the rank's own work delays it, booked to the collective (_steal).

Reused buffers: with the machine's `reuse` figures and the runtime's buffer for each op
(`buffers`: the proxies reuse a few buffers with compute none and model), a collective MPI
runs itself on a buffer its rank used again within `reuse.cache` distinct bytes costs
`reuse.reread` x per byte moved, added and copied (reused_ops; steps detail). Measured
here: in the state where MPI's 1 MiB allreduce took 2.6 x as long on the buffer the
previous one wrote as on a cold one, GPT-3's tensor-parallel comm-only point reduced one
2 MiB buffer 32 times an iteration at 0.73 ms a call, against about 0.2 ms cold
(calibrate's cold 1 and 16 MiB MPI allreduces, interpolated).

Cold code: with the machine's `cold` figures, an op after its rank's last communication op
touched B bytes (plan_touched; a non-blocking op's bytes count at its Wait, which pays them;
compute ops in between touch nothing and pay too: their code is not MPI's) costs the engine
cold.engine x min(1, B / cold.moved) ** cold.exponent more (overhead), and a blocking
exchange's or collective's MPI calls cold.latency x that (booked to the op, before it posts:
it delays the op's messages). The kernels' own traffic with real compute is not counted
(compute none and model touch nothing). predict_caches.py holds both.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from proxies.core.faults import DELAY
from proxies.core.network import PORT_OUT, Flow, Flows, Topology
from proxies.core.plan import P2P, Collective, Compute, Op, Plan, Wait
from proxies.core.predict_caches import CacheSim, reused_ops
from proxies.core.predict_collectives import CollectiveSim, Instance
from proxies.core.predict_waits import WaitSim
from proxies.core.report import HIDDEN, union_seconds
from proxies.core.simulate import PlanError, op_name

STEP_MESSAGES = 200_000  # auto: step by step while the collectives' messages stay below this
# (plan) -> (buffer name, micro-batch) -> the buffer the runtime uses for it
Buffers = Callable[[Plan], Callable[[object, int], object]]


@dataclass
class Prediction:
    time: float  # the iteration: when the last simulated rank finishes
    finish: dict[int, float]  # per simulated rank
    breakdown: dict[int, dict[str, float]]  # per simulated rank: category -> seconds
    rep_of: np.ndarray | None  # world rank -> simulated rank it is an image of (folded)
    detail: str  # "steps" or "coarse" (how collectives ran)
    flows: int  # flows simulated
    # With keep_spans, per simulated rank: (start, end, op, idle) of each op, idle the
    # seconds at its start spent waiting for peers (None: a non-blocking collective's time
    # in flight; its Wait is the same collective with its exposed span). For --trace.
    spans: dict[int, list[tuple[float, float, Op, float | None]]] = field(default_factory=dict)

    def of(self, rank: int) -> dict[str, float]:
        """Breakdown of any world rank (its representative's when folded)."""
        r = int(self.rep_of[rank]) if self.rep_of is not None else rank
        return self.breakdown[r]


# --- the simulation -----------------------------------------------------------------------


class _Msg:
    __slots__ = ("src", "dst", "nbytes", "members", "matched", "moving", "library", "on_done")

    def __init__(self, src: int, dst: int, nbytes: int, members) -> None:
        self.src, self.dst, self.nbytes, self.members = src, dst, nbytes, members
        self.matched = 0.0
        self.moving = 0.0  # when its bytes started to move (after the pair's earlier ones)
        self.library = False  # a step of a collective the MPI library runs
        self.on_done: list[Callable[[float, _Msg], None]] = []


class _Predictor(CollectiveSim, WaitSim, CacheSim):
    def __init__(
        self,
        plans: Sequence[Plan],
        topo: Topology,
        compute: Callable[[int, Compute], float],
        algorithm: Callable[[str, int], str],
        detail: str,
        rep_of: np.ndarray | None,
        keep_spans: bool,
        slow_links: dict[tuple[int, int], float] | None = None,
        buffers: Buffers | None = None,
        untouched_sends: bool = False,
    ) -> None:
        self.plans = {p.rank: p for p in plans}
        self.slow_links = slow_links or {}  # --slow-link: (low rank, high rank) -> factor
        if len(self.plans) != len(plans):
            raise PlanError("more than one plan for a rank")
        self.topo, self.compute, self.algorithm = topo, compute, algorithm
        self.rep_of, self.keep_spans = rep_of, keep_spans
        # a collective's local work runs on the rank's core, slowed as compute is where
        # ranks outnumber cores (`share`): its copies (an all-to-all's blocks through
        # scratch) at compute.memory, bytes read + written (free when the file has none),
        # its adds at compute.reduce, and page faults on fresh temporaries (predict_
        # collectives). (gpt2 at 4 ranks on 2 cores, 147 MiB allreduces: -22 .. -26%
        # with only copies slowed, +8 .. +12% with all three; one calibration, refitted.)
        mem, cores = topo.machine.memory_bandwidth, topo.machine.cores_per_node
        self.share = max(1.0, topo.rpn / cores) if cores else 1.0
        self.copy_s = 2.0 * self.share / mem if mem else 0.0  # seconds per byte copied
        self.reduce_bw = topo.machine.reduce_bandwidth / self.share
        own = topo.op_overheads()  # the engine's own seconds per op, by kind
        self.own = {Compute: own["compute"], P2P: own["exchange"], Collective: own["collective"]}
        self.own_async = own["nonblocking"]  # a non-blocking op's start, a Wait
        # an op after its rank moved bulk data is cold (the machine's `cold`; not crowded)
        m = topo.machine
        self.cold = m.cold_moved and not topo.crowded and (m.cold_engine or m.cold_latency)
        self.after = dict.fromkeys(self.plans, 0)  # bytes its last communication op touched
        self.pending: dict[int, dict[str, int]] = {r: {} for r in self.plans}  # req -> bytes
        self.charging = any(own.values()) or bool(self.cold)
        self.charged = dict.fromkeys(self.plans, -1)  # the last op charged its overhead
        library = getattr(algorithm, "library", None)
        self.library: Callable[[str], bool] = library or (lambda kind: False)
        self.flows = Flows(topo.capacity)
        self.events: list = []
        self.seq = 0
        self.now = 0.0
        self.pc = dict.fromkeys(self.plans, 0)
        self.book: dict[int, dict[str, float]] = {r: defaultdict(float) for r in self.plans}
        self.spans: dict[int, list] = {r: [] for r in self.plans}
        self.finish: dict[int, float] = {}
        self.channels: dict[tuple, tuple[deque, deque]] = {}
        # (sender, receiver) -> matched messages waiting for the one moving on that pair
        self.wires: dict[tuple[int, int], deque] = {}
        self.ncoll: dict[int, dict[str, int]] = {r: defaultdict(int) for r in self.plans}
        self.instances: dict[tuple, Instance] = {}
        self.blocking: list[tuple[int, Instance]] = []  # booked after the run
        # rank -> until when MPI there runs a collective's adds or copies (_steps, _move)
        self.local_until = dict.fromkeys(self.plans, 0.0)
        self.reqs: dict[int, dict[str, list]] = {r: {} for r in self.plans}
        # rank -> category -> (posted, done or wait began) of its non-blocking ops
        self.hidden: dict[int, dict[str, list]] = {r: defaultdict(list) for r in self.plans}
        self.waiting: dict[int, str] = {}  # rank -> the req it blocks on
        self.blocked: dict[int, float] = {}  # rank -> since when it waits (any blocking op)
        # rank -> (the wait's start, its tests taken by unexpected messages, the part of a
        # test taken so far: _unexpected); the tests each one takes on a crowded node
        self.taken: dict[int, tuple[float, set, list]] = {}
        unexpected = topo.machine.oversub_unexpected if topo.crowded and topo.yielding else 0
        self.unexpected = unexpected or 0.0
        # rank -> messages of collectives MPI runs that it sends or receives, matched and
        # not yet arrived; tests unexpected messages took while there were some, owed by
        # its next step (_unexpected)
        self.moving = dict.fromkeys(self.plans, 0)
        self.owed = dict.fromkeys(self.plans, 0)
        # A non-blocking collective's reductions and copies run on its rank's core (MPI
        # progresses it inside the engine's calls): where they fall in the rank's own work
        # (compute, the engine) they delay it, charged when it next resumes
        self.busy = dict.fromkeys(self.plans, 0.0)  # the end of the rank's current own work
        self.debt: dict[int, dict[str, float]] = {r: defaultdict(float) for r in self.plans}
        self._images: dict[tuple, int] = {}
        self._shapes: dict[tuple, object] = {}
        self._resumes: dict[tuple, dict] = {}  # (instance, rank) -> where its steps wait
        self.rep_nodes = {topo.node(r) for r in self.plans}  # nodes holding a simulated rank
        self.detail = self._detail(detail)
        # rank -> its collectives on a reused buffer (reused_ops), each costing reread x;
        # only the step-by-step simulation prices them (coarse phases never read it)
        m = topo.machine
        self.reread = m.reread if buffers is not None and m.reuse_cache and m.reread else 1.0
        self.reused: dict[int, frozenset] = {}
        # MPI's all-to-all from a send buffer never written (zero pages): x per byte
        self.zero_page = (m.zero_page_alltoall or 1.0) if untouched_sends else 1.0
        if self.reread != 1.0 and self.detail == "steps":
            for r, p in self.plans.items():
                self.reused[r] = reused_ops(p, buffers(p), m.reuse_cache)

    # --- scheduling ---------------------------------------------------------------------

    def at(self, t: float, fn: Callable[[], None]) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, fn))

    def run(self) -> None:
        for r in self.plans:
            self.at(0.0, lambda r=r: self._advance(r))
        events, flows = self.events, self.flows
        while True:
            te = events[0][0] if events else math.inf
            tf = flows.next_time()
            if tf == te == math.inf:
                break
            if tf <= te:
                self.now = tf
                flows.pop_done()
            else:
                t, _, fn = heapq.heappop(events)
                self.now = t
                fn()
        stuck = [r for r in self.plans if r not in self.finish]
        if stuck:
            r = stuck[0]
            raise PlanError(
                f"prediction stopped: {len(stuck)} rank(s) cannot progress, e.g. rank {r} at "
                f"op {self.pc[r]} ({op_name(self.plans[r].ops[self.pc[r]])}); the dry run "
                f"without --machine names the cause"
            )
        for r, spans in self.hidden.items():
            for category, hid in spans.items():
                self.book[r][category + HIDDEN] += union_seconds(hid)
        for r, inst in self.blocking:
            core = inst.core
            self.book[r][inst.op.category] += core
            self.book[r]["idle"] += inst.ends[r] - inst.posts[r] - core
            if self.keep_spans:
                span = inst.ends[r] - inst.posts[r]
                self.spans[r].append((inst.posts[r], inst.ends[r], inst.op, span - core))

    def _detail(self, detail: str) -> str:
        if detail != "auto":
            return detail
        messages = 0
        for p in self.plans.values():
            for op in p.ops:
                if isinstance(op, Collective):  # a ring's 2(n-1) sends per member, at most
                    messages += 2 * (len(p.groups[op.group]) - 1)
                    if messages > STEP_MESSAGES:
                        return "coarse"
        return "steps"

    # --- ranks --------------------------------------------------------------------------

    def _advance(self, r: int) -> None:
        """Run rank r from its current op at self.now until it blocks or finishes."""
        ops, pc, t = self.plans[r].ops, self.pc[r], self.now
        book, spans = self.book[r], self.spans[r]
        own, own_async, charging = self.own, self.own_async, self.charging
        for category, seconds in self.debt[r].items():  # its core did a collective's work
            book[category] += seconds
            t += seconds
        self.debt[r].clear()
        while pc < len(ops):
            op = ops[pc]
            if charging and self.charged[r] != pc:
                # the engine's own time before each op (booked as the engine books it)
                self.charged[r] = pc
                oh = own_async if type(op) is Wait or getattr(op, "req", "") else own[type(op)]
                if self.cold:
                    oh, late = self._cold(r, op, oh)
                    if late:  # a blocking op's MPI calls, cold: booked to the op
                        book[op.category] += late
                        t += late
                book["overhead"] += oh
                t += oh
            if type(op) is Compute:
                d = self.compute(r, op)
                book[op.category] += d
                if self.keep_spans:
                    spans.append((t, t + d, op, 0.0))
                t += d
                pc += 1
                continue
            self.pc[r] = pc
            if t > self.now:  # everything else happens in global time order
                self.busy[r] = t
                self.at(t, lambda: self._advance(r))
                return
            if type(op) is P2P:
                if not op.req:
                    self.blocked[r] = t
                    self._p2p(r, op, t, lambda end: self._resume(r, end))
                    return
                if op.req in self.reqs[r]:
                    raise PlanError(f"rank {r} op {pc}: request {op.req!r} is already in flight")
                self.reqs[r][op.req] = [op, t, None, None]  # op, posted, end, wait began
                self._p2p(r, op, t, lambda end, req=op.req: self._req_done(r, req, end))
                pc += 1
                continue
            if type(op) is Collective:
                if not op.req:
                    self.blocked[r] = t
                    self._join(r, op, t, lambda end: self._resume(r, end))
                    return
                if op.req in self.reqs[r]:
                    raise PlanError(f"rank {r} op {pc}: request {op.req!r} is already in flight")
                entry = self.reqs[r][op.req] = [op, t, None, None]  # op, posted, end, wait began
                self._join(r, op, t, lambda end, req=op.req: self._req_done(r, req, end))
                pc += 1
                continue
            if type(op) is Wait:
                entry = self.reqs[r].get(op.req)
                if entry is None:
                    raise PlanError(f"rank {r} op {pc}: Wait({op.req!r}) has no op in flight")
                entry[3] = t
                if entry[2] is None:
                    self.waiting[r] = op.req
                    self.blocked[r] = t
                    return
                self._waited(r, op.req, t)
                pc += 1
                continue
            raise PlanError(f"rank {r} op {pc}: unknown op {op!r}")
        self.pc[r] = pc
        self.finish[r] = t

    def _resume(self, r: int, t: float) -> None:
        self.blocked.pop(r, None)
        self.pc[r] += 1
        self.at(t, lambda: self._advance(r))

    def _req_done(self, r: int, req: str, end: float) -> None:
        self.reqs[r][req][2] = end
        if self.waiting.get(r) == req:
            del self.waiting[r]
            self._waited(r, req, end)
            self._resume(r, end)

    def _waited(self, r: int, req: str, now: float) -> None:
        op, posted, end, began = self.reqs[r].pop(req)
        book = self.book[r]
        book[op.category] += now - began  # exposed: blocked in the wait
        if min(end, began) > posted:  # booked as a run books it: the union (run)
            self.hidden[r][op.category].append((posted, min(end, began)))
        if self.keep_spans:
            self.spans[r].append((posted, end, op, None))
            self.spans[r].append((began, now, op, 0.0))

    # --- point-to-point -----------------------------------------------------------------

    def _p2p(self, r: int, op: P2P, t: float, then: Callable[[float], None]) -> None:
        """Post a batch's messages at t; `then(end)` once the last has arrived (and been
        held). A blocking batch books its idle and category here, a non-blocking one at its
        Wait (_waited)."""
        left = len(op.sends) + len(op.recvs)
        if left == 0:
            then(t)
            return
        # messages left, when the last was matched, the last arrival, the last with holds,
        # the last receive (with holds), the last send
        state = [left, t, t, t, t, t]
        recvs: list = [None] * len(op.recvs)  # per receive: (its bytes began to move, held)

        def one_done(end: float, m: _Msg, k: int = -1) -> None:
            state[0] -= 1
            state[1] = max(state[1], m.matched)
            state[2] = max(state[2], end)
            # --slow-link, as the engine does it: the receiver holds the message (F - 1) x
            # its transfer time; not a non-blocking batch's (p2p.py)
            pair = (min(m.src, m.dst), max(m.src, m.dst))
            f = self.slow_links.get(pair) if m.dst == r and not op.req else 0
            held = end + (f - 1) * (end - m.matched) if f else end
            state[3] = max(state[3], held)
            if m.dst == r:
                state[4] = max(state[4], held)
                recvs[k] = (m.moving, held)
            else:
                state[5] = max(state[5], end)
            if state[0] == 0:
                end = state[3]
                if not op.req:
                    book = self.book[r]
                    # idle: as the engine books it, each receive's wait, in order, until its
                    # message exists (its sender posted it and the pair's earlier messages
                    # moved: its bytes begin to move); the rest of the transfer its category
                    waited, cursor = 0.0, t
                    for moving, held in recvs:
                        waited += max(0.0, moving - cursor)
                        cursor = max(cursor, held)
                    waited = min(waited, state[2] - t)
                    book["idle"] += waited
                    book[op.category] += state[2] - t - waited
                    if state[3] > state[2]:
                        book[DELAY] += state[3] - state[2]
                    # a yielding wait sees what it waits for at its next test: the receives
                    # from the batch's start, then the sends from when their wait begins
                    # (after the receives); the engine books that in its waits (idle)
                    got = self._seen(t, state[4])
                    end = max(got, self._seen(got, state[5]), state[3])
                    book["idle"] += end - state[3]
                    if self.keep_spans:
                        self.spans[r].append((t, end, op, waited + end - state[3]))
                then(end)

        for m in op.sends:
            self._post(("p", m.tag), r, m.peer, m.nbytes, True, t, one_done, None)
        for k, m in enumerate(op.recvs):
            done = lambda end, msg, k=k: one_done(end, msg, k)  # noqa: E731
            self._post(("p", m.tag), m.peer, r, m.nbytes, False, t, done, None)

    def _post(self, tag, src, dst, nbytes: int, sending: bool, t: float, done, members, inst=None):
        """Post one side of a message on channel (tag, src, dst); k-th send meets k-th recv.
        inst: the collective it is a step of (None: point-to-point)."""
        other = dst if sending else src
        if other not in self.plans:
            raise PlanError(
                f"rank {src if sending else dst} exchanges a message with rank {other}, "
                f"which is not simulated"
            )
        key = (tag, src, dst)
        queues = self.channels.get(key)
        if queues is None:
            queues = self.channels[key] = (deque(), deque())
        mine, theirs = (queues[0], queues[1]) if sending else (queues[1], queues[0])
        if theirs:
            msg = theirs.popleft()
            if msg.nbytes != nbytes:
                raise PlanError(
                    f"message mismatch rank {src} -> rank {dst} ({tag}): one side has "
                    f"{msg.nbytes} bytes, the other {nbytes}"
                )
            msg.on_done.append(done)
            msg.matched = t
            self._transfer(msg, t)
        else:
            msg = _Msg(src, dst, nbytes, members)
            msg.library = inst is not None and inst.library
            msg.on_done.append(done)
            mine.append(msg)
            if sending and self.unexpected and (inst is None or dst not in inst.posts):
                # it reaches a rank that has not posted its op yet (MPI's unexpected queue)
                arrival = t + self.topo.alpha(src, dst)
                self.at(arrival, lambda: self._unexpected(dst, arrival))

    def _transfer(self, msg: _Msg, t: float) -> None:
        """A matched message: its level's latency, then its bytes as a flow, behind the
        messages from the same sender to the same receiver that are still moving (an MPI
        transport carries one pair's messages in order, through one queue or connection:
        a small send posted after a large one arrives after it). A message joins that
        queue after its latency: a collective's step that MPI has not yet taken holds
        nothing back."""
        alpha = self.topo.alpha(msg.src, msg.dst, msg.library)
        start = t + alpha
        if msg.library and self.unexpected:  # MPI moves it at its ranks' tests
            self.moving[msg.src] += 1
            self.moving[msg.dst] += 1
        if alpha > 0:  # its bytes join the pair's queue when the step is taken
            self.at(start, lambda: self._enqueue(msg, start))
        else:
            self._enqueue(msg, start)

    def _enqueue(self, msg: _Msg, start: float) -> None:
        pair = (msg.src, msg.dst)
        queue = self.wires.get(pair)
        if queue is not None:
            queue.append((msg, start))
            return
        self.wires[pair] = deque()
        self._move(msg, start)

    def _move(self, msg: _Msg, start: float) -> None:
        """Move msg's bytes from `start`; then the next message queued on its pair."""
        pair = (msg.src, msg.dst)
        # nothing moves while MPI on either rank adds or copies for a collective it runs:
        # its progress is that work then (a 512 KiB halo sent right after posting a 14 MiB
        # allreduce on the same pair of 2 ranks: 1.33 - 1.47 ms, alone 0.05; the allreduce's
        # first message, its add, then the halo)
        busy = self.local_until
        start = max(start, busy[msg.src], busy[msg.dst])
        msg.moving = start

        def next_on_pair(end: float) -> None:
            queue = self.wires[pair]
            if queue:
                nxt, ready = queue.popleft()
                self._move(nxt, max(ready, end))
            else:
                del self.wires[pair]

        def finished(end: float) -> None:
            if msg.library and self.unexpected:
                self.moving[msg.src] -= 1
                self.moving[msg.dst] -= 1
            for cb in msg.on_done:  # first: an arrival may set its rank's MPI to work
                cb(end, msg)
            # the next one after every other arrival of this instant (a step needs two)
            self.at(end, lambda: next_on_pair(end))

        if msg.nbytes == 0:
            self.at(start, lambda: finished(start))
            return
        flow = self._flow(msg.src, msg.dst, msg.nbytes, finished, msg.members)
        self.at(start, lambda: self.flows.start(flow, start))

    # --- folding weights ----------------------------------------------------------------

    def _flow(self, a: int, b: int, nbytes: int, done, members) -> Flow:
        """A flow of nbytes from rank a to rank b over their path (members: the group of the
        collective it belongs to, None for point-to-point)."""
        links = self.topo.links(a, b)
        return Flow(links, nbytes, self.topo.cap(a, b), done, self._weights(a, links, members))

    def _weights(self, a: int, links: tuple, members) -> dict:
        """Images sharing each shared link of a flow from rank a over `links` (none
        unfolded; none on the ports within a node, every rank has its own)."""
        if self.rep_of is None:
            return {}
        if links[0][0] == PORT_OUT:  # within a node
            if len(links) == 3:  # the node's fabric as a whole
                return {links[1]: self._images_on(a, 1, members)}
            return {}
        w = self._images_on(a, 1, members)
        out = dict.fromkeys(links, w)
        if len(links) == 4:  # up and down through the switches
            out[links[1]] = out[links[2]] = self._images_on(a, self.topo.switch_nodes, members)
        return out

    def _images_on(self, a: int, nodes: int, members) -> float:
        """Copies of rank a's flow that cross the same interface (or uplink, nodes > 1):
        ranks on a's node (switch) that are images of a's representative, over the
        members of a's own group there (who are not copies but partners)."""
        span = self.topo.rpn * nodes
        lo = (a // span) * span
        key = (a, span)
        images = self._images.get(key)
        if images is None:
            rep = self.rep_of
            images = self._images[key] = int(np.count_nonzero(rep[lo : lo + span] == rep[a]))
        own = 1 if members is None else sum(1 for q in members if lo <= q < lo + span)
        return images / max(own, 1)


def predict(
    plans: Sequence[Plan],
    topo: Topology,
    compute: Callable[[int, Compute], float],
    algorithm: Callable[[str, int], str],
    *,
    detail: str = "auto",
    rep_of: np.ndarray | None = None,
    keep_spans: bool = False,
    slow_links: dict[tuple[int, int], float] | None = None,
    buffers: Buffers | None = None,
    untouched_sends: bool = False,
) -> Prediction:
    """Run the plans on the topology's machine. `plans` are every rank's, or with `rep_of`
    (world rank -> representative) the representatives' only. Raises PlanError when the
    plans cannot run (simulate.py gives the full diagnosis). `slow_links`: --slow-link's
    (low rank, high rank) -> factor; each point-to-point message between them is held by
    its receiver for (factor - 1) x its transfer time, booked as fault_delay. `buffers`:
    which buffer the runtime uses for each op's (name, micro-batch), where it reuses
    buffers (the machine's `reuse` figures apply; None: they do not). `untouched_sends`:
    the runtime never writes its all-to-alls' send buffers (compute none and model without
    --check): the machine's zero_pages.alltoall applies."""
    sim = _Predictor(
        plans, topo, compute, algorithm, detail, rep_of, keep_spans, slow_links, buffers,
        untouched_sends,
    )  # fmt: skip
    sim.run()
    time = max(sim.finish.values(), default=0.0)
    breakdown = {}
    for r, book in sim.book.items():
        book = dict(book)
        book["idle"] = book.get("idle", 0.0) + time - sim.finish[r]
        breakdown[r] = book
    return Prediction(
        time, dict(sim.finish), breakdown, rep_of, sim.detail, sim.flows.count, sim.spans
    )
