"""The coarse form of every program: phases the predictor prices at scale.

A collective is a sequence of Phases run one after another. Within a phase all its flows
start together and share links (the predictor does the sharing); `flows` are the bytes
each (src, dst) pair of group ranks moves in the phase, summed over its messages, so
summed over the phases they are exactly the trace's bytes per pair (zero-byte messages
give zero-byte flows: their latency still counts).

`latency` and `reduce_bytes` come from two critical paths through the programs:

- latency: every message costs alpha(src, dst) and bandwidth is infinite. A message
  starts when both ends have posted it and completes at both ends alpha later (MPI's
  rendezvous: a send does not complete before its receive is posted); a wait ends when
  its requests have; adds are free. A phase's latency is how much that critical path
  (the latest rank's clock) grows during the phase, so the phases' latencies sum to it.
- reduce_bytes: the same with free messages and adds costing their bytes: the reduce work
  on the critical path, for the predictor to price at its reduce rate.
- copy_bytes: the same with only local copies costing their bytes (the all-to-alls'
  blocks out of scratch), for the predictor to price at the memory rate.

All three are computed per rank by closed-form recurrences over the algorithm's structure
(binomial trees, butterflies, rings), O(n) or O(n log n) per call (pairwise alltoall
O(n^2), as its flows are), and are exact: tests/collectives/test_steps.py replays every
trace event by event and compares, for uniform and two-level alphas. One bound: ring's
clocks within hier (every leader is given the slowest leader's finish plus the ring: exact
when the leaders' ring edges share one alpha, an upper bound otherwise). dbtree has no
closed form (see _dbtree): its programs are replayed. Results are cached on (kind, alg, n,
count, itemsize, alpha, nodes); pass the same alpha object to hit the cache.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from proxies.core.collectives import dbtree, hier
from proxies.core.collectives.common import bounds
from proxies.core.collectives.program import ADD, RECV, SEND, WAIT
from proxies.core.collectives.rhd import fold, rank_of, virtual_blocks

Alpha = Callable[[int, int], float]


@dataclass(frozen=True)
class Phase:
    flows: tuple[tuple[int, int, int], ...]  # (src, dst, bytes) summed over the phase
    latency: float  # seconds of per-message latency on the phase's critical path
    reduce_bytes: int  # bytes added on the critical path (priced at the reduce rate)
    # bytes copied locally on the critical path (an all-to-all's blocks into place, MPICH's
    # in-place pack into its temporary): the rank's core moves them, priced at the memory rate
    copy_bytes: int = 0


class _Clocks:
    """Per-rank clocks under one cost model: msg(src, dst) per message, red(elements) per
    add. `mark()` closes a phase: the flows posted since, and the latest clock."""

    def __init__(
        self,
        n: int,
        msg: Alpha,
        red: Callable[[int], float],
        itemsize: int,
        cp: Callable[[int], float] = lambda e: 0,
    ):
        self.t = [0] * n
        self.msg, self.red, self.isz, self.cp = msg, red, itemsize, cp
        self.flows: dict[tuple[int, int], int] = defaultdict(int)
        self.phases: list[tuple[dict, float]] = []

    def flow(self, src: int, dst: int, elements: int) -> None:
        self.flows[src, dst] += elements * self.isz

    def oneway(self, s: int, d: int, elements: int, add: bool) -> None:
        """s sends elements to d, both wait for it; d then adds them (add)."""
        t = self.t
        end = max(t[s], t[d]) + self.msg(s, d)
        t[s], t[d] = end, end + (self.red(elements) if add else 0)
        self.flow(s, d, elements)

    def exchange(self, a: int, b: int, ea: int, eb: int, add: bool) -> None:
        """a sends ea elements to b and b sends eb to a, each waits for both; then each
        adds what it received (add)."""
        t = self.t
        end = max(t[a], t[b]) + max(self.msg(a, b), self.msg(b, a))
        t[a] = end + (self.red(eb) if add else 0)
        t[b] = end + (self.red(ea) if add else 0)
        self.flow(a, b, ea)
        self.flow(b, a, eb)

    def copy(self, r: int, elements: int) -> None:
        """r copies elements locally (after what it waited for)."""
        self.t[r] += self.cp(elements)

    def mark(self) -> None:
        if self.flows:  # a phase that moved nothing (no fold when n = 2^k) is no phase
            self.phases.append((dict(self.flows), max(self.t)))
            self.flows.clear()


# -- building blocks, each advancing the clocks of the ranks it involves ------------------
def _tree_reduce(c: _Clocks, groups: Sequence[Sequence[int]], count: int) -> None:
    """tree.reduce_steps in every group at once: round mask, member i + mask sends to i (i
    a multiple of 2 mask). One phase per round: a round's messages wait for the last's."""
    mask, size = 1, max(len(g) for g in groups)
    while mask < size:
        for peers in groups:
            for i in range(0, len(peers) - mask, 2 * mask):
                c.oneway(peers[i + mask], peers[i], count, True)
        c.mark()
        mask <<= 1


def _tree_bcast(c: _Clocks, groups: Sequence[Sequence[int]], count: int) -> None:
    """tree.bcast_steps in every group at once: member i receives from i minus its lowest
    set bit, then posts all its sends at once and waits for them. A member's children all
    have one more set bit than it: one phase per number of set bits (a level)."""
    t = c.t
    got = [{0: t[peers[0]]} for peers in groups]  # when each member has the data
    depth = max(len(g) - 1 for g in groups).bit_length()
    for level in range(1, depth + 1):
        for peers, have in zip(groups, got, strict=True):
            for i in range(1, len(peers)):
                if i.bit_count() != level:
                    continue
                p = i & (i - 1)
                have[i] = max(have[p], t[peers[i]]) + c.msg(peers[p], peers[i])
                t[peers[p]] = max(t[peers[p]], have[i])  # the parent waits for this send
                t[peers[i]] = max(t[peers[i]], have[i])
                c.flow(peers[p], peers[i], count)
        c.mark()


def _ring(c: _Clocks, peers: Sequence[int], count: int, rs: bool, ag: bool) -> None:
    """ring.py's steps over `peers`. Every step waits for the slowest edge of the ring (a
    rank next to it pays it each step), and a partial sum that travels right with its
    block meets the largest block at every add, so from equal clocks the latest finishes
    at start + steps x max alpha + (m - 1) x red(largest block): exact. From unequal clocks
    every member gets the latest start plus that (exact when the edges share one alpha)."""
    m, t = len(peers), c.t
    off = bounds(count, m)
    steps = (m - 1) * (rs + ag)
    hop = max(c.msg(peers[i], peers[(i + 1) % m]) for i in range(m))
    end = max(t[p] for p in peers) + steps * hop + (c.red(off[1]) * (m - 1) if rs else 0)
    for i, p in enumerate(peers):
        t[p] = end
        # rank i sends every block but its own (reduce-scatter), every block but i + 1's
        # (allgather)
        sent = (count - (off[i + 1] - off[i]) if rs else 0) + (
            count - (off[(i + 1) % m + 1] - off[(i + 1) % m]) if ag else 0
        )
        c.flow(p, peers[(i + 1) % m], sent)


def _fold(c: _Clocks, n: int, size: Callable[[int], int], add: bool) -> None:
    """rhd.py's fold: even r < 2 rem send size(r) elements to r + 1."""
    for i in range(n - fold(n)[0]):
        c.oneway(2 * i, 2 * i + 1, size(2 * i), add)


def _unfold(c: _Clocks, n: int, size: Callable[[int], int]) -> None:
    for i in range(n - fold(n)[0]):
        c.oneway(2 * i + 1, 2 * i, size(2 * i), False)


def _halving(c: _Clocks, n: int, off: Sequence[int]) -> None:
    """Recursive halving over the p virtual ranks, `off` their p + 1 share boundaries.
    Before the step with `mask`, v's window is the 2 mask-aligned group of shares holding
    v; the partner with the bit clear keeps the lower half."""
    p, rem = fold(n)
    mask = p >> 1
    while mask:
        for v in range(p):
            w = v ^ mask
            if w < v:
                continue
            lo = v & ~(2 * mask - 1)
            mid, hi = lo + mask, lo + 2 * mask
            lower, upper = off[mid] - off[lo], off[hi] - off[mid]
            c.exchange(rank_of(v, rem), rank_of(w, rem), upper, lower, True)
        c.mark()  # a step waits for its partner: one phase per step
        mask >>= 1


def _doubling(c: _Clocks, n: int, off: Sequence[int], whole: bool) -> None:
    """Recursive doubling over the virtual ranks: windows of shares double (whole: every
    step exchanges and adds the whole buffer, rd's allreduce)."""
    p, rem = fold(n)
    mask = 1
    while mask < p:
        for v in range(p):
            w = v ^ mask
            if w < v:
                continue
            if whole:
                c.exchange(rank_of(v, rem), rank_of(w, rem), off[p], off[p], True)
            else:
                # v's window: the mask-aligned group of shares containing v
                a, b = v & ~(mask - 1), w & ~(mask - 1)
                c.exchange(
                    rank_of(v, rem),
                    rank_of(w, rem),
                    off[a + mask] - off[a],
                    off[b + mask] - off[b],
                    False,
                )
        c.mark()
        mask <<= 1


# -- the algorithms: clocks through their phases, one mark() per phase --------------------
def _naive(c: _Clocks, n: int, count: int, itemsize: int, nodes) -> None:
    # rank 0 receives the buffers one after the other: a phase each
    for k in range(1, n):
        c.oneway(k, 0, count, True)
        c.mark()
    # then posts every send at once and waits for them all
    t, done = c.t, c.t[0]
    for k in range(1, n):
        t[k] = max(t[0], t[k]) + c.msg(0, k)
        done = max(done, t[k])
        c.flow(0, k, count)
    t[0] = done
    c.mark()


def _tree(c: _Clocks, n: int, count: int, itemsize: int, nodes) -> None:
    _tree_reduce(c, [range(n)], count)
    _tree_bcast(c, [range(n)], count)


def _rhd(c: _Clocks, n: int, count: int, itemsize: int, nodes) -> None:
    off = bounds(count, fold(n)[0])
    _fold(c, n, lambda r: count, True)
    c.mark()
    _halving(c, n, off)
    c.mark()
    _doubling(c, n, off, False)
    c.mark()
    _unfold(c, n, lambda r: count)
    c.mark()


def _rd(c: _Clocks, n: int, count: int, itemsize: int, nodes) -> None:
    off = bounds(count, fold(n)[0])
    _fold(c, n, lambda r: count, True)
    c.mark()
    _doubling(c, n, off, True)
    c.mark()
    _unfold(c, n, lambda r: count)
    c.mark()


def _rh(c: _Clocks, n: int, count: int, itemsize: int, nodes) -> None:
    off = bounds(count, n)
    _fold(c, n, lambda r: count, True)
    c.mark()
    _halving(c, n, virtual_blocks(n, count))
    c.mark()
    _unfold(c, n, lambda r: off[r + 1] - off[r])
    c.mark()


def _rd_allgather(c: _Clocks, n: int, count: int, itemsize: int, nodes) -> None:
    off = bounds(count, n)
    _fold(c, n, lambda r: off[r + 1] - off[r], False)
    c.mark()
    _doubling(c, n, virtual_blocks(n, count), False)
    c.mark()
    _unfold(c, n, lambda r: count)
    c.mark()


def _ring_phase(rs: bool, ag: bool):
    def fn(c: _Clocks, n: int, count: int, itemsize: int, nodes) -> None:
        _ring(c, range(n), count, rs, ag)
        c.mark()

    return fn


def _hier(c: _Clocks, n: int, count: int, itemsize: int, nodes) -> None:
    members, leaders = hier.layout(nodes)
    _tree_reduce(c, members, count)
    if len(leaders) > 1:
        _ring(c, leaders, count, True, True)
        c.mark()
    _tree_bcast(c, members, count)


def _pairwise(c: _Clocks, n: int, count: int, itemsize: int, nodes) -> None:
    """n - 1 exchange steps, each rank's partners differing: O(n^2), as its flows are."""
    size = count // n
    for s in range(1, n):
        t = c.t[:]
        for r in range(n):
            dst, src = (r + s) % n, (r - s) % n
            c.t[r] = max(max(t[r], t[dst]) + c.msg(r, dst), max(t[src], t[r]) + c.msg(src, r))
            c.flow(r, dst, size)
    for r in range(n):  # the n - 1 received blocks out of scratch, into place
        c.copy(r, (n - 1) * size)
    c.mark()


def _inplace(c: _Clocks, n: int, count: int, itemsize: int, nodes) -> None:
    """MPICH's in-place order: pair (i, j) after each rank's earlier pairs. A phase per
    round of exchanges that can run together (round = 1 + the later of the two ranks'
    previous rounds): 2n - 3 rounds, the chain the global order makes."""
    size = count // n
    done = [0] * n
    rounds: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for i in range(n):
        for j in range(i + 1, n):
            k = done[i] = done[j] = max(done[i], done[j]) + 1
            rounds[k].append((i, j))
    for k in sorted(rounds):
        for i, j in rounds[k]:
            c.exchange(i, j, size, size, False)
            c.copy(i, size)  # the block through the temporary, on both ranks
            c.copy(j, size)
        c.mark()


def _bcast(c: _Clocks, n: int, count: int, itemsize: int, nodes) -> None:
    _tree_bcast(c, [range(n)], count)


def _reduce(c: _Clocks, n: int, count: int, itemsize: int, nodes) -> None:
    _tree_reduce(c, [range(n)], count)


def _dbtree(c: _Clocks, n: int, count: int, itemsize: int, nodes) -> None:
    """No closed form: each rank runs both trees in one loop, so its tree-0 chunk k waits
    behind its tree-1 chunk k - 1 and the trees gate each other chunk by chunk (the
    latency grows with K times the longest child-to-parent path through both trees, not
    K + height - 1). So the programs themselves are replayed, event by event: O(n K)
    events, exact, cached. Phase 1 (up both trees) ends at each rank's first broadcast
    post; phase 2 is the broadcast."""
    progs = [dbtree.allreduce(n, r, count, itemsize, dbtree.OVERHEAD_BYTES).ops for r in range(n)]
    cut = [
        next(
            (i for i, op in enumerate(ops) if op[0] <= RECV and op[3] >= dbtree.TAG_DOWN), len(ops)
        )
        for ops in progs
    ]
    flows: list[dict] = [defaultdict(int), defaultdict(int)]
    for r, ops in enumerate(progs):
        for i, op in enumerate(ops):
            if op[0] == SEND:
                flows[i >= cut[r]][r, op[2]] += (op[6] - op[5]) * itemsize
    first = _replay(c, progs, cut)
    c.phases += [(dict(flows[0]), first), (dict(flows[1]), max(c.t))]


def _replay(c: _Clocks, progs: Sequence[tuple], cut: Sequence[int]) -> float:
    """Run the programs' posts, waits and adds under c's cost model (messages matched per
    (src, dst, tag) in order, as MPI does); c.t ends at each rank's finish. Returns the
    latest clock at which a rank reached its op cut[r]."""
    n, t = len(progs), c.t
    pc, at_cut = [0] * n, [0.0] * n
    done: dict[tuple[int, int], float] = {}
    queues = (defaultdict(deque), defaultdict(deque))  # posted sends, posted receives
    moved = True
    while moved:
        moved = False
        for r in range(n):
            ops = progs[r]
            while pc[r] < len(ops):
                if pc[r] == cut[r]:
                    at_cut[r] = t[r]
                op = ops[pc[r]]
                code = op[0]
                if code == SEND or code == RECV:
                    h, peer, tag = op[1], op[2], op[3]
                    key = (r, peer, tag) if code == SEND else (peer, r, tag)
                    other = queues[code == SEND][key]
                    if other:
                        rank, oh, posted = other.popleft()
                        done[r, h] = done[rank, oh] = max(posted, t[r]) + c.msg(key[0], key[1])
                    else:
                        queues[code == RECV][key].append((r, h, t[r]))
                elif code == WAIT:
                    if any((r, h) not in done for h in op[1]):
                        break
                    t[r] = max(t[r], *(done[r, h] for h in op[1]))
                elif code == ADD:
                    t[r] += c.red(op[2] - op[1])
                pc[r] += 1
                moved = True
            if pc[r] == len(ops) == cut[r]:
                at_cut[r] = t[r]
    if any(pc[r] < len(progs[r]) for r in range(n)):
        raise RuntimeError("collective programs deadlock")  # the tests rule this out
    return max(at_cut)


ALGS: dict[tuple[str, str], Callable[..., None]] = {
    ("allreduce", "naive"): _naive,
    ("allreduce", "tree"): _tree,
    ("allreduce", "ring"): _ring_phase(True, True),
    ("allreduce", "rhd"): _rhd,
    ("allreduce", "rd"): _rd,
    ("allreduce", "dbtree"): _dbtree,
    ("allreduce", "hier"): _hier,
    ("reduce_scatter", "ring"): _ring_phase(True, False),
    ("reduce_scatter", "rh"): _rh,
    ("allgather", "ring"): _ring_phase(False, True),
    ("allgather", "rd"): _rd_allgather,
    ("alltoall", "pairwise"): _pairwise,
    ("alltoall", "inplace"): _inplace,
    ("bcast", "binomial"): _bcast,
    ("reduce", "binomial"): _reduce,
}


def coarse(
    kind: str,
    alg: str,
    n: int,
    count: int,
    itemsize: int,
    alpha: Alpha,
    nodes: Sequence[int] | None = None,
) -> tuple[Phase, ...]:
    """The phases of `alg` for collective `kind` over n ranks and `count` elements of
    `itemsize` bytes; alpha(src, dst): seconds per message between two group ranks;
    nodes (hier): the node of each group rank (default one node)."""
    if (kind, alg) not in ALGS:
        raise ValueError(f"no coarse form for {kind} {alg!r}")
    if kind == "alltoall" and count % n:
        raise ValueError(f"alltoall: {count} elements do not split into {n} equal blocks")
    nodes = tuple(nodes) if nodes else (0,) * n
    # dbtree's chunking (OVERHEAD_BYTES) is part of the cache key: tests change it
    return _coarse(kind, alg, n, count, itemsize, alpha, nodes, dbtree.OVERHEAD_BYTES)


@lru_cache(maxsize=1024)
def _coarse(kind, alg, n, count, itemsize, alpha, nodes, overhead) -> tuple[Phase, ...]:
    if n == 1 or count == 0:
        return ()
    runs = []
    free, zero, size = (lambda s, d: 0), (lambda e: 0), (lambda e: e * itemsize)
    # three critical paths: latency alone, reduce work alone, local copies alone
    for msg, red, cp in ((alpha, zero, zero), (free, size, zero), (free, zero, size)):
        c = _Clocks(n, msg, red, itemsize, cp)
        ALGS[kind, alg](c, n, count, itemsize, nodes)
        runs.append(c.phases)
    out, before = [], (0, 0, 0)
    for (flows, lat), (_, red), (_, cp) in zip(*runs, strict=True):
        pairs = tuple((s, d, b) for (s, d), b in flows.items())
        out.append(Phase(pairs, lat - before[0], red - before[1], cp - before[2]))
        before = (lat, red, cp)
    return tuple(out)
