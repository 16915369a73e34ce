"""Context parallelism (--cp) in the GPT plans: every comm x split at cp 2 and 4 against hand
arithmetic (message counts, sizes, groups, peers), the causal work per rank, the pipeline
and gradient groups, bad input, the 4096-rank dry run, and 4-rank model-compute runs with
--check under MPI."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from launch import mpirun

from proxies.core import exits, prediction, trace
from proxies.core.cli import UsageError
from proxies.core.machine import load
from proxies.core.plan import P2P, Collective, Compute, Wait
from proxies.core.simulate import simulate
from proxies.gpt2 import proxy as gpt2
from proxies.gpt3 import proxy as gpt3
from proxies.gpt3.proxy import main, make_job, parser
from proxies.transformer import cp as cpsplit

C = 64  # gpt3-tiny's width (4 heads)
T = 64
TINY = ["--model", "gpt3-tiny", "--seq-len", str(T), "--micro-batches", "1"]


def job(argv: list[str], world: int, front=gpt3):
    return front.make_job(front.parser().parse_args([*argv, "--dry-run"]), world)


def cp_job(n: int, comm: str, split: str, *extra: str, world: int | None = None):
    argv = ["1", "1", *TINY, "--cp", str(n), "--cp-comm", comm, "--cp-split", split, *extra]
    return job(argv, world or n)


def cp_ops(plan) -> list:
    return [
        op
        for op in plan.ops
        if (isinstance(op, P2P) and op.category == "cp")
        or (isinstance(op, Collective) and op.category.startswith("cp"))
    ]


def test_causal_pairs_by_hand():
    # T = 8 over 2 ranks; a query at p sees the keys at 0..p
    contiguous = cpsplit.pair_matrix(8, 2, "contiguous")  # rank 0: 0-3, rank 1: 4-7
    assert contiguous.tolist() == [[1 + 2 + 3 + 4, 0], [4 * 4, 1 + 2 + 3 + 4]]
    zigzag = cpsplit.pair_matrix(8, 2, "zigzag")  # chunks of 2: rank 0 {0,1,6,7}, 1 {2,3,4,5}
    assert zigzag.tolist() == [[1 + 2 + 3 + 4, 4 * 2], [2 * 4, 1 + 2 + 3 + 4]]
    inter = cpsplit.pair_matrix(8, 2, "interleaved")  # rank 0 {0,2,4,6}, rank 1 {1,3,5,7}
    assert inter.tolist() == [[1 + 2 + 3 + 4, 0 + 1 + 2 + 3], [1 + 2 + 3 + 4, 1 + 2 + 3 + 4]]
    for split in cpsplit.SPLITS:
        assert cpsplit.pair_matrix(1024, 4, split).sum() == 1024 * 1025 // 2


@pytest.mark.parametrize("split", cpsplit.SPLITS)
@pytest.mark.parametrize("n", [2, 4])
def test_ring_messages_peers_and_sizes(n, split):
    j = cp_job(n, "ring", split)
    K = T // n * 2 * C  # one rank's keys and values (B = 1, tp = 1)
    for rank in range(n):
        plan = j.plan(rank)
        cp = plan.groups["cp"]
        r = cp.index(rank)
        ring = [op for op in cp_ops(plan)]
        assert all(isinstance(op, P2P) for op in ring)
        # forward n-1 key/value blocks; backward n exchanges: k,v | k,v + dk,dv | dk,dv
        counts = [op.sends[0].count for op in ring]
        assert counts == [K] * (n - 1) + [K] + [2 * K] * (n - 2) + [K]
        for op in ring:
            assert [m.peer for m in op.sends] == [cp[(r + 1) % n]]
            assert [m.peer for m in op.recvs] == [cp[(r - 1) % n]]
            assert op.sends[0].count == op.recvs[0].count
    simulate([j.plan(r) for r in range(n)])


@pytest.mark.parametrize("split", cpsplit.SPLITS)
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("reduce", ["allreduce", "reduce-scatter", "reduce"])
def test_allgather_and_its_gradient_reductions(n, split, reduce):
    j = cp_job(n, "allgather", split, "--cp-grad-reduce", reduce)
    K = T // n * 2 * C
    for rank in range(n):
        plan = j.plan(rank)
        ops = cp_ops(plan)
        assert (ops[0].kind, ops[0].group, ops[0].count) == ("allgather", "cp", n * K)
        back = ops[1:]
        if reduce != "reduce":
            kind = reduce.replace("-", "_")
            assert [(op.kind, op.group, op.count) for op in back] == [(kind, "cp", n * K)]
            continue
        r = plan.groups["cp"].index(rank)
        # contiguous: the reduce rooted at i involves the ranks after i (none after the last)
        roots = list(range(min(r + 1, n - 1))) if split == "contiguous" else list(range(n))
        assert [op.group for op in back] == [f"cp_r{i}" for i in roots]
        assert all(op.kind == "reduce" and op.count == K for op in back)
        cp = plan.groups["cp"]
        for i in roots:
            members = plan.groups[f"cp_r{i}"]
            assert members[0] == cp[i]  # the root, group rank 0
            want = cp[i:] if split == "contiguous" else cp[i:] + cp[:i]
            assert members == want
    simulate([j.plan(r) for r in range(n)])


@pytest.mark.parametrize("split", cpsplit.SPLITS)
@pytest.mark.parametrize("n", [2, 4])
def test_alltoall_ulysses(n, split):
    j = cp_job(n, "alltoall", split)
    Nc = T // n
    for rank in range(n):
        ops = cp_ops(j.plan(rank))
        assert [(op.kind, op.buf, op.count) for op in ops] == [
            ("alltoall", "cp_qkv", Nc * 3 * C),
            ("alltoall", "cp_out", Nc * C),
            ("alltoall", "cp_out", Nc * C),
            ("alltoall", "cp_qkv", Nc * 3 * C),
        ]
    simulate([j.plan(r) for r in range(n)])


def layer_flops(plan, prefix: str) -> float:
    return sum(
        op.flops for op in plan.ops if isinstance(op, Compute) and op.name.startswith(prefix)
    )


@pytest.mark.parametrize("comm", cpsplit.COMMS)
@pytest.mark.parametrize("split", cpsplit.SPLITS)
def test_work_adds_up_to_one_process_and_shows_the_imbalance(comm, split):
    n = 4
    one = job(["1", "1", *TINY, "--compute", "model"], 1).plan(0)
    j = cp_job(n, comm, split)
    plans = [j.plan(r) for r in range(n)]
    total = sum(op.flops for p in plans for op in p.ops if isinstance(op, Compute))
    assert total == pytest.approx(sum(op.flops for op in one.ops if isinstance(op, Compute)))
    # the attention core's QK^T and AV: 4 B T^2 C forward, shared by the causal work
    core = np.array([layer_flops(p, "fwd_core") for p in plans])
    assert core.sum() == pytest.approx(4.0 * T * T * C)
    if comm == "alltoall":  # every rank: all tokens of its heads
        assert core == pytest.approx(core.mean())
        return
    pairs = cpsplit.pair_matrix(T, n, split).sum(axis=1)
    ranks = [p.groups["cp"].index(p.rank) for p in plans]
    assert core == pytest.approx(4.0 * T * T * C * pairs[ranks] / pairs.sum())
    if split == "contiguous":  # the last rank: (2n-1)/n of the mean, less 1/T
        assert core[-1] / core.mean() == pytest.approx((2 * n - 1) / n, rel=2 / T)
    elif split == "zigzag":
        assert core == pytest.approx(core.mean())
    else:
        assert np.abs(core / core.mean() - 1).max() < 0.1


def test_pipeline_messages_shrink_and_gradients_reduce_over_dp_and_cp():
    # 8 ranks: cp 2 x pp 2 x dp 2; with tp 2 and sequence parallelism another / tp
    j = job(["2", "2", *TINY, "--cp", "2"], 8)
    plan = j.plan(0)
    assert {m.count for _, m, _ in plan.messages() if m.buf.startswith(("act", "grad"))} == {
        T // 2 * C
    }
    g = j.grid
    dp = plan.groups["dp"]
    assert len(dp) == 4 and set(dp) == {
        g.rank_of(pp=0, tp=0, cp=k, dp=d) for k in range(2) for d in range(2)
    }
    grads = [op for op in plan.ops if isinstance(op, Collective) and op.group == "dp"]
    one = job(["2", "2", *TINY], 4).plan(0)
    assert [op.count for op in grads] == [
        op.count for op in one.ops if isinstance(op, Collective) and op.group == "dp"
    ]
    sp = job(["2", "2", *TINY, "--cp", "2", "--tp", "2", "--sequence-parallel"], 16).plan(0)
    assert {m.count for _, m, _ in sp.messages() if m.buf.startswith(("act", "grad"))} == {
        T // 2 // 2 * C
    }


def test_cp_1_is_the_plan_without_cp():
    a = job(["2", "2", *TINY, "--tp", "2"], 8)
    b = job(["2", "2", *TINY, "--tp", "2", "--cp", "1"], 8)
    assert a.grid == b.grid and all(a.plan(r) == b.plan(r) for r in range(8))


def test_gpt2_plans_per_layer_with_cp():
    j = job(["2", "1", "--cp", "2", "--cp-comm", "allgather", "--seq-len", "64"], 4, gpt2)
    plan = j.plan(0)
    names = [op.name for op in plan.ops if isinstance(op, Compute)][:5]
    assert names == ["fwd_embed", "fwd_qkv:0", "fwd_core:0", "fwd_proj:0", "fwd_mlp:0"]
    assert plan.groups["cp"] == tuple(j.grid.group("cp", 0)) and len(plan.groups["dp"]) == 4
    simulate([j.plan(r) for r in range(4)])


BAD = [
    (["--cp", "3"], 4, "not a multiple of --cp 3"),
    (["--cp", "2", "--seq-len", "66"], 2, "--seq-len 66 is not a multiple of 2 x --cp 2 = 4"),
    (
        ["--cp", "4", "--seq-len", "34", "--cp-split", "contiguous"],
        4,
        "--seq-len 34 is not a multiple of --cp 4",
    ),
    (["--cp", "4", "--cp-comm", "alltoall", "--tp", "2"], 8, "2 attention heads per tensor"),
    (["--cp", "2", "--cp-grad-reduce", "reduce"], 2, "--cp-grad-reduce needs --cp-comm allgather"),
    (["--cp", "2", "--moe-experts", "4"], 2, "--cp with --moe-experts"),
    (
        ["--cp", "2", "--tp", "4", "--sequence-parallel", "--seq-len", "12"],
        8,
        "not a multiple of --tp 4",
    ),
]


@pytest.mark.parametrize("compute", ["real", "replay"])
def test_real_and_replay_compute_are_accepted(compute):
    """No longer refused (cpshard.py computes each rank's tokens)."""
    job = make_job(parser().parse_args(["4", "1", "--model", "gpt3-tiny", "--cp", "2",
                                        "--compute", compute]), 2)  # fmt: skip
    assert job.config["cp"] == 2


@pytest.mark.parametrize("argv,world,words", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_input_is_a_usage_error(argv, world, words):
    with pytest.raises(UsageError) as e:
        make_job(parser().parse_args(["4", "1", "--model", "gpt3-tiny", *argv]), world)
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--cp", "2", "--schedule", "cpp"], "has no context parallelism"),
        (["--cp", "2", "--model", "dnn-cpp-proxies"], "has no context parallelism"),
        (["--cp", "2", "--zero", "1"], "not --zero 1"),
        (["--cp", "2", "--grad-sync", "fused"], "not --grad-sync fused"),
    ],
)
def test_gpt2_bad_input(argv, words):
    with pytest.raises(UsageError) as e:
        gpt2.make_job(gpt2.parser().parse_args(["4", "1", *argv]), 2)
    assert words in str(e.value)


def test_dry_run_4096_ranks_lists_the_cp_messages(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["8", "8", "--tp", "8", "--cp", "8", "--micro-batches", "8", "--dry-run"]
    assert main([*argv, "--world-size", "4096", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "cp 8 (zigzag, ring)" in text and "plan valid" in text
    got = json.loads(out.read_text())
    assert got["grid"] == {"order": "pp-tp-cp-dp", "pp": 8, "tp": 8, "cp": 8, "dp": 8}
    # GPT-3 175B widths at T 2048: one rank's k,v block B x T/8 x 2C/8 floats, 15 ring
    # messages per layer and micro-batch (7 forward, 8 backward, 3 of them double)
    K = 2048 // 8 * 2 * 12288 // 8
    per_layer = (7 + 1 + 2 * 6 + 1) * K  # forward 7 K; backward K, 6 x 2K, K
    assert got["bytes"]["cp_send"][0] == 4 * per_layer * 8  # 1 layer per stage, 8 mbs
    assert got["config"]["cp"] == 8 and got["config"]["cp_comm"] == "ring"


@pytest.mark.mpi
@pytest.mark.parametrize(
    "front,args",
    [
        ("gpt3", ["--cp-comm", "allgather", "--cp-split", "contiguous"]),
        ("gpt3", ["--cp-comm", "allgather", "--cp-grad-reduce", "reduce"]),
        ("gpt3", ["--cp-comm", "ring"]),
        ("gpt3", ["--cp-comm", "alltoall", "--cp-split", "interleaved"]),
        ("gpt2", ["--cp-comm", "ring", "--cp-split", "contiguous"]),
    ],
)
def test_4_ranks_model_compute_checks_every_cp_message(tmp_path, front, args):
    out = tmp_path / "r.json"
    model = ["--model", "gpt3-tiny"] if front == "gpt3" else []
    r = mpirun(
        4,
        f"proxies.{front}",
        "2",
        "1",
        *model,
        "--seq-len",
        "64",
        "--cp",
        "4",
        *args,
        "--compute",
        "model",
        "--check",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--quiet",
        "--json",
        str(out),
        "--timeout",
        "60",
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(out.read_text())
    assert got["config"]["cp"] == 4 and got["grid"]["cp"] == 4
    # the cp category measured on every rank, and the bytes the plan sends
    cp = [c for c in got["breakdown_per_rank_s"] if c.startswith("cp")]
    assert cp and all(len(got["breakdown_per_rank_s"][c]) == 4 for c in cp)
    assert any(c.startswith("cp") for c in got["bytes"])
    # the ring's exchange is non-blocking: exposed (cp) and hidden (cp_hidden) time
    assert ("cp_hidden" in cp) == ("ring" in args)
    assert_breakdown_adds_up(got)


def assert_breakdown_adds_up(got: dict) -> None:
    """Every rank's categories, hidden time left out, add up to the iteration."""
    per_rank = got["breakdown_per_rank_s"]
    iteration = sum(got["iter_time_s"]) / len(got["iter_time_s"])
    for r in range(got["world_size"]):
        booked = sum(v[r] for c, v in per_rank.items() if not c.endswith("_hidden"))
        assert booked == pytest.approx(iteration, rel=1e-6), r


# -- the ring's exchange overlapped: each step's P2P batch non-blocking ---------------------


@pytest.mark.parametrize("n", [2, 4])
def test_ring_posts_each_exchange_before_the_block_it_overlaps(n):
    j = cp_job(n, "ring", "zigzag")
    plan = j.plan(0)
    ops = plan.ops
    ring = [i for i, op in enumerate(ops) if isinstance(op, P2P) and op.category == "cp"]
    assert len(ring) == 2 * n - 1  # 1 layer: n - 1 forward, n backward exchanges
    for i in ring:
        post = ops[i]
        assert post.req, "the ring's exchanges are non-blocking"
        # the next op is the block computation it overlaps, then its Wait
        assert isinstance(ops[i + 1], Compute) and "_core" in ops[i + 1].name
        assert ops[i + 2] == Wait(post.req)
    # forward: the last block (after the n - 1 exchanges) needs no exchange; backward: the
    # last exchange (the dk,dv accumulator) runs under the rank's own diagonal block
    first = ring[0]
    names = [op.name for op in ops[first : first + 3 * (n - 1) + 1] if isinstance(op, Compute)]
    assert names == [f"fwd_core{s}:0" for s in range(n)]
    reqs = [ops[i].req for i in ring]
    assert len(set(reqs)) == len(reqs)


MACHINE = "configs/machines/10gbe.yaml"


def predicted(split: str, tflops: str):
    argv = ["1", "1", *TINY, "--cp", "4", "--cp-split", split, "--compute", "model"]
    args = parser().parse_args([*argv, "--device-tflops", tflops, "--dry-run"])
    pred, _ = prediction.run_prediction(make_job(args, 4), args, load(MACHINE), fold="never")
    return pred


def test_predicted_ring_hides_its_exchange_under_long_block_computations():
    # zigzag: every block computation of a step is as long on every rank, so with compute
    # >> transfer every exchange has ended by its Wait: nothing exposed, and the time in
    # flight equals the whole exchange time of the compute-free prediction
    fast, slow = predicted("zigzag", "1e6"), predicted("zigzag", "0.001")
    for r in range(4):
        assert fast.breakdown[r]["cp"] > 0
        assert fast.breakdown[r]["cp_hidden"] == pytest.approx(0.0, abs=1e-9)
        assert slow.breakdown[r]["cp"] == 0.0
        assert slow.breakdown[r]["cp_hidden"] == pytest.approx(fast.breakdown[r]["cp"], rel=1e-6)
    # contiguous: the later ranks' longer blocks keep their neighbours waiting (exposed)
    skew = predicted("contiguous", "0.001")
    assert skew.breakdown[0]["cp"] > 0
    for pred in (fast, slow, skew):
        for b in pred.breakdown.values():
            booked = sum(v for c, v in b.items() if not c.endswith("_hidden"))
            assert booked == pytest.approx(pred.time, rel=1e-9)


@pytest.mark.mpi
def test_4_ranks_ring_overlaps_checks_and_traces_its_exchange(tmp_path):
    out, tr = tmp_path / "r.json", tmp_path / "t.json"
    r = mpirun(
        4,
        "proxies.gpt3",
        *("2", "1", "--model", "gpt3-tiny", "--seq-len", "64", "--cp", "4"),
        *("--compute", "model", "--device-tflops", "0.01", "--check"),
        *("--iters", "2", "--warmup", "1", "--quiet", "--json", str(out), "--trace", str(tr)),
        *("--timeout", "60"),
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    got, doc = json.loads(out.read_text()), json.loads(tr.read_text())
    # exposed and hidden ring time on every rank (hidden: from each post until it was seen
    # complete, so positive whatever the speeds), the iteration's sum without the hidden
    per_rank = got["breakdown_per_rank_s"]
    assert all(v > 0 for v in per_rank["cp_hidden"]) and len(per_rank["cp"]) == 4
    assert_breakdown_adds_up(got)
    # the timeline: per rank and iteration 2 layers x 2 micro-batches x (3 + 4) exchanges,
    # each a start and a wait slice and a span in flight, every message a paired flow
    events = doc["traceEvents"]
    for rank in range(4):
        mine = [e for e in events if e.get("pid") == rank]
        for name, ph, cat in (
            ("start cp_ring", "X", "cp"),
            ("wait cp_ring", "X", "cp"),
            ("cp_ring in flight", "b", "cp_hidden"),
        ):
            assert sum(e["name"] == name and e["ph"] == ph for e in mine) == 2 * 28, name
            assert all(e["cat"] == cat for e in mine if e["name"] == name)
    flows = [e for e in events if e["ph"] in "sf"]
    assert len(flows) == 2 * 4 * 28 * 2 and doc["otherData"]["flows_unpaired"] == 0
    # self times per category: the run's breakdown
    sums = trace.category_seconds(doc)
    for c in ("cp", "compute"):
        mean = sum(per.get(c, 0.0) for per in sums.values()) / 4
        assert mean == pytest.approx(sum(got["breakdown_s"][c]), rel=0.02, abs=1e-4)


RING2 = ["2", "1", *TINY[:4], "--cp", "2", "--compute", "model", "--iters", "1", "--warmup", "0"]


@pytest.mark.mpi
def test_a_corrupted_ring_block_is_caught_after_its_wait():
    r = mpirun(
        2, "proxies.gpt3", *RING2, "--check", "--quiet", timeout=60, env=fault_env("corrupt:0")
    )
    assert r.returncode == exits.CHECK, r.stderr
    assert "--check: rank 1 received cp_kv_in mb 0 from rank 0" in r.stderr
    assert "non-blocking 'cp_ring:0:f0:0'" in r.stderr


@pytest.mark.mpi
def test_a_stalled_ring_neighbour_is_named_by_the_wait():
    # rank 1 stalls at its first exchange; rank 0 has posted its own and waits for it
    r = mpirun(2, "proxies.gpt3", *RING2, "--timeout", "2", timeout=20, env=fault_env("stall:1"))
    assert r.returncode == exits.STALLED, r.stderr
    assert re.search(
        r"rank 0 made no progress for \d+ s, stuck in iteration 0 op \d+/\d+: wait cp_ring "
        r"cp_ring:0:f0:0: send cp_kv_out mb 0 to 1 \(tag 0\), recv cp_kv_in mb 0 from 1 "
        r"\(tag 0\) \(waiting on rank\(s\) 1\)",
        r.stderr,
    ), r.stderr


def fault_env(spec: str) -> dict:
    return {"PROXIES_FAULT": spec}


@pytest.mark.mpi
def test_a_slow_link_leaves_the_ring_s_non_blocking_exchange_alone():
    # --slow-link holds blocking messages only: a ring between the slow pair still ends
    # (holding (F - 1) x a non-blocking batch's time in flight compounded without bound)
    r = mpirun(2, "proxies.gpt3", *RING2, "--slow-link", "0-1:20", "--timeout", "20", timeout=60)
    assert r.returncode == exits.OK, r.stderr
