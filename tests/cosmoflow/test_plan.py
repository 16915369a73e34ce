"""The CosmoFlow proxy's plans, without MPI: the C++ proxy's message sizes and times, shard
layouts, conv0's input halo, uneven and replicated dense layers, validity (deadlock,
matching) for many layouts, and bad layouts refused."""

import pytest

from proxies.core import check, cli
from proxies.core.plan import P2P, Collective, Compute
from proxies.core.simulate import simulate
from proxies.cosmoflow.config import PRESETS, Shards, parse_shards
from proxies.cosmoflow.proxy import make_job, parser

# spcl/DNN-cpp-proxies, comm-and-compute/cosmoflow.cpp (floats; per rank for the collectives).
CPP_FWD_HALO = [2097152, 1048576, 524288, 262144]  # before conv1..conv4
CPP_BWD_HALO = [131072, 262144, 524288, 1048576]  # after conv4..conv1's backward
CPP_ALLGATHER = [65536, 256, 128]  # before dense0..dense2
CPP_REDUCE_SCATTER = [128, 256, 65536]  # after dense2..dense0's backward
CPP_ALLREDUCE = [1050737, 3539456, 884992, 221312, 55360, 3488]  # dense (fused), conv4..conv0
CPP_FWD_US = [6567, 13135, 6567, 3283, 1641, 5, 3, 1]
CPP_BWD_US = [2, 6, 10, 3283, 6567, 13135, 26270, 13135]


def job(argv, world):
    return make_job(parser().parse_args(argv), world)


def halo_ops(plan, phase):
    return [op for op in plan.ops if isinstance(op, P2P) and op.name.startswith(f"halo {phase}")]


@pytest.mark.parametrize("world", [4, 8, 32])
def test_cpp_proxy_message_sizes(world):
    j = job(["--model", "dnn-cpp-proxies", "--dry-run"], world)
    for rank in range(world):
        plan = j.plan(rank)
        for phase, sizes in (("forward", CPP_FWD_HALO), ("backward", CPP_BWD_HALO)):
            ops = halo_ops(plan, phase)
            # conv1..conv4 only: the C++ proxy sends no conv0 halo, and neither do we here
            assert [op.name[-5:] for op in ops] == [f"conv{n}" for n in range(1, 5)][
                :: 1 if phase == "forward" else -1
            ]
            assert [{m.count for m in op.sends + op.recvs} for op in ops] == [{n} for n in sizes]
            for op in ops:  # the C++ proxy's neighbours: shard rank ^ 1 and rank ^ 2
                assert {m.peer for m in op.sends} == {m.peer for m in op.recvs}
                assert {m.peer for m in op.sends} == {rank ^ 1, rank ^ 2}
        colls = [op for op in plan.ops if isinstance(op, Collective)]
        per_rank = [op.count // 4 for op in colls if op.kind == "allgather"]
        assert per_rank == CPP_ALLGATHER
        per_rank = [op.count // 4 for op in colls if op.kind == "reduce_scatter"]
        assert per_rank == CPP_REDUCE_SCATTER
        allreduce = [op for op in colls if op.kind == "allreduce"]
        # One replica (world 4) has no dense allreduce: a group of one (the C++ proxy calls
        # it anyway).
        assert [op.count for op in allreduce] == CPP_ALLREDUCE[world == 4 :]
        assert all(op.req for op in allreduce)  # non-blocking, waited for at the end
        # Dense slices over the replicas holding the same shard; conv over every rank.
        assert plan.groups["dp"] == tuple(range(rank % 4, world, 4))
        assert [op.group for op in allreduce] == ["dp"] * (world > 4) + ["world"] * 5
        assert plan.groups["world"] == tuple(range(world))


def test_cpp_proxy_layer_times_and_parameters():
    j = job(["--model", "dnn-cpp-proxies", "--dry-run"], 8)
    comp = [op for op in j.plan(0).ops if isinstance(op, Compute) and op.name != "optimizer"]
    fwd = [round(op.seconds * 1e6, 6) for op in comp if op.name.endswith("forward")]
    assert fwd == CPP_FWD_US
    # Backward per layer in the C++ order (conv l >= 1: weight + input gradient halves).
    bwd: dict[str, float] = {}
    for op in comp:
        if "backward" in op.name:
            layer = op.name.split(".")[0]
            bwd[layer] = bwd.get(layer, 0.0) + op.seconds * 1e6
    assert list(bwd) == ["dense2", "dense1", "dense0", "conv4", "conv3", "conv2", "conv1", "conv0"]
    assert [round(t, 6) for t in bwd.values()] == CPP_BWD_US
    cfg = PRESETS["dnn-cpp-proxies"]
    assert cfg.conv_params(0) == 4 * 27 * 32 + 32 == 3488
    # The C++ proxy's total_params: the dense slices x 4 shards + the conv layers.
    assert cfg.num_params == 4 * CPP_ALLREDUCE[0] + sum(CPP_ALLREDUCE[1:])
    sim = simulate([j.plan(r) for r in range(8)], cost=lambda r, op: getattr(op, "seconds", 0.0))
    assert sim.time == pytest.approx((sum(CPP_FWD_US) + sum(CPP_BWD_US)) * 1e-6)


def test_exact_halos_include_the_diagonal():
    """2x2 tiny: each shard has an H face, a W face and a diagonal edge neighbour."""
    j = job(["--shards", "4", "--global-batch", "2", "--dry-run"], 4)
    (op,) = [op for op in halo_ops(j.plan(0), "forward") if op.name.endswith("conv1")]
    # conv1's input per shard: B 2 x 16 x 8 x 8 x 4 channels.
    assert {m.buf: m.count for m in op.sends} == {
        "conv1.x.to_e": 2 * 16 * 8 * 4,
        "conv1.x.to_s": 2 * 16 * 8 * 4,
        "conv1.x.to_se": 2 * 16 * 4,
    }
    assert {m.peer for m in op.sends} == {1, 2, 3}


def test_conv0_exchanges_the_input_halo():
    """2x4 tiny, B 2: conv0's input per shard is 32 x 16 x 8 voxels x 4 channels. Shard 1
    (row 0, column 1) has w, e, sw, s, se neighbours: faces B*D*h*C along W, B*D*w*C along
    H, edges B*D*C to the diagonals; the same counts come back; no backward conv0 halo."""
    j = job(["--shards", "2x4", "--dry-run"], 8)
    plan = j.plan(1)
    (op,) = [op for op in halo_ops(plan, "forward") if op.name.endswith("conv0")]
    face_we, face_ns, edge = 2 * 32 * 16 * 4, 2 * 32 * 8 * 4, 2 * 32 * 4
    assert {m.buf: (m.peer, m.count) for m in op.sends} == {
        "conv0.x.to_w": (0, face_we),
        "conv0.x.to_e": (2, face_we),
        "conv0.x.to_sw": (4, edge),
        "conv0.x.to_s": (5, face_ns),
        "conv0.x.to_se": (6, edge),
    }
    assert sorted(m.count for m in op.recvs) == sorted(m.count for m in op.sends)
    assert not [op for op in halo_ops(plan, "backward") if op.name.endswith("conv0")]
    # It comes right after the data, before conv0.
    names = [op.name for op in plan.ops[:3]]
    assert names == ["data", "halo forward conv0", "conv0.forward"]


def dense_collectives(plan):
    return [
        (op.kind, op.group, op.buf, op.count, op.unit)
        for op in plan.ops
        if isinstance(op, Collective) and op.buf.startswith("dense")
    ]


def test_uneven_dense_split():
    """4x4 tiny, B 2, 1 replica: dense 16-6-4 over 16 shards. dense0 16 columns, 1 each; dense1
    6 columns, on shards 0-5; dense2 4 columns, on shards 0-3. Gathered inputs: the conv
    output (2 x 1,024), then whole columns of 2 samples."""
    F = 4 * 4 * 4 * 16  # 32^3 pooled 3 times x 16 channels

    def held(shard: int) -> int:
        """(I + 1) x the columns of every layer the shard holds."""
        cols = [1, int(shard < 6), int(shard < 4)]
        return sum((i + 1) * c for i, c in zip([F, 16, 6], cols, strict=True))

    j = job(["--shards", "4x4", "--dry-run"], 16)
    for rank in range(16):
        plan = j.plan(rank)
        assert dense_collectives(plan) == [
            ("allgather", "sp", "dense0.in", 2 * F, 1),
            ("allgather", "sp", "dense1.in", 2 * 16, 2),
            ("allgather", "sp", "dense2.in", 2 * 6, 2),
            ("reduce_scatter", "sp", "dense2.din", 2 * 6, 2),
            ("reduce_scatter", "sp", "dense1.din", 2 * 16, 2),
            ("reduce_scatter", "sp", "dense0.din", 2 * F, 1),
        ]
        rt = j.runtime(rank, None, None, "none")
        assert rt.bufs["dense.grads"].size == held(rank)
        assert not [op for op in plan.ops if getattr(op, "buf", "") == "dense.grads"]  # 1 replica
    # The engine's blocks of dense2.in: shard s's 2 x (its dense1 columns).
    sizes = [b.size for b in check.blocks(rt.bufs["dense2.in"], 16, 2)]
    assert sizes == [2] * 6 + [0] * 10
    # 2 replicas: each shard's slice allreduced with its replica partner's.
    j = job(["--shards", "4x4", "--dry-run"], 32)
    for rank in (0, 5, 9, 21):
        (ar,) = [op for op in j.plan(rank).ops if getattr(op, "buf", "") == "dense.grads"]
        assert (ar.group, ar.count) == ("dp", held(rank % 16))


def test_replicated_dense():
    """--dense replicate, 2x4 x 2 replicas: one allgather (the conv output), no
    reduce-scatter, every dense weight ((F+1)*16 + 17*6 + 7*4) allreduced over all ranks."""
    j = job(["--shards", "2x4", "--dense", "replicate", "--dry-run"], 16)
    F = 4 * 4 * 4 * 16
    for rank in (0, 7, 12):
        plan = j.plan(rank)
        assert dense_collectives(plan) == [
            ("allgather", "sp", "dense0.in", 2 * F, 1),
            ("allreduce", "world", "dense.grads", (F + 1) * 16 + 17 * 6 + 7 * 4, 1),
        ]
        flops = {op.name: op.flops for op in plan.ops if isinstance(op, Compute)}
        assert flops["dense1.forward"] == 2 * 2 * 16 * 6  # the whole layer, on every shard


@pytest.mark.parametrize(
    "model,world,shards,dense",
    [
        ("cosmoflow-tiny", 1, "1", "split"),
        ("cosmoflow-tiny", 2, "2", "split"),
        ("cosmoflow-tiny", 8, "4", "split"),
        ("cosmoflow-tiny", 16, "2x1", "split"),
        ("cosmoflow-tiny", 8, "2x4", "split"),
        ("cosmoflow-tiny", 16, "4x2", "replicate"),
        ("cosmoflow-tiny", 32, "4x4", "split"),
        ("cosmoflow-tiny", 16, "4x4", "replicate"),
        ("cosmoflow", 16, "1x4", "split"),
        ("cosmoflow", 48, "2x2", "split"),
        ("cosmoflow", 16, "2x4", "split"),
        ("cosmoflow", 32, "4x4", "replicate"),
        ("dnn-cpp-proxies", 64, "4", "split"),
        ("dnn-cpp-proxies", 16, "2x4", "split"),
    ],
)
@pytest.mark.parametrize("compute", ["model", "none"])
def test_plans_are_valid(model, world, shards, dense, compute):
    argv = ["--model", model, "--shards", shards, "--dense", dense, "--compute", compute]
    j = job([*argv, "--dry-run"], world)
    plans = [j.plan(r) for r in range(world)]
    sim = simulate(plans)
    assert sim.time == 0.0
    sent = sum(m.count for p in plans for _, m, d in p.messages() if d == "send")
    recv = sum(m.count for p in plans for _, m, d in p.messages() if d == "recv")
    assert sent == recv


@pytest.mark.parametrize(
    "text,want", [("4", (2, 2)), ("8", (2, 4)), ("2", (1, 2)), ("1", (1, 1)), ("1x4", (1, 4))]
)
def test_shards_parse(text, want):
    assert parse_shards(text) == Shards(*want)


@pytest.mark.parametrize(
    "argv,world,words",
    [
        (["--shards", "4"], 6, "world size 6 is not a multiple of --shards 4"),
        (["--shards", "0"], 4, "--shards"),
        (["--shards", "2x"], 4, "--shards"),
        (["--shards", "8x1"], 8, "H = 32 split 8 ways is 4 voxels per shard"),
        (["--shards", "3"], 3, "W = 32 split 3 ways is 10.6667 voxels per shard"),
        (["--model", "cosmoflow", "--shards", "8x8"], 64, "H = 128 split 8 ways is 16 voxels"),
        (["--shards", "2", "--global-batch", "3"], 4, "--global-batch 3 is not divisible"),
        (["--model", "dnn-cpp-proxies", "--compute", "real"], 4, "--compute real needs"),
        (["--model", "dnn-cpp-proxies", "--dense", "replicate"], 4, "--dense replicate needs"),
        (["--momentum", "1.5"], 4, "--momentum: expected a momentum in"),
    ],
)
def test_bad_layouts_are_usage_errors(argv, world, words):
    with pytest.raises(cli.UsageError, match=words.replace("+", r"\+")):
        job([*argv, "--dry-run"], world)
