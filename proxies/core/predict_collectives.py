"""The predictor's collectives (predict.py runs the ranks, their messages and compute).

A collective over a group is an Instance: who posted it when and who finished when. In
"steps" detail each member runs its own steps of the algorithm's program as it posts (every
message a flow through _post, in order with the pair's other messages); in "coarse" detail,
once every member has posted, phase by phase: each phase's aggregated flows share the links,
then the phase's latency and local work along its critical path. A non-blocking
collective's local work (adds, copies, bytes received within a node) runs on its rank's
core and delays the rank's own work it falls in (_steal). With yielding waits a step goes
on at a test (_seen): a blocking collective's in its own wait, a non-blocking one's in
whatever wait its rank is in (at once while the rank computes).
"""

from __future__ import annotations

from collections.abc import Callable

from proxies.core.mpi_choice import fault_seconds_per_byte
from proxies.core.plan import Collective, itemsize
from proxies.core.simulate import PlanError


class Instance:
    """The n-th collective on one group: who posted when, who finished when."""

    __slots__ = (
        "key", "members", "op", "alg", "expected", "folded", "posts", "ends", "then", "fault",
        "copy_fault", "library", "reread",
    )  # fmt: skip

    def __init__(self, key, members, op: Collective, alg: str, expected: int, folded: bool):
        self.key, self.members, self.op, self.alg = key, members, op, alg
        self.expected, self.folded = expected, folded
        self.fault = 0.0  # extra seconds per reduced byte (fresh temporaries)
        self.copy_fault = 0.0  # extra seconds per copied byte (a fresh temporary copied back)
        self.library = False  # the MPI library runs it (not our point-to-point program)
        self.reread = 1.0  # cost per byte moved, added, copied over a cold buffer's (reuse)
        self.posts: dict[int, float] = {}  # simulated member -> post time
        self.ends: dict[int, float] = {}  # simulated member -> its end
        self.then: dict[int, Callable[[float], None]] = {}  # member -> what its end does

    @property
    def core(self) -> float:
        """The collective itself: the shortest time a member spent in it."""
        return min(self.ends[q] - self.posts[q] for q in self.ends)


class CollectiveSim:
    """The collective half of predict._Predictor (a mixin: it uses the predictor's state)."""

    def _join(self, r: int, op: Collective, t: float, then: Callable[[float], None]) -> None:
        members = self.plans[r].groups[op.group]
        n = self.ncoll[r][op.group]
        self.ncoll[r][op.group] = n + 1
        key = (op.group, members, n)
        inst = self.instances.get(key)
        if inst is None:
            inside = sum(1 for q in members if q in self.plans)
            alg = self.algorithm(op.kind, op.nbytes)
            inst = self.instances[key] = Instance(
                key, members, op, alg, inside, inside < len(members)
            )
            inst.library = self.library(op.kind)
            if inst.library and op.kind == "alltoall" and self.zero_page != 1.0:
                inst.reread = self.zero_page  # from a send buffer never written
            elif inst.library and self.pc[r] in self.reused.get(r, ()):
                inst.reread = self.reread  # on a buffer its creator's rank reused
            machine = self.topo.machine
            if op.kind == "alltoall" and alg == "inplace":
                # MPICH's in-place all-to-all (a machine file's `mpi:` table may name it)
                # receives each block into a temporary of the block's size
                # (Sendrecv_replace) and copies it back: a fresh one faults
                inst.copy_fault = self.share * fault_seconds_per_byte(
                    machine, inst.library, op.nbytes // len(members)
                )
            else:
                inst.fault = self.share * fault_seconds_per_byte(machine, inst.library, op.nbytes)
        elif (inst.op.kind, inst.op.count, inst.op.dtype) != (op.kind, op.count, op.dtype):
            raise PlanError(
                f"collective #{n} on group {op.group!r} does not match: {inst.op.kind} of "
                f"{inst.op.count} {inst.op.dtype} vs rank {r}'s {op.kind} of {op.count} {op.dtype}"
            )
        inst.posts[r] = t
        inst.then[r] = then
        if not op.req:
            self.blocking.append((r, inst))
        if self.detail == "steps" and not inst.folded:
            if op.req:  # after the rank has gone on to its next work (_steal sees it)
                i = members.index(r)
                self.at(t, lambda: self._steps(inst, r, i, 0, t, set()))
            else:
                self._steps(inst, r, members.index(r), 0, t, set())
        elif len(inst.posts) == inst.expected:
            self._phase(inst, 0, t)

    def _member_done(self, inst: Instance, r: int, end: float) -> None:
        if not inst.op.req and (self.detail != "steps" or inst.folded):  # ran coarse
            end = self._seen(inst.posts[r], end)  # steps: seen step by step
        inst.ends[r] = end
        inst.then.pop(r)(end)

    def _nodes(self, members) -> tuple[int, ...]:
        return tuple(self.topo.node(q) for q in members)

    def _shape(self, what: str, inst: Instance):
        """The algorithm's trace (steps) or phases (coarse) for this instance, cached."""
        from proxies.core.collectives import steps

        op, members = inst.op, inst.members
        key = (what, op.kind, inst.alg, members, op.count, itemsize(op.dtype), inst.library)
        shape = self._shapes.get(key)
        if shape is None:
            n, isz, nodes = len(members), itemsize(op.dtype), self._nodes(members)
            kind = "alltoall" if op.kind == "alltoallv" else op.kind
            if what == "trace":
                shape = steps.trace(kind, inst.alg, n, op.count, isz, nodes)
            else:
                alpha, lib = self.topo.alpha, inst.library
                shape = steps.coarse(
                    kind,
                    inst.alg,
                    n,
                    op.count,
                    isz,
                    lambda i, j: alpha(members[i], members[j], lib),
                    nodes,
                )
            self._shapes[key] = shape
        return shape

    def _steps(self, inst: Instance, r: int, i: int, pos: int, t: float, done: set):
        """Member i (world rank r) runs its steps of the algorithm from `pos` at time t."""
        program = self._shape("trace", inst)[i]
        members, isz = inst.members, itemsize(inst.op.dtype)
        tag = ("c", inst.key)
        resume = self._resumes.setdefault((inst.key, r), {})
        while pos < len(program):
            ev = program[pos]
            what = ev[0]
            if what == "send" or what == "recv":
                h, peer, elements = ev[1], members[ev[2]], ev[3]

                def arrived(end, msg, h=h, into=what == "recv"):
                    done.add(h)
                    if into and inst.op.req and self.topo.same_node(msg.src, msg.dst):
                        # within a node the receiver's core copies the bytes in, inside
                        # the MPI call that progresses the collective
                        self._steal(r, msg.moving, end - msg.moving, inst.op.category)
                    state = resume.get("wait")
                    if state is not None and state <= done:
                        del resume["wait"]
                        pos = resume.pop("pos")
                        # MPI takes the next step inside a test: a blocking collective's
                        # in its own wait; a non-blocking one's in whatever wait its rank
                        # is in (each of the wait's rounds tests every pending request),
                        # else at once (the progress thread, the tests between ops)
                        since = self.blocked.get(r) if inst.op.req else inst.posts[r]
                        if since is None:
                            self._steps(inst, r, i, pos, end, done)
                        else:
                            seen = self._test(r, since, end)
                            self.at(seen, lambda: self._steps(inst, r, i, pos, seen, done))

                src, dst = (r, peer) if what == "send" else (peer, r)
                nbytes = elements * isz
                if inst.reread != 1.0:  # a reused buffer's bytes cost reread x (reuse)
                    nbytes = round(nbytes * inst.reread)
                self._post(tag, src, dst, nbytes, what == "send", t, arrived, members, inst)
                pos += 1
            elif what == "wait":
                need = set(ev[1])
                if not need <= done:
                    resume["wait"], resume["pos"] = need, pos + 1
                    return
                pos += 1
            elif what == "reduce" or what == "copy":
                if what == "reduce":
                    per = inst.reread / self.reduce_bw + inst.fault
                else:
                    per = inst.reread * self.copy_s + inst.copy_fault
                d = ev[1] * isz * per
                pos += 1
                if inst.library:
                    self.local_until[r] = max(self.local_until[r], t + d)
                if inst.op.req:
                    self._steal(r, t, d, inst.op.category)
                if d > 0:
                    self.at(t + d, lambda p=pos, t2=t + d: self._steps(inst, r, i, p, t2, done))
                    return
            else:
                raise PlanError(f"unknown step {ev!r} in {inst.alg} {inst.op.kind}")
        self._resumes.pop((inst.key, r), None)
        self._member_done(inst, r, t)

    def _steal(self, r: int, t: float, d: float, category: str) -> None:
        """A non-blocking collective's local work [t, t + d] on rank r's core: the part of
        it inside the rank's own work delays that work (while the rank waits, MPI runs it
        on the idle core for free)."""
        over = min(t + d, self.busy[r]) - t
        if over > 0:
            self.debt[r][category] += over

    def _phase(self, inst: Instance, k: int, t: float) -> None:
        """Phase k of a coarse collective starts at t (every member has posted)."""
        phases = self._shape("coarse", inst)
        if k == len(phases):
            for q in list(inst.then):
                self._member_done(inst, q, t)
            return
        ph, members, topo = phases[k], inst.members, self.topo
        work = ph.reduce_bytes * (1 / self.reduce_bw + inst.fault)
        work += ph.copy_bytes * (self.copy_s + inst.copy_fault)
        tail = ph.latency + work
        flows = [(members[s], members[d], b) for s, d, b in ph.flows if b > 0]
        if inst.folded and flows:
            # Folded: a flow between two nodes holding no simulated rank is an image of one
            # that touches such a node (every node runs images of the simulated ranks, at
            # the same times, and those nodes carry everything else too): leave it out,
            # unless the phase has no other (a broadcast's later levels).
            rep_nodes = self.rep_nodes
            near = [
                f for f in flows if topo.node(f[0]) in rep_nodes or topo.node(f[1]) in rep_nodes
            ]
            flows = near or flows

        def tail_at(end: float) -> None:  # the phase's latency, then its local work
            if inst.op.req and work > 0:
                for q in inst.posts:
                    self._steal(q, end + ph.latency, work, inst.op.category)
            self.at(end + tail, lambda: self._phase(inst, k + 1, end + tail))

        if not flows:
            tail_at(t)
            return
        left = [len(flows)]

        def one_done(end: float, into: int | None = None) -> None:
            if into is not None:  # as in _steps: the receiver's core copies the bytes in
                self._steal(into, t, end - t, inst.op.category)
            left[0] -= 1
            if left[0] == 0:
                tail_at(end)

        def done_for(a: int, b: int):
            if inst.op.req and b in self.plans and topo.same_node(a, b):
                return lambda end: one_done(end, b)
            return one_done

        self.flows.start_many(
            [self._flow(a, b, n, done_for(a, b), members) for a, b, n in flows], t
        )
