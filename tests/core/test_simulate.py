"""The plan simulator: matching, collectives, non-blocking waits, deadlock diagnosis, timing."""

import re

import pytest

from proxies.core.pipeline import pipeline_ops
from proxies.core.plan import P2P, Collective, Compute, Msg, Plan, Wait
from proxies.core.schedules import SCHEDULES
from proxies.core.simulate import PlanError, simulate


def pipeline_plans(name, pp, m, v=1):
    acts = SCHEDULES[name]
    return [Plan(s, tuple(pipeline_ops(acts(pp, m, s, v), s, range(pp), v, 16))) for s in range(pp)]


def unfused(plan):
    """The same plan with each send and each receive a batch of its own (sends first)."""
    ops = []
    for op in plan.ops:
        if isinstance(op, P2P):
            ops += [P2P("send", sends=(m,)) for m in op.sends]
            ops += [P2P("recv", recvs=(m,)) for m in op.recvs]
        else:
            ops.append(op)
    return Plan(plan.rank, tuple(ops), plan.groups)


def fwd_bwd(rank, op):
    return {"forward": 1.0, "backward": 2.0}.get(getattr(op, "name", ""), 0.0)


def send(peer, tag=1, count=4, dtype="float32"):
    return P2P("send", sends=(Msg(peer, tag, "x", 0, count, dtype),))


def recv(peer, tag=1, count=4, dtype="float32"):
    return P2P("recv", recvs=(Msg(peer, tag, "x", 0, count, dtype),))


# --- point-to-point -------------------------------------------------------------------------


def test_messages_complete_when_both_sides_are_posted():
    plans = [
        Plan(0, (Compute("forward", 0), send(1))),
        Plan(1, (recv(0), Compute("backward", 0))),
    ]
    sim = simulate(plans, fwd_bwd)
    assert sim.finish == {0: 1.0, 1: 3.0}
    assert [(a, b) for a, b, _ in sim.spans[1]] == [(0.0, 1.0), (1.0, 3.0)]
    assert sim.idle == {0: 2.0, 1: 1.0}


def test_p2p_cost_is_added_after_the_last_match():
    plans = [Plan(0, (send(1),)), Plan(1, (Compute("forward", 0), recv(0)))]
    sim = simulate(plans, lambda r, op: 1.0 if isinstance(op, Compute) else 0.5)
    assert sim.finish == {0: 1.5, 1: 1.5}


def test_messages_pair_fifo_per_channel():
    plans = [
        Plan(0, (send(1, tag=7, count=1), send(1, tag=7, count=2))),
        Plan(1, (recv(0, tag=7, count=1), recv(0, tag=7, count=2))),
    ]
    simulate(plans)
    swapped = [plans[0], Plan(1, (recv(0, tag=7, count=2), recv(0, tag=7, count=1)))]
    with pytest.raises(PlanError, match="mismatch"):
        simulate(swapped)


def test_count_and_dtype_mismatch_are_reported():
    plans = [Plan(0, (send(1, count=4),)), Plan(1, (recv(0, count=5),))]
    with pytest.raises(PlanError) as info:
        simulate(plans)
    text = str(info.value)
    assert "rank 0 -> rank 1 tag 1" in text
    assert "sends 4 float32" in text and "receives 5 float32" in text
    with pytest.raises(PlanError, match="float16"):
        simulate([Plan(0, (send(1),)), Plan(1, (recv(0, dtype="float16"),))])


def test_count_mismatch_in_a_pipeline_is_reported():
    plans = pipeline_plans("1f1b", 4, 8)
    ops = list(plans[2].ops)
    first = ops[0]  # recv_forward of micro-batch 0 from stage 1
    ops[0] = P2P(first.name, recvs=(Msg(1, first.recvs[0].tag, "act_in", 0, 99),))
    plans[2] = Plan(2, tuple(ops))
    with pytest.raises(PlanError, match=r"rank 1 -> rank 2 .* sends 16 float32.* receives 99"):
        simulate(plans)


def test_peer_without_a_plan():
    with pytest.raises(PlanError, match="rank 5, which has no plan"):
        simulate([Plan(0, (send(5),))])


# --- deadlocks ------------------------------------------------------------------------------


def test_unfused_1f1b_deadlocks_and_names_the_blocked_ranks():
    for pp in range(2, 7):
        for m in range(pp, pp + 4):
            plans = [unfused(p) for p in pipeline_plans("1f1b", pp, m)]
            with pytest.raises(PlanError, match="deadlock") as info:
                simulate(plans)
            text = str(info.value)
            blocked = re.findall(r"^  rank (\d+) at op \d+ (send|recv): ", text, re.M)
            assert len(blocked) >= 2, text
            assert "Step | Rank 0" in text


def test_deadlock_report_says_what_each_rank_waits_for():
    plans = [unfused(p) for p in pipeline_plans("1f1b", 2, 2)]
    with pytest.raises(PlanError) as info:
        simulate(plans, fwd_bwd)
    text = str(info.value)
    assert text.startswith("deadlock: 2 of 2 ranks cannot progress")
    # stage 0 sends F1's output while stage 1 sends B0's gradient: both rendezvous sends wait
    assert "rank 0 at op 3 send: send to rank 1 tag 3 has no matching recv (rank 1 is " in text
    assert "rank 1 at op 3 send: send to rank 0 tag 2 has no matching recv (rank 0 is " in text
    assert "it posts one at op 4" in text
    # the compute actions done so far, as a Step x Rank grid
    assert "Step | Rank 0 Rank 1\n   0 | F0     F0\n   1 | F1     B0" in text


def test_fused_plans_do_not_deadlock():
    for name in SCHEDULES:
        simulate(pipeline_plans(name, 4, 8, 2 if name == "interleaved" else 1))


def test_recv_without_send_is_a_deadlock():
    with pytest.raises(
        PlanError, match=r"recv from rank 0 tag 1 has no matching send \(rank 0 has"
    ):
        simulate([Plan(0, ()), Plan(1, (recv(0),))])


# --- collectives ----------------------------------------------------------------------------


def group_plans(ops_by_rank, group=(0, 1, 2)):
    return [Plan(r, tuple(ops), groups={"dp": group}) for r, ops in enumerate(ops_by_rank)]


def test_blocking_collective_ends_when_the_last_member_posts():
    ar = Collective("allreduce", "dp", "grads", 100)
    plans = group_plans([[Compute("forward", 0), ar], [ar], [Compute("backward", 0), ar]])
    sim = simulate(plans, lambda r, op: 0.5 if isinstance(op, Collective) else fwd_bwd(r, op))
    assert sim.finish == {0: 2.5, 1: 2.5, 2: 2.5}
    assert sim.spans[1] == [(0.0, 2.5, ar)]


def test_collective_mismatch_names_ranks_and_values():
    plans = group_plans(
        [
            [Collective("allreduce", "dp", "g", 100)],
            [Collective("allreduce", "dp", "g", 100)],
            [Collective("allreduce", "dp", "g", 200)],
        ]
    )
    with pytest.raises(PlanError) as info:
        simulate(plans)
    text = str(info.value)
    assert "collective #0 on group 'dp' (ranks [0, 1, 2])" in text
    assert "rank 0 op 0 posts allreduce of 100 float32" in text
    assert "rank 2 op 0 posts allreduce of 200 float32" in text
    kinds = group_plans(
        [[Collective("allreduce", "dp", "g", 1)], [Collective("bcast", "dp", "g", 1)]], (0, 1)
    )
    with pytest.raises(PlanError, match="bcast"):
        simulate(kinds)


def test_nonblocking_collective_overlaps_until_its_wait():
    ar = Collective("allreduce", "dp", "grads", 100, req="grads")
    plans = group_plans(
        [
            [ar, Compute("backward", 0), Wait("grads")],  # waits after the collective ended
            [Compute("forward", 0), ar, Wait("grads")],  # last to post
            [ar, Wait("grads"), Compute("forward", 1)],  # waits before it ended
        ]
    )
    sim = simulate(plans, fwd_bwd)
    assert sim.finish == {0: 2.0, 1: 1.0, 2: 2.0}
    assert sim.spans[0] == [(0.0, 1.0, ar), (0.0, 2.0, plans[0].ops[1]), (2.0, 2.0, Wait("grads"))]
    assert sim.spans[2][:2] == [(0.0, 1.0, ar), (0.0, 1.0, Wait("grads"))]


def test_nonblocking_errors():
    ar = Collective("allreduce", "dp", "g", 1, req="r")
    with pytest.raises(PlanError, match=r"Wait\('x'\) has no op in flight"):
        simulate(group_plans([[Wait("x")]], (0,)))
    with pytest.raises(PlanError, match="'r' is never waited"):
        simulate(group_plans([[ar]], (0,)))
    with pytest.raises(PlanError, match="already in flight"):
        simulate(group_plans([[ar, ar, Wait("r")]], (0,)))


def test_collective_deadlock_lists_the_missing_members():
    ar = Collective("allreduce", "dp", "g", 1)
    plans = group_plans([[ar], [ar], [recv(0)]])
    with pytest.raises(PlanError) as info:
        simulate(plans)
    text = str(info.value)
    assert (
        "rank 0 at op 0 allreduce(dp): allreduce #0 on group 'dp' (3 ranks) waits for rank(s) [2]"
        in text
    )
    assert "rank 2 is blocked at op 0 recv" in text
    assert "rank 2 at op 0 recv: recv from rank 0 tag 1 has no matching send" in text


def test_group_membership_errors():
    ar = Collective("allreduce", "dp", "g", 1)
    with pytest.raises(PlanError, match=r"group 'dp' = \[1, 2\] omits rank 0"):
        simulate([Plan(0, (ar,), groups={"dp": (1, 2)})])
    with pytest.raises(PlanError, match="not define"):
        simulate([Plan(0, (ar,), groups={"tp": (0,)})])
    plans = [
        Plan(0, (ar,), groups={"dp": (0, 1)}),
        Plan(1, (ar,), groups={"dp": (0, 1, 2)}),
        Plan(2, (), groups={"dp": (0, 1, 2)}),
    ]
    with pytest.raises(PlanError, match=r"disagree on group 'dp': rank 0 has \[0, 1\], rank 1 has"):
        simulate(plans)


def test_groups_with_the_same_name_are_separate():
    ar = Collective("allreduce", "dp", "g", 1)
    plans = [
        Plan(r, (Compute("forward", 0),) * r + (ar,), groups={"dp": (r % 2, r % 2 + 2)})
        for r in range(4)
    ]
    sim = simulate(plans, fwd_bwd)
    assert sim.finish == {0: 2.0, 1: 3.0, 2: 2.0, 3: 3.0}


# --- scale ----------------------------------------------------------------------------------


def test_thousand_ranks_pipeline_and_data_parallel():
    pp, dp, m = 4, 256, 8
    acts = [SCHEDULES["1f1b"](pp, m, s) for s in range(pp)]
    plans = []
    for r in range(pp * dp):
        s, d = divmod(r, dp)
        ops = pipeline_ops(acts[s], s, [q * dp + d for q in range(pp)], 1, 1000)
        ops += [Collective("allreduce", "dp", "grads", 10**6, req="g"), Wait("g")]
        plans.append(Plan(r, tuple(ops), groups={"dp": tuple(range(s * dp, (s + 1) * dp))}))
    sim = simulate(plans, fwd_bwd)
    assert sim.time == (m + pp - 1) * 3
    assert len(sim.finish) == pp * dp


# -- non-blocking point-to-point batches (P2P with req) ------------------------------------


def ring_step(rank, n, req, buf="kv", count=4):
    """One ring exchange: buf_out to rank + 1, buf_in from rank - 1, posted as `req`."""
    return P2P(
        "ring",
        sends=(Msg((rank + 1) % n, 0, f"{buf}_out", 0, count),),
        recvs=(Msg((rank - 1) % n, 0, f"{buf}_in", 0, count),),
        req=req,
    )


def test_nonblocking_p2p_overlaps_the_compute_between_post_and_wait():
    # 3 ranks; each posts its exchange, computes (rank 1 longer), then waits: the batch
    # ends when both its messages have been matched, i.e. when the last neighbour posted.
    def cost(rank, op):
        if isinstance(op, Compute):
            return {0: 1.0, 1: 3.0, 2: 1.0}[rank] if op.name == "forward" else 0.0
        return 0.5 if isinstance(op, P2P) else 0.0  # the transfer

    plans = [
        Plan(r, (Compute("pre", 0), ring_step(r, 3, "s0"), Compute("forward", 0), Wait("s0")))
        for r in range(3)
    ]
    sim = simulate(plans, cost)
    # everybody posts at 0, so every batch ends at 0.5, under every rank's compute
    assert sim.finish == {0: 1.0, 1: 3.0, 2: 1.0}
    post, wait = plans[1].ops[1], plans[1].ops[3]
    assert sim.spans[1][1] == (0.0, 0.5, post)  # the batch in flight
    assert sim.spans[1][3] == (3.0, 3.0, wait)  # nothing left to wait for
    # rank 1 posts late (after a long compute): its neighbours wait at their Wait
    late = [
        Plan(r, (Compute("forward", 0) if r == 1 else Compute("pre", 0), *plans[r].ops[1:]))
        for r in range(3)
    ]
    sim = simulate(late, cost)
    assert sim.spans[0][3] == (1.0, 3.5, late[0].ops[3])  # rank 1's send posted at 3
    assert sim.spans[2][3] == (1.0, 3.5, late[2].ops[3])  # rank 1's recv posted at 3
    assert sim.finish == {0: 3.5, 1: 6.0, 2: 3.5}


def test_nonblocking_p2p_matches_blocking_messages_in_posting_order():
    # rank 0 posts a non-blocking send, then a blocking one on the same channel; rank 1
    # receives both blocking: the first receive pairs with the first post
    a = P2P("a", sends=(Msg(1, 5, "x", 0, 4),), req="a")
    b = P2P("b", sends=(Msg(1, 5, "y", 0, 8),))
    plans = [Plan(0, (a, b, Wait("a"))), Plan(1, (recv(0, 5, 4), recv(0, 5, 8)))]
    simulate(plans)
    swapped = [Plan(0, (a, b, Wait("a"))), Plan(1, (recv(0, 5, 8), recv(0, 5, 4)))]
    with pytest.raises(PlanError, match="message mismatch on rank 0 -> rank 1 tag 5"):
        simulate(swapped)


def test_nonblocking_p2p_deadlock_names_the_wait_and_the_peer():
    plans = [
        Plan(0, (ring_step(0, 2, "s"), Wait("s"))),
        Plan(1, (Compute("forward", 0), recv(0, 7))),  # never posts the ring's messages
    ]
    with pytest.raises(PlanError) as info:
        simulate(plans)
    text = str(info.value)
    assert "rank 0 at op 1 Wait('s'): Wait('s') for ring: send to rank 1 tag 0" in text
    assert "recv from rank 1 tag 0 has no matching send" in text


@pytest.mark.parametrize(
    "ops,words",
    [
        # a request posted twice, waited twice, never waited
        (lambda s: (s("r"), s("r"), Wait("r"), Wait("r")), "request 'r' is already in flight"),
        (lambda s: (s("r"), Wait("r"), Wait("r")), r"Wait\('r'\) has no op in flight"),
        (lambda s: (s("r"),), "non-blocking ring req 'r' is never waited"),
        # its receive buffer read (sent from) or written before the wait
        (
            lambda s: (s("r"), P2P("x", sends=(Msg(1, 3, "kv_in", 0, 4),)), Wait("r")),
            "op 1 x uses buffer kv_in mb 0 chunk 0 while non-blocking 'r' receives into it",
        ),
        (
            lambda s: (s("r"), Collective("allreduce", "g", "kv_in", 4, mb=0), Wait("r")),
            r"allreduce\(g\) uses buffer kv_in .* 'r' receives into it",
        ),
        # its send buffer written before the wait; a second exchange before the first's wait
        (
            lambda s: (s("r"), P2P("x", recvs=(Msg(1, 3, "kv_out", 0, 4),)), Wait("r")),
            "uses buffer kv_out mb 0 chunk 0 while non-blocking 'r' sends from it",
        ),
        (
            lambda s: (s("r"), s("q"), Wait("r"), Wait("q")),
            "ring req 'q' uses buffer kv_in mb 0 chunk 0 while non-blocking 'r' receives",
        ),
        # one batch receiving into the buffer it sends from
        (
            lambda s: (
                P2P("self", sends=(Msg(1, 0, "b", 0, 4),), recvs=(Msg(1, 0, "b", 0, 4),), req="r"),
                Wait("r"),
            ),
            "non-blocking self 'r' uses buffer b mb 0 chunk 0 twice",
        ),
    ],
)
def test_nonblocking_p2p_errors(ops, words):
    plans = [Plan(r, ops(lambda req, r=r: ring_step(r, 2, req)), {"g": (0, 1)}) for r in range(2)]
    with pytest.raises(PlanError, match=words):
        simulate(plans)


def test_nonblocking_p2p_buffers_are_free_after_the_wait():
    # the next exchange reuses both buffers once the first is waited; sending from a
    # buffer twice at once is allowed (both only read it)
    ops = lambda r: (  # noqa: E731
        ring_step(r, 2, "a"),
        Wait("a"),
        ring_step(r, 2, "b"),
        P2P(
            "again",
            sends=(Msg((r + 1) % 2, 9, "kv_out", 0, 4),),
            recvs=(Msg((r + 1) % 2, 9, "z", 0, 4),),
        ),
        Wait("b"),
        Collective("allreduce", "g", "kv_in", 4, mb=0),
    )
    simulate([Plan(r, ops(r), {"g": (0, 1)}) for r in range(2)])
