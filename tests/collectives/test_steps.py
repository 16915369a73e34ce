"""proxies.core.collectives.steps without MPI: every (kind, alg)'s trace is consistent, and its
coarse phases carry exactly the trace's bytes, latency and reduce work.

The reference is a tiny event-driven replay of the trace (`schedule`, then `finish` for the
times): every rank runs its list in order; a message matches the next unmatched one of the
same (src, dst) pair, starts when both ends have posted it and completes at both ends
`msg(src, dst)` later; a wait ends when its requests have; a reduce of e elements costs
red(e). It fails on a size mismatch, a deadlock, a handle posted twice or never waited, or an
unmatched message.
"""

import math
from collections import defaultdict, deque

import pytest

from proxies.core.collectives import dbtree, steps

CASES = [(kind, alg) for kind in steps.KINDS for alg in steps.algorithms(kind)]
RANKS = range(1, 18)


def counts(kind, n):
    """0, 1, < n, odd, larger: for alltoall the same numbers of elements per block."""
    base = sorted({0, 1, max(n - 1, 0), n + 2, 3 * n + 5})
    return [c * n for c in base] if kind == "alltoall" else base


def schedule(tr):
    """Run the trace without clocks: (the events in the order they happened, elements per
    pair). Which op can go next depends only on which requests have completed, never on
    when, so one order serves every msg and red (`finish` puts times on it): check() replays
    each trace once, not once per alpha."""
    n = len(tr)
    pc = [0] * n
    done, posted, waited = set(), set(), set()
    queues = {"send": defaultdict(deque), "recv": defaultdict(deque)}
    elements = defaultdict(int)
    order = []

    def match(pair):
        sq, rq = queues["send"][pair], queues["recv"][pair]
        while sq and rq:
            (sr, sh, se), (rr, rh, re) = sq.popleft(), rq.popleft()
            assert se == re, f"{pair}: a send of {se} elements met a receive of {re}"
            done.update(((sr, sh), (rr, rh)))
            order.append(("match", (sr, sh), (rr, rh), pair))
            elements[pair] += se

    moved = True
    while moved:
        moved = False
        for r in range(n):
            while pc[r] < len(tr[r]):
                op = tr[r][pc[r]]
                if op[0] in ("send", "recv"):
                    _, h, peer, e = op
                    assert (r, h) not in posted and 0 <= peer < n and peer != r and e >= 0
                    posted.add((r, h))
                    order.append(("post", r, h))
                    pair = (r, peer) if op[0] == "send" else (peer, r)
                    queues[op[0]][pair].append((r, h, e))
                    match(pair)
                elif op[0] == "wait":
                    if not all((r, h) in done for h in op[1]):
                        break
                    assert all((r, h) in posted and (r, h) not in waited for h in op[1])
                    waited.update((r, h) for h in op[1])
                    order.append(("wait", r, op[1]))
                else:
                    assert op[0] in ("reduce", "copy") and op[1] >= 0
                    order.append((op[0], r, op[1]))
                pc[r] += 1
                moved = True
    stuck = [r for r in range(n) if pc[r] < len(tr[r])]
    assert not stuck, f"deadlock: ranks {stuck} wait forever"
    assert waited == posted, "a request is never waited for"
    return order, dict(elements)


def finish(order, n, msg=lambda s, d: 1.0, red=lambda e: 0, cp=lambda e: 0):
    """The latest rank's finishing time of a `schedule` order: a message starts when both
    ends have posted it and completes at both ends msg(src, dst) later; a wait ends when its
    requests have; a reduce of e elements costs red(e), a local copy of e elements cp(e)."""
    t = [0] * n
    at, done = {}, {}
    for ev in order:
        if ev[0] == "post":
            at[ev[1], ev[2]] = t[ev[1]]
        elif ev[0] == "match":
            _, a, b, pair = ev
            done[a] = done[b] = max(at[a], at[b]) + msg(*pair)
        elif ev[0] == "wait":
            r = ev[1]
            t[r] = max([t[r], *(done[r, h] for h in ev[2])])
        else:
            t[ev[1]] += (red if ev[0] == "reduce" else cp)(ev[2])
    return max(t, default=0)


def contiguous(n, size):
    return [i // size for i in range(n)]


def two_level(nodes, near=1.0, far=7.0):
    return lambda s, d: near if nodes[s] == nodes[d] else far


def uniform(s, d):
    return 3.0


def layouts(alg, n):
    """hier's node layouts: one node, nodes of 2 and 4, and one not contiguous."""
    if alg != "hier":
        return [None]
    return [None, contiguous(n, 2), contiguous(n, 4), [(i * 5) % 3 for i in range(n)]]


def check(kind, alg, n, count, itemsize, nodes=None):
    """(a) the trace replays, (b) bytes per pair, (c) latency for a uniform and two-level
    alphas, (d) reduce work, (e) local copies: coarse against the replayed trace."""
    what = f"{kind} {alg} n={n} count={count} itemsize={itemsize} nodes={nodes}"
    tr = steps.trace(kind, alg, n, count, itemsize, nodes)
    order, elements = schedule(tr)
    alphas = [uniform] + [two_level(contiguous(n, k)) for k in (2, 4)]
    if nodes is not None:
        alphas.append(two_level(nodes))
    for alpha in alphas:
        phases = steps.coarse(kind, alg, n, count, itemsize, alpha, nodes)
        flows = defaultdict(int)
        for ph in phases:
            assert ph.latency >= 0 and ph.reduce_bytes >= 0, what
            for s, d, b in ph.flows:
                flows[s, d] += b
        assert flows == {k: e * itemsize for k, e in elements.items()}, what
        latency = finish(order, n, alpha)
        assert sum(ph.latency for ph in phases) == pytest.approx(latency, abs=1e-9), what
    work = finish(order, n, lambda s, d: 0, lambda e: e * itemsize)
    assert sum(ph.reduce_bytes for ph in phases) == work, f"{what} reduce"
    copied = finish(order, n, lambda s, d: 0, cp=lambda e: e * itemsize)
    assert sum(ph.copy_bytes for ph in phases) == copied, f"{what} copy"


@pytest.mark.parametrize("kind,alg", CASES)
def test_trace_matches_coarse(kind, alg):
    """Every (kind, alg), n = 1..17, counts 0, 1, < n, odd; hier on several layouts."""
    for n in RANKS:
        for count in counts(kind, n):
            for nodes in layouts(alg, n):
                for itemsize in (4, 2):
                    check(kind, alg, n, count, itemsize, nodes)


def test_dbtree_pipelined(monkeypatch):
    """dbtree in many chunks per half (tiny OVERHEAD_BYTES): the chunks stream through both
    trees, and coarse (which replays the programs: no closed form) still agrees."""
    monkeypatch.setattr(dbtree, "OVERHEAD_BYTES", 4)
    for n in (2, 3, 4, 5, 8, 12, 17):
        for count in (n + 2, 101):
            step, chunks = dbtree.chunking(n, count, 4)
            assert n < 3 or len(chunks[0]) > 1
            check("allreduce", "dbtree", n, count, 4)


def per_rank(phases, n):
    """(bytes each rank sends, in total), latency, reduce bytes."""
    sent = [0] * n
    for ph in phases:
        for s, _, b in ph.flows:
            sent[s] += b
    return sent, sum(ph.latency for ph in phases), sum(ph.reduce_bytes for ph in phases)


def unit(s, d):
    return 1.0


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7, 8, 12, 16, 17])
def test_textbook_figures(n):
    """Thakur, Rabenseifner and Gropp (2005), one step = one alpha, count = 6 lcm(n, p) elements
    of 4 bytes (so blocks are equal); p the largest power of two <= n, fold = n is not one."""
    lg, p = (n - 1).bit_length(), 1 << (n.bit_length() - 1)
    count, B = 6 * math.lcm(n, p), 4
    whole = count * B
    fold = 2 if p < n else 0

    def coarse(kind, alg):
        return per_rank(steps.coarse(kind, alg, n, count, B, unit), n)

    # ring allreduce: 2(n-1)/n of the buffer per rank in 2(n-1) steps, (n-1)/n added
    assert coarse("allreduce", "ring") == (
        [2 * (n - 1) * whole // n] * n,
        2 * (n - 1),
        (n - 1) * whole // n,
    )
    # ring reduce-scatter and allgather: half of that each
    assert coarse("reduce_scatter", "ring") == (
        [(n - 1) * whole // n] * n,
        n - 1,
        (n - 1) * whole // n,
    )
    assert coarse("allgather", "ring") == ([(n - 1) * whole // n] * n, n - 1, 0)
    # rhd: 2 log2 p steps moving 2(p-1)/p of the buffer; + the whole buffer twice
    sent, lat, red = coarse("allreduce", "rhd")
    assert lat == 2 * (p.bit_length() - 1) + fold
    assert red == (p - 1) * whole // p + (whole if fold else 0)
    assert max(sent) == 2 * (p - 1) * whole // p + (whole if fold else 0)
    # recursive doubling: log2 p whole-buffer steps (+ fold and unfold)
    sent, lat, red = coarse("allreduce", "rd")
    assert lat == (p.bit_length() - 1) + fold and red == (p.bit_length() - 1 + (fold > 0)) * whole
    assert max(sent) == (p.bit_length() - 1) * whole + (whole if fold else 0)
    # pairwise alltoall: n - 1 steps, (n-1)/n of the buffer out of every rank
    assert coarse("alltoall", "pairwise") == ([(n - 1) * whole // n] * n, n - 1, 0)
    # binomial reduce: ceil(log2 n) rounds of the whole buffer, each one added at the root
    sent, lat, red = coarse("reduce", "binomial")
    assert (lat, red, sum(sent)) == (lg, lg * whole, (n - 1) * whole)
    # binomial bcast: every rank but the root receives once; the root sends in log2 n
    # rounds in the textbook, here all at once, so the latency is the tree's depth: the
    # most set bits of any rank, ceil(log2 n) when n is a power of two
    sent, lat, red = coarse("bcast", "binomial")
    assert lat == max(bin(r).count("1") for r in range(n)) and sum(sent) == (n - 1) * whole
    assert sent[0] == lg * whole and (p < n or lat == lg)
    # tree allreduce: the two
    assert coarse("allreduce", "tree")[1] == lg + max(bin(r).count("1") for r in range(n))
    if p == n:  # power of two: recursive halving / doubling of the blocks
        assert coarse("reduce_scatter", "rh") == (
            [(n - 1) * whole // n] * n,
            lg,
            (n - 1) * whole // n,
        )
        assert coarse("allgather", "rd") == ([(n - 1) * whole // n] * n, lg, 0)


def test_ring_and_hier_latency_is_the_slowest_edge():
    """Ring pays its slowest edge every step; hier's ring runs across nodes only."""
    n, nodes = 8, contiguous(8, 4)
    alpha = two_level(nodes, 1.0, 10.0)
    ring = steps.coarse("allreduce", "ring", n, 800, 4, alpha)
    assert len(ring) == 1 and ring[0].latency == 2 * (n - 1) * 10.0
    h = steps.coarse("allreduce", "hier", n, 800, 4, alpha, nodes)
    # node tree (a phase per round), 2 leaders' ring, node tree (a phase per level)
    assert [ph.latency for ph in h] == [1.0, 1.0, 2 * 10.0, 1.0, 1.0]
    assert {(s, d) for s, d, _ in h[2].flows} == {(0, 4), (4, 0)}


def test_bad_input():
    with pytest.raises(ValueError, match="unknown collective kind 'scan'"):
        steps.algorithms("scan")
    with pytest.raises(ValueError, match="unknown allreduce algorithm 'fast'"):
        steps.trace("allreduce", "fast", 4, 8)
    with pytest.raises(ValueError, match="do not split into 4 equal blocks"):
        steps.trace("alltoall", "pairwise", 4, 6)
    with pytest.raises(ValueError, match="do not split into 4 equal blocks"):
        steps.coarse("alltoall", "pairwise", 4, 6, 4, unit)
    with pytest.raises(ValueError, match="2 node labels for a group of 4"):
        steps.trace("allreduce", "hier", 4, 8, nodes=[0, 1])
    with pytest.raises(ValueError, match="no coarse form"):
        steps.coarse("allreduce", "mpi", 4, 8, 4, unit)


def test_coarse_at_scale_is_cheap():
    """4096 ranks: ring, rhd, hier answer without per-step loops over the ring."""
    nodes = contiguous(4096, 8)
    alpha = two_level(nodes)
    ring = steps.coarse("allreduce", "ring", 4096, 1 << 24, 4, alpha)
    assert ring[0].latency == 2 * 4095 * 7.0 and len(ring[0].flows) == 4096
    hier = steps.coarse("allreduce", "hier", 4096, 1 << 24, 4, alpha, nodes)
    assert [round(ph.latency) for ph in hier] == [1, 1, 1, 2 * 511 * 7, 1, 1, 1]
    rhd = steps.coarse("allreduce", "rhd", 4096, 1 << 24, 4, uniform)
    assert sum(ph.latency for ph in rhd) == 2 * 12 * 3.0
