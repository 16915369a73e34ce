"""The network model: paths, max-min fair sharing, flows in time (pure, no MPI)."""

from __future__ import annotations

import math

import pytest

from proxies.core.machine import Level, Machine
from proxies.core.mpi_choice import chooser
from proxies.core.network import Flow, Flows, Topology, fair_share
from proxies.core.plan import P2P, Compute, Msg, Plan, Wait
from proxies.core.predict import predict

GBIT = 1e9 / 8  # bytes/s in one Gb/s


def machine(rpn=1, nic=10 * GBIT, link=10 * GBIT, intra=10e9, lat=0.0, switch=None, over=1.0):
    return Machine(
        name="test",
        source="",
        ranks_per_node=rpn,
        cores_per_node=64,
        intra=Level(latency=lat, bandwidth=intra),
        inter=Level(latency=lat, bandwidth=link),
        nic_bandwidth=nic,
        switch_nodes=switch,
        oversubscription=over,
        matmul_flops=None,
        memory_bandwidth=None,
        device_flops=None,
        reduce_bandwidth=1e12,
        mpi={},
        unmeasured=(),
        calibration={},
    )


def test_paths_by_level():
    topo = Topology(machine(rpn=4, switch=2))
    assert topo.links(0, 3) == (("port_out", 0), ("port_in", 3))
    assert topo.links(0, 4) == (("nic_out", 0), ("nic_in", 1))  # same leaf switch
    assert topo.links(0, 8) == (("nic_out", 0), ("up", 0), ("down", 1), ("nic_in", 2))
    assert topo.capacity(("up", 0)) == 2 * 10 * GBIT


def _flow(links, cap=math.inf, weight=None):
    return Flow(tuple(links), 1.0, cap, lambda t: None, weight or {})


def test_max_min_fair_share():
    # a: links 1+2, b: link 1, c: link 2 (capacity 1 each): everyone gets 1/2
    a, b, c = _flow("12"), _flow("1"), _flow("2")
    rates = fair_share({a, b, c}, lambda lk: 1.0)
    assert rates == {a: 0.5, b: 0.5, c: 0.5}
    # link 2 twice as big: a still bottlenecked at 1/2 on link 1, c takes the rest of 2
    rates = fair_share({a, b, c}, lambda lk: {"1": 1.0, "2": 2.0}[lk])
    assert rates[a] == rates[b] == 0.5 and rates[c] == 1.5
    # a flow capped below its share leaves the rest to the others
    a = _flow("1", cap=0.2)
    rates = fair_share({a, b}, lambda lk: 1.0)
    assert rates[a] == 0.2 and rates[b] == pytest.approx(0.8)
    # a flow standing for 3 images takes 3 shares
    a = _flow("1", weight={"1": 3.0})
    rates = fair_share({a, b}, lambda lk: 1.0)
    assert rates[a] == rates[b] == 0.25


def test_flows_finish_in_time_order():
    ends = {}
    flows = Flows(lambda lk: 1.0)
    for name, nbytes, start in (("long", 3.0, 0.0), ("short", 1.0, 0.0)):
        f = Flow((("L",),), nbytes, math.inf, lambda t, n=name: ends.setdefault(n, t))
        flows.start(f, start)
    while flows.next_time() < math.inf:
        flows.pop_done()
    # both at 1/2 until short ends at 2 (1 byte), then long alone: 3 - 1 = 2 left at 1/s
    assert ends == {"short": 2.0, "long": 4.0}


def _gather(senders: int, nbytes: int) -> list[Plan]:
    """Rank 0 receives nbytes from each other rank in one batch (all at once)."""
    count = nbytes // 4
    recvs = tuple(Msg(q, 0, "x", 0, count) for q in range(1, senders + 1))
    plans = [Plan(0, (P2P("gather", recvs=recvs),))]
    for q in range(1, senders + 1):
        plans.append(Plan(q, (P2P("send", sends=(Msg(0, 0, "x", 0, count),)),)))
    return plans


def _predict(plans, m):
    return predict(plans, Topology(m), lambda r, op: op.seconds, lambda k, n: "ring")


def test_incast_shares_the_receivers_interface():
    """4 nodes each send 1 Gb into one node's 10 Gb/s interface: 0.4 s, not 0.1 s."""
    p = _predict(_gather(4, 125_000_000), machine())
    assert p.time == pytest.approx(0.4)
    assert p.breakdown[1]["pp"] == pytest.approx(0.4)
    # the same within one node: each sender's own port, the receiver's port shared
    p = _predict(_gather(4, 125_000_000), machine(rpn=8, intra=10 * GBIT))
    assert p.time == pytest.approx(0.4)


def test_prediction_falls_as_bandwidth_rises():
    times = [
        _predict(_gather(3, 10_000_000), machine(nic=b * GBIT, link=b * GBIT)).time
        for b in (1, 10, 100)
    ]
    assert times[0] > times[1] > times[2]


def test_breakdown_adds_up_with_compute_and_waiting():
    """Rank 1 computes 1 s before sending: rank 0 is idle until the message exists (1 s and
    its latency: the engine's probe returns then), then both move the bytes; the sender,
    which receives nothing, books no idle (the engine's Isend and Wait are its category)."""
    count = 1_250_000 // 4  # 10 ms at 1 Gb/s
    plans = [
        Plan(0, (P2P("recv", recvs=(Msg(1, 0, "x", 0, count),)),)),
        Plan(1, (Compute("forward", seconds=1.0), P2P("send", sends=(Msg(0, 0, "x", 0, count),)))),
    ]
    p = _predict(plans, machine(nic=GBIT, link=GBIT, lat=1e-5))
    assert p.time == pytest.approx(1.0 + 1e-5 + 0.01)
    for r in (0, 1):
        assert sum(p.breakdown[r].values()) == pytest.approx(p.time)
    assert p.breakdown[0]["idle"] == pytest.approx(1.0 + 1e-5)
    assert p.breakdown[0]["pp"] == pytest.approx(0.01)
    assert p.breakdown[1]["compute"] == 1.0 and p.breakdown[1].get("idle", 0.0) == 0.0


def test_a_message_behind_its_pairs_earlier_one_is_waited_for_as_idle():
    """A small exchange posted right after a large non-blocking send on the same pair: the
    engine's probe for the small message returns only once it exists, after the large one
    moved (its latency and 1 ms), so the receiver books that wait idle and the transfer
    (microseconds) to the exchange; the other side waits only for its message's latency, and
    its category holds its own small send, which left behind the large one."""
    big, lat = 1_000_000, 1e-5  # 1 ms at 1 GB/s

    def side(me, peer):
        big_op = (P2P("big", sends=(Msg(peer, 0, "a", 0, big // 4),), req="q") if me == 0
                  else P2P("big", recvs=(Msg(peer, 0, "a", 0, big // 4),), req="q"))  # fmt: skip
        small = P2P("small", sends=(Msg(peer, 1 + me, "s", 0, 1),),
                    recvs=(Msg(peer, 2 - me, "r", 0, 1),), category="halo")  # fmt: skip
        return Plan(me, (big_op, small, Wait("q")))

    p = _predict([side(0, 1), side(1, 0)], machine(rpn=2, intra=1e9, lat=lat))
    b0, b1 = p.breakdown[0], p.breakdown[1]
    assert b1["idle"] == pytest.approx(lat + 1e-3, rel=1e-3)  # behind the big message
    assert b1["halo"] == pytest.approx(4 / 1e9, rel=1e-3)  # its own 4 bytes
    assert b0["idle"] == pytest.approx(lat)  # rank 1's message: nothing before it
    assert b0["halo"] == pytest.approx(1e-3 + 4 / 1e9 - 0.0, rel=1e-3)  # its send, behind
    for r in (0, 1):
        assert sum(v for k, v in p.breakdown[r].items() if not k.endswith("_hidden")) == (
            pytest.approx(p.time)
        )


# -- one pair's messages move in order -----------------------------------------------------------


def _behind(big_peer: int):
    """Rank 0 posts a non-blocking 8 MB send to rank big_peer, then an 8 kB one to rank 1;
    ranks 1 and 2 post non-blocking receives for what is meant for them at once. Returns
    when each message arrived."""
    big, small = 2_000_000, 2_000  # float32 elements: 8 MB and 8 kB
    groups = {}
    plans = [
        Plan(
            0,
            (
                P2P("big", sends=(Msg(big_peer, 1, "x", 0, big),), req="b"),
                P2P("small", sends=(Msg(1, 2, "x", 0, small),), req="s"),
                Wait("b"),
                Wait("s"),
            ),
            groups,
        )
    ]
    for q in (1, 2):
        posts, waits = [], []
        if q == big_peer:
            posts.append(P2P("big", recvs=(Msg(0, 1, "x", 0, big),), req="b"))
            waits.append(Wait("b"))
        if q == 1:
            posts.append(P2P("small", recvs=(Msg(0, 2, "x", 0, small),), req="s"))
            waits.append(Wait("s"))
        plans.append(Plan(q, (*posts, *waits), groups))
    m = machine(rpn=4, intra=10e9, lat=1e-6)
    pred = predict(plans, Topology(m), lambda r, op: 0.0, chooser(m), keep_spans=True)
    return {op.name: end for q in (1, 2) for _, end, op, idle in pred.spans[q] if idle is None}


def test_a_small_message_behind_a_large_one_to_the_same_rank_waits_for_it():
    # MPI carries one pair's messages in order (one shared-memory queue or connection): the
    # small send posted after the large one arrives after it, not beside it at a fair share
    ends = _behind(big_peer=1)
    big_done = 1e-6 + 8e6 / 10e9
    assert math.isclose(ends["big"], big_done, rel_tol=1e-9)
    assert math.isclose(ends["small"], big_done + 8e3 / 10e9, rel_tol=1e-9)


def test_messages_to_different_ranks_do_not_queue():
    # the large one goes to rank 2: rank 1's moves at once, beside it (sharing rank 0's port)
    ends = _behind(big_peer=2)
    assert math.isclose(ends["small"], 1e-6 + 8e3 / 5e9, rel_tol=1e-9)


def test_nothing_moves_while_mpi_adds_for_a_collective_on_either_rank():
    # 2 ranks post MPI's allreduce of 8 MB (ring: 4 MB each way, the add, 4 MB each way),
    # then swap 8 kB at once: the swap queues behind the first 4 MB, then waits for the
    # add, which MPI's progress runs on both ranks (measured: a 512 KiB halo after a 14 MiB
    # allreduce on 2 ranks, 1.33 - 1.47 ms, alone 0.05)
    from dataclasses import replace

    from proxies.core.plan import Collective

    m = replace(machine(rpn=2, intra=10e9, lat=1e-6), reduce_bandwidth=4e9)
    pick = chooser(m, "ring")
    pick.library = lambda kind: True  # MPI runs it (its progress does the add)
    ar = Collective("allreduce", "w", "g", 2_000_000, "float32", req="a")
    swap = lambda r: P2P(  # noqa: E731
        "halo", sends=(Msg(1 - r, 1, "x", 0, 2_000),), recvs=(Msg(1 - r, 1, "y", 0, 2_000),)
    )
    gap = Compute("gap", seconds=1e-6)  # the allreduce's first step is on the wires first
    plans = [Plan(r, (ar, gap, swap(r), Wait("a")), {"w": (0, 1)}) for r in (0, 1)]
    pred = predict(plans, Topology(m), lambda r, o: o.seconds, pick, keep_spans=True)
    halo = [end for _, end, op, _ in pred.spans[0] if isinstance(op, P2P)][0]
    step, add = 1e-6 + 4e6 / 10e9, 4e6 / 4e9
    assert math.isclose(halo, step + add + 8e3 / 10e9, rel_tol=1e-9)
    # then the allreduce's second step, posted after the add (its latency covers the swap)
    assert math.isclose(pred.time, step + add + 1e-6 + 4e6 / 10e9, rel_tol=1e-9)
