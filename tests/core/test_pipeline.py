"""Schedules -> plan ops: messages, fusion into batches, tags; every schedule simulates."""

from itertools import pairwise

import pytest

from proxies.core.pipeline import MAX_TAG, p2p_tag, pipeline_ops
from proxies.core.plan import P2P, Compute, Plan
from proxies.core.schedules import SCHEDULES, Action, bubble_fraction, parse_actions
from proxies.core.simulate import PlanError, simulate


def legal_grid():
    """(name, pp, m, v) for pp 1..8, m 1..16, v 1..3 wherever the schedule accepts them."""
    for name in SCHEDULES:
        for v in (1, 2, 3):
            for pp in range(1, 9):
                for m in range(1, 17):
                    if v == 1 or (name == "interleaved" and m % pp == 0):
                        yield name, pp, m, v


def pipeline_plans(name, pp, m, v=1, world=None, count=16):
    """One plan per stage of one pipeline; world[s] is stage s's world rank."""
    world = world or list(range(pp))
    plans = []
    for s in range(pp):
        ops = pipeline_ops(SCHEDULES[name](pp, m, s, v), s, world, v, count)
        plans.append(Plan(world[s], tuple(ops), groups={"pp": tuple(world)}, coords={"pp": s}))
    return plans


def fwd_bwd(v=1):
    """Forward 1, backward 2 per micro-batch, spread over the v chunks; communication free."""
    return lambda rank, op: {"forward": 1 / v, "backward": 2 / v}.get(op.name, 0.0)


def show(ops):
    """Ops as words: computes as actions, batches as name[peer:tag,...]."""
    words = []
    for op in ops:
        if isinstance(op, Compute):
            words.append(str(Action(op.name[0].upper(), op.mb, op.chunk)))
        else:
            msgs = ",".join(f"{m.peer}:{m.tag}" for m in op.sends + op.recvs)
            words.append(f"{op.name}[{msgs}]")
    return " ".join(words)


def test_1f1b_two_stages_golden():
    acts = SCHEDULES["1f1b"]
    ops = [pipeline_ops(acts(2, 2, s), s, [5, 7], 1, 10) for s in range(2)]
    # tags: activations of mb i -> 2i + 1, their gradients -> 2i + 2
    assert show(ops[0]) == (
        "F0 send_forward[7:1] F1 send_forward_recv_backward[7:3,7:2] B0 recv_backward[7:4] B1"
    )
    assert show(ops[1]) == (
        "recv_forward[5:1] F0 B0 send_backward_recv_forward[5:2,5:3] F1 B1 send_backward[5:4]"
    )
    batch = ops[0][3]
    assert [(m.buf, m.mb, m.count) for m in batch.sends + batch.recvs] == [
        ("act_out", 1, 10),
        ("grad_out", 0, 10),
    ]
    assert [(m.buf, m.mb) for m in ops[1][0].recvs + ops[1][3].sends] == [
        ("act_in", 0),
        ("grad_in", 0),
    ]


def test_every_batch_sits_between_computes_with_sends_first():
    for name, pp, m, v in legal_grid():
        if pp > 4 or m > 8:
            continue
        for plan in pipeline_plans(name, pp, m, v):
            kinds = [type(op) for op in plan.ops]
            assert all(not (a is P2P and b is P2P) for a, b in pairwise(kinds))
            assert sum(k is Compute for k in kinds) == 2 * m * v


def test_1f1b_batches():
    names = [op.name for op in pipeline_plans("1f1b", 4, 8)[1].ops if isinstance(op, P2P)]
    # warm-up F0 F1: the send of one forward goes with the receive of the next
    assert names[:3] == ["recv_forward", "send_forward_recv_forward", "send_forward_recv_forward"]
    # steady F2 B0 .. F7 B5: each exchange carries both directions (Megatron's pairing)
    steady = ["send_forward_recv_backward", "send_backward_recv_forward"] * 5
    assert names[3:14] == steady + ["send_forward_recv_backward"]
    # cool-down B6 B7
    assert names[14:] == ["send_backward_recv_backward"] * 2 + ["send_backward"]


def test_interleaved_steady_pairs_exchange_once_per_step():
    ops = pipeline_plans("interleaved", 2, 4, 2)[1].ops
    assert "send_forward_backward_recv_forward_backward" in {op.name for op in ops}
    # no communication between the forward and the backward of a steady pair
    assert show(ops).count("1F0 1B0 send_backward_recv_forward") == 1


def test_interleaved_with_sends_between_f_and_b_deadlocks():
    # why steady pairs are one step for v > 1: per-action placement (warmup = everything)
    acts = [SCHEDULES["interleaved"](2, 4, s, 2) for s in range(2)]
    plans = [Plan(s, tuple(pipeline_ops(acts[s], s, [0, 1], 2, 1, warmup=16))) for s in range(2)]
    with pytest.raises(PlanError, match="deadlock"):
        simulate(plans)


def test_one_stage_is_compute_only():
    for v in (1, 3):
        ops = pipeline_ops(SCHEDULES["interleaved"](1, 4, 0, v), 0, [0], v, 100)
        assert all(isinstance(op, Compute) for op in ops) and len(ops) == 8 * v


def test_compute_ops_and_flops():
    ops = pipeline_ops(parse_actions("F0 1F0 1B0 B0"), 0, [0], 2, 1, flops=lambda k, c: 10 * c)
    assert ops == [
        Compute("forward", 0, 0, 0.0),
        Compute("forward", 0, 1, 10.0),
        Compute("backward", 0, 1, 10.0),
        Compute("backward", 0, 0, 0.0),
    ]


def test_tags_are_mpi_legal_and_unique_per_channel():
    assert p2p_tag(0, 0, 0, 1) == 1 and p2p_tag(1, 0, 0, 1) == 2
    for plan in pipeline_plans("interleaved", 4, 16, 3):
        seen = set()
        for _, msg, way in plan.messages():
            assert 1 <= msg.tag <= MAX_TAG
            assert (way, msg.peer, msg.tag) not in seen
            seen.add((way, msg.peer, msg.tag))
    # beyond 2*m*v > 32767 tags wrap around but stay legal
    assert max(p2p_tag(1, 2, mb, 3) for mb in range(20000)) <= MAX_TAG


def test_world_ranks_and_dtype_reach_the_messages():
    plans = pipeline_plans("1f1b", 3, 4, world=[4, 9, 2])
    peers = {m.peer for _, m, _ in plans[1].messages()}
    assert peers == {4, 2}
    ops = pipeline_ops(SCHEDULES["gpipe"](2, 1, 0), 0, [0, 1], 1, 8, dtype="float16")
    assert ops[1].sends[0].nbytes == 16


def test_bad_arguments():
    with pytest.raises(ValueError, match="stage = 2"):
        pipeline_ops([], 2, [0, 1], 1, 1)
    with pytest.raises(ValueError, match="chunk 1"):
        pipeline_ops(parse_actions("1F0"), 0, [0, 1], 1, 1)


def test_every_schedule_simulates_without_deadlock_and_with_the_analytic_bubble():
    for name, pp, m, v in legal_grid():
        sim = simulate(pipeline_plans(name, pp, m, v), fwd_bwd(v))
        ideal = 3 * m  # m forwards (1) and backwards (2) per stage
        assert sim.time == pytest.approx(ideal * (1 + bubble_fraction(pp, m, v))), (name, pp, m, v)


def test_gpipe_and_1f1b_time_is_m_plus_pp_minus_1_slots():
    for name in ("gpipe", "1f1b"):
        for pp, m in ((4, 8), (8, 3), (3, 16)):
            sim = simulate(
                pipeline_plans(name, pp, m, world=[10 + 2 * s for s in range(pp)]), fwd_bwd()
            )
            assert sim.time == (m + pp - 1) * 3
            assert all(idle == 3 * (pp - 1) for idle in sim.idle.values())
