"""The CosmoFlow proxy's plans, without MPI: the C++ proxy's message sizes and times, shard
layouts, validity (deadlock, matching) for many layouts, and bad layouts refused."""

import pytest

from proxies.core import cli
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


@pytest.mark.parametrize(
    "model,world,shards",
    [
        ("cosmoflow-tiny", 1, "1"),
        ("cosmoflow-tiny", 2, "2"),
        ("cosmoflow-tiny", 8, "4"),
        ("cosmoflow-tiny", 16, "2x1"),
        ("cosmoflow", 16, "1x4"),
        ("cosmoflow", 48, "2x2"),
        ("dnn-cpp-proxies", 64, "4"),
    ],
)
@pytest.mark.parametrize("compute", ["model", "none"])
def test_plans_are_valid(model, world, shards, compute):
    j = job(["--model", model, "--shards", shards, "--compute", compute, "--dry-run"], world)
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
        (["--shards", "4x1"], 4, "H = 32 split 4 ways is 8 voxels per shard"),
        (["--shards", "2", "--global-batch", "3"], 4, "--global-batch 3 is not divisible"),
        (["--model", "cosmoflow", "--shards", "8"], 8, "dense widths 128-64-4"),
        (["--model", "dnn-cpp-proxies", "--compute", "real"], 4, "--compute real needs"),
        (["--momentum", "1.5"], 4, "--momentum 1.5"),
    ],
)
def test_bad_layouts_are_usage_errors(argv, world, words):
    with pytest.raises(cli.UsageError, match=words.replace("+", r"\+")):
        job([*argv, "--dry-run"], world)
