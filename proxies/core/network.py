"""The network of a machine model: links, paths, and max-min fair sharing of flows.

Links (each one direction, each with a capacity in bytes/s):
- every rank's port into the node's fabric, out and in (intra_node.bandwidth): shared by
  that rank's flows to and from the other ranks of its node;
- optionally the node's fabric as a whole (intra_node.node_bandwidth): on a CPU node the
  cores copy every intra-node message, so all of them together go no faster than that;
- every node's network interface, out and in (inter_node.nic_bandwidth): shared by all the
  node's flows to other nodes;
- with a switch level, every leaf switch's uplink and downlink
  (nodes_per_switch x nic_bandwidth / oversubscription): shared by the flows that leave or
  enter the switch's nodes for nodes under another switch.
A flow between two ranks of one node crosses the sender's port out and the receiver's port
in; between nodes, the sender node's interface out, the uplinks/downlinks if the nodes sit
under different switches, and the receiver node's interface in. One flow also never goes
faster than its level's link bandwidth (a private cap), and costs the level's latency once.

Where a run places more ranks on a node than it has cores and the machine file has an
`oversubscribed` section, that section's latency, bandwidth and node_bandwidth replace
intra_node's (a message waits for its peer to be scheduled; copies share the cores), and a
message between nodes costs at least that latency; otherwise nothing changes. Such a run's
waits yield (`yielding`: they test, sleep, test again; waiting.yield_sees is when they see
what they wait for), unless it was told --wait spin.

Flows share links max-min fairly (progressive filling, as flow-level network simulators
do): the most contended link fixes the rate of its flows, its capacity is removed from
their other links, and so on. A flow may stand for `weight` identical flows (the images of
a rank that the simulation runs once, see predict.py): it takes `weight` shares of each
shared link it crosses, each image getting the rate computed.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from proxies.core.machine import OVERHEAD_KINDS

# Link ids: small tuples, hashable and readable in a diagnosis.
PORT_OUT, PORT_IN, NIC_OUT, NIC_IN, UP, DOWN = (
    "port_out",
    "port_in",
    "nic_out",
    "nic_in",
    "up",
    "down",
)
BUS = "bus"  # a node's intra-node fabric as a whole (intra_node.node_bandwidth)


class Topology:
    """Which links a flow between two world ranks crosses, and what they can carry."""

    def __init__(self, machine, ranks_per_node: int | None = None, wait: str = "auto") -> None:
        self.machine = machine
        self.rpn = ranks_per_node or machine.ranks_per_node
        self.switch_nodes = machine.switch_nodes
        # ranks outnumber cores: the oversubscribed figures, where the file has them
        self.crowded = machine.oversub is not None and self.rpn > machine.cores_per_node
        # the run's waits test and sleep (--wait; auto: where ranks outnumber cores), and
        # each sleep lasts engine.wake longer than asked (oversubscribed.wake on a crowded
        # node: the woken rank also waits for a core)
        self.yielding = wait == "yield" or (wait == "auto" and self.rpn > machine.cores_per_node)
        wake = machine.oversub_wake if self.crowded else None
        self.wake = (machine.wake if wake is None else wake) if self.yielding else 0.0
        self.intra = machine.oversub if self.crowded else machine.intra
        self._cap = {
            PORT_OUT: self.intra.bandwidth,
            PORT_IN: self.intra.bandwidth,
        }
        self.bus = machine.node_bandwidth
        if self.crowded and machine.oversub_node_bandwidth:
            self.bus = machine.oversub_node_bandwidth
        if self.bus:
            self._cap[BUS] = self.bus
        if machine.inter is not None:
            nic = machine.nic_bandwidth or machine.inter.bandwidth
            self._cap[NIC_OUT] = self._cap[NIC_IN] = nic
            if machine.switch_nodes:
                uplink = machine.switch_nodes * nic / machine.oversubscription
                self._cap[UP] = self._cap[DOWN] = uplink

    def op_overheads(self) -> dict[str, float]:
        """The engine's own seconds per op of each kind (machine.OVERHEAD_KINDS; Python,
        mpi4py, polling): the file's `engine.<kind>`, else engine.op_overhead; a crowded
        node's oversubscribed.op_overhead for all."""
        m = self.machine
        if self.crowded and m.oversub_op_overhead is not None:
            return dict.fromkeys(OVERHEAD_KINDS, m.oversub_op_overhead)
        return {kind: m.op_overheads.get(kind, m.op_overhead) for kind in OVERHEAD_KINDS}

    def node(self, rank: int) -> int:
        return rank // self.rpn

    def same_node(self, a: int, b: int) -> bool:
        return a // self.rpn == b // self.rpn

    def capacity(self, link: tuple) -> float:
        return self._cap[link[0]]

    def alpha(self, a: int, b: int, library: bool = False) -> float:
        """Latency of one message from world rank a to b (library: a step of a collective
        the MPI library runs, oversubscribed.mpi_latency on a crowded node where given)."""
        if self.same_node(a, b):
            if library and self.crowded and self.machine.oversub_mpi_latency is not None:
                return self.machine.oversub_mpi_latency
            return self.intra.latency
        if self.crowded:
            return max(self._inter().latency, self.intra.latency)
        return self._inter().latency

    def cap(self, a: int, b: int) -> float:
        """The most one flow from a to b can reach (its level's link bandwidth)."""
        if self.same_node(a, b):
            return self.intra.bandwidth
        return self._inter().bandwidth

    def _inter(self):
        if self.machine.inter is None:
            raise ValueError(
                f"machine {self.machine.name!r} has no inter_node level, but the run places "
                f"ranks on more than one node ({self.rpn} ranks per node)"
            )
        return self.machine.inter

    def links(self, a: int, b: int) -> tuple[tuple, ...]:
        """The shared links a flow from rank a to rank b crosses."""
        na, nb = a // self.rpn, b // self.rpn
        if na == nb:
            if self.bus:
                return ((PORT_OUT, a), (BUS, na), (PORT_IN, b))
            return ((PORT_OUT, a), (PORT_IN, b))
        self._inter()
        s = self.switch_nodes
        if s and na // s != nb // s:
            return ((NIC_OUT, na), (UP, na // s), (DOWN, nb // s), (NIC_IN, nb))
        return ((NIC_OUT, na), (NIC_IN, nb))


@dataclass(eq=False)
class Flow:
    """Bytes moving over links; `done(time)` is called when the last byte arrives."""

    links: tuple[tuple, ...]
    nbytes: float
    cap: float  # bytes/s: the flow's own limit (its level's link)
    done: Callable[[float], None]
    weight: dict[tuple, float] = field(default_factory=dict)  # link -> images sharing it
    remaining: float = 0.0  # bytes left at time `since`
    since: float = 0.0
    rate: float = 0.0
    version: int = 0


class Flows:
    """Active flows, their fair-share rates, and when the next one finishes.

    Rates change only when a flow starts or ends; only the flows connected to it through
    shared links are recomputed (a ring's flows on disjoint links never are together).
    """

    def __init__(self, capacity: Callable[[tuple], float]) -> None:
        self.capacity = capacity
        self.on_link: dict[tuple, set[Flow]] = {}
        self.now = 0.0
        self.heap: list[tuple[float, int, int, Flow]] = []  # (finish, version, seq, flow)
        self.seq = 0
        self.count = 0  # flows ever started (statistics)
        self.active: set[Flow] = set()

    def start(self, flow: Flow, t: float) -> None:
        """Flow starts at t (t never goes back: the caller runs events in time order)."""
        self.start_many([flow], t)

    def start_many(self, flows: list[Flow], t: float) -> None:
        """Flows that start together (a collective phase): one rebalance for all."""
        self.now = t
        links = set()
        for flow in flows:
            flow.remaining, flow.since = float(flow.nbytes), t
            self.count += 1
            self.active.add(flow)
            for link in flow.links:
                self.on_link.setdefault(link, set()).add(flow)
                links.add(link)
        self._rebalance(links)

    def next_time(self) -> float:
        while self.heap:
            t, version, _, f = self.heap[0]
            if f.version == version and f in self.active:
                return t
            heapq.heappop(self.heap)
        return math.inf

    def pop_done(self) -> None:
        """Finish every flow due at next_time() (symmetric flows end together): one
        rebalance, then their callbacks in the order they were due."""
        t = self.next_time()
        done, links = [], set()
        while self.heap and self.next_time() <= t * (1 + 1e-12):
            _, _, _, f = heapq.heappop(self.heap)
            self.active.discard(f)
            done.append(f)
            for link in f.links:
                flows = self.on_link[link]
                flows.discard(f)
                if not flows:
                    del self.on_link[link]
                links.add(link)
        self.now = t
        self._rebalance(links)
        for f in done:
            f.done(t)

    def _component(self, links) -> set[Flow]:
        """Flows reachable from `links` through shared links."""
        flows: set[Flow] = set()
        seen = set()
        todo = [lk for lk in links if lk in self.on_link]
        while todo:
            link = todo.pop()
            if link in seen:
                continue
            seen.add(link)
            for f in self.on_link[link]:
                if f not in flows:
                    flows.add(f)
                    todo.extend(lk for lk in f.links if lk not in seen)
        return flows

    def _rebalance(self, links) -> None:
        flows = self._component(links)
        if not flows:
            return
        rates = fair_share(flows, self.capacity)
        now = self.now
        for f in flows:
            r = rates[f]
            if r != f.rate or f.version == 0:
                # progress is kept lazily: bytes left as of `since`, at the old rate
                f.remaining -= f.rate * (now - f.since)
                f.since = now
                f.rate = r
                f.version += 1
                self.seq += 1
                finish = now + (f.remaining / r if f.remaining > 0 else 0.0)
                heapq.heappush(self.heap, (finish, f.version, self.seq, f))


def fair_share(flows, capacity) -> dict[Flow, float]:
    """Max-min fair rates by progressive filling; a flow of weight w on a link takes w
    shares there (w identical flows), and never exceeds its own cap.

    The tightest constraint is taken from a heap of link shares (entries refreshed lazily
    as flows are fixed) and the flows sorted by cap: O((links + flows x path) log links)."""
    load: dict = defaultdict(float)
    users: dict = defaultdict(list)
    for f in flows:
        for lk in f.links:
            load[lk] += f.weight.get(lk, 1.0)
            users[lk].append(f)
    left = {lk: capacity(lk) for lk in load}
    heap = [(left[lk] / n, i, lk) for i, (lk, n) in enumerate(load.items()) if n > 0]
    heapq.heapify(heap)
    by_cap = sorted(flows, key=lambda f: f.cap)
    ci, seq = 0, len(heap)
    rates: dict[Flow, float] = {}

    def fix(f: Flow, r: float) -> None:
        nonlocal seq
        rates[f] = r
        for lk in f.links:
            w = f.weight.get(lk, 1.0)
            left[lk] = max(0.0, left[lk] - w * r)
            load[lk] -= w
            if load[lk] > 1e-12:
                seq += 1
                heapq.heappush(heap, (left[lk] / load[lk], seq, lk))

    while len(rates) < len(flows):
        while ci < len(by_cap) and by_cap[ci] in rates:
            ci += 1
        # the tightest link, skipping entries made stale by fixed flows
        while heap:
            share, _, lk = heap[0]
            if load[lk] > 1e-12 and abs(share - left[lk] / load[lk]) <= 1e-12 * max(share, 1e-30):
                break
            heapq.heappop(heap)
        best = heap[0][0] if heap else math.inf
        if ci < len(by_cap) and by_cap[ci].cap <= best:
            fix(by_cap[ci], by_cap[ci].cap)
            continue
        _, _, lk = heapq.heappop(heap)
        share = max(left[lk] / load[lk], 0.0)
        for f in users[lk]:
            if f not in rates:
                fix(f, share)
    return rates
