"""The DLRM proxy's plans, without MPI: the C++ proxy's message sizes, order and A100 times,
the overlap schedule's structure, validity for many layouts, bad input."""

import pytest

from proxies.core.cli import UsageError
from proxies.core.plan import Collective, Compute, Wait
from proxies.core.simulate import simulate
from proxies.dlrm.config import PRESETS
from proxies.dlrm.proxy import make_job, parser

# spcl/DNN-cpp-proxies dlrm.cpp: message sizes (floats) and forward times (us).
BOT_MLP_SIZE, TOP_MLP_SIZE, EMB_ALL2ALL_SIZE = 49536, 728065, 262144
FWD_BOT_MLP, FWD_TOP_MLP, FWD_INTER, FWD_EMB = 341, 455, 209, 95


TABLE, TINY = ["--sharding", "table"], ["--model", "dlrm-tiny"]


def job(argv, world):
    return make_job(parser().parse_args(argv), world)


def collectives(plan, kind):
    return [op for op in plan.ops if isinstance(op, Collective) and op.kind == kind]


def test_preset_sizes():
    cfg = PRESETS["dnn-cpp-proxies"]
    assert cfg.interaction == 138 and cfg.features == 5
    assert sum(cfg.layer_params(cfg.bottom_layers)) == BOT_MLP_SIZE
    assert sum(cfg.layer_params(cfg.top_layers)) == TOP_MLP_SIZE
    mlperf = PRESETS["mlperf"]
    assert mlperf.tables == 26 and mlperf.interaction == 479  # 128 + 27 * 26 / 2
    assert [c for c, _ in mlperf.top_layers] == [479, 1024, 1024, 512, 256]


def test_cpp_schedule_is_the_cpp_proxy():
    """Same messages, same order, same blocking/non-blocking, same A100 times."""
    j = job(["--schedule", "cpp"], 4)
    for rank in range(4):
        plan = j.plan(rank)
        a2a = collectives(plan, "alltoall")
        assert [op.count for op in a2a] == [EMB_ALL2ALL_SIZE] * 2
        assert all(not op.req and op.group == "emb" for op in a2a)
        ar = collectives(plan, "allreduce")
        assert [(op.buf, op.count) for op in ar] == [
            ("grad:top", TOP_MLP_SIZE),
            ("grad:bottom", BOT_MLP_SIZE),
        ]
        assert all(op.req for op in ar)  # MPI_Iallreduce ...
        assert [type(op) for op in plan.ops[-3:]] == [Wait, Wait, Compute]  # ... Waitall
        names = [
            op.name
            if isinstance(op, Compute)
            else op.kind
            if isinstance(op, Collective)
            else "wait"
            for op in plan.ops
        ]
        assert names == [
            "emb forward", "alltoall", "bottom forward", "interaction forward", "top forward",
            "top.4 backward", "top.3 backward", "top.2 backward", "top.1 backward",
            "top.0 backward", "allreduce", "interaction backward", "bottom.2 backward",
            "bottom.1 backward", "bottom.0 backward", "allreduce", "alltoall", "emb backward",
            "wait", "wait", "optimizer",
        ]  # fmt: skip
        us = {op.name: op.seconds * 1e6 for op in plan.ops if isinstance(op, Compute)}
        assert us["emb forward"] == pytest.approx(FWD_EMB)
        assert us["bottom forward"] == pytest.approx(FWD_BOT_MLP)
        assert us["interaction forward"] == pytest.approx(FWD_INTER)
        assert us["top forward"] == pytest.approx(FWD_TOP_MLP)
        assert sum(v for k, v in us.items() if k.startswith("top.")) == pytest.approx(
            2 * FWD_TOP_MLP
        )
        assert sum(v for k, v in us.items() if k.startswith("bottom.")) == pytest.approx(
            2 * FWD_BOT_MLP
        )
        assert us["interaction backward"] == pytest.approx(FWD_INTER)
        assert us["emb backward"] == pytest.approx(2 * FWD_EMB)
        assert us["optimizer"] == 0
        assert plan.bytes_by_category() == {
            "emb_alltoall": 2 * EMB_ALL2ALL_SIZE * 4,
            "dp_allreduce": (TOP_MLP_SIZE + BOT_MLP_SIZE) * 4,
        }
    sim = simulate([j.plan(r) for r in range(4)], cost=lambda r, op: getattr(op, "seconds", 0))
    assert sim.time == pytest.approx(
        (3 * FWD_EMB + 3 * FWD_BOT_MLP + 2 * FWD_INTER + 3 * FWD_TOP_MLP) * 1e-6
    )


def test_overlap_schedule_allreduces_each_layer_as_its_backward_ends():
    plan = job([], 4).plan(1)
    ops = plan.ops
    ar = collectives(plan, "allreduce")
    assert sum(op.count for op in ar if op.buf.startswith("grad:top.")) == TOP_MLP_SIZE
    assert sum(op.count for op in ar if op.buf.startswith("grad:bottom.")) == BOT_MLP_SIZE
    for i, op in enumerate(ops):
        if isinstance(op, Compute) and op.name.endswith(" backward") and "." in op.name:
            nxt = ops[i + 1]
            assert isinstance(nxt, Collective) and nxt.buf == "grad:" + op.name.split()[0]
            assert nxt.req
    # the all-to-alls run under the bottom MLP, forward and backward
    names = [getattr(op, "name", getattr(op, "req", "")) for op in ops]
    fwd, bwd = (names.index(n) for n in ("emb_fwd", "emb_bwd"))
    assert ops[fwd + 1].name == "bottom forward" and isinstance(ops[fwd + 2], Wait)
    assert ops[bwd + 1].name == "bottom.2 backward"
    waits = [op.req for op in ops if isinstance(op, Wait)]
    assert waits[:2] == ["emb_fwd", "emb_bwd"] and len(waits) == 2 + len(ar)
    assert ops[-1].name == "optimizer"


def test_one_rank_has_no_communication():
    plan = job([], 1).plan(0)
    assert not [op for op in plan.ops if not isinstance(op, Compute)]


@pytest.mark.parametrize(
    "argv,world",
    [
        (["--model", "mlperf"], 4),  # 26 tables: 7,7,6,6 per rank, padded to 7
        (["--model", "mlperf", "--batch", "2080"], 26),  # one table each
        (["--model", "mlperf", "--batch", "2048"], 8),
        (["--model", "dlrm-tiny", "--batch", "24"], 3),
        (["--tables", "64", "--schedule", "cpp"], 64),
    ],
)
def test_plans_are_valid(argv, world):
    j = job(argv, world)
    plans = [j.plan(r) for r in range(world)]
    sim = simulate(
        plans, cost=lambda r, op: op.model_seconds(150e12) if isinstance(op, Compute) else 0
    )
    assert sim.time > 0
    cfg = j.config
    S = -(-cfg["tables"] // world)
    assert cfg["table_slots"] == S
    count = world * S * cfg["local_batch"] * cfg["dim"]
    for p in plans:
        assert [op.count for op in collectives(p, "alltoall")] == [count, count]


def test_mlperf_times_scale_with_work():
    """Every rank's lookups take longer with more tables; MLP times scale with their FLOPs."""
    j = job(["--model", "mlperf"], 4)
    us = [
        {op.name: op.seconds * 1e6 for op in j.plan(r).ops if isinstance(op, Compute)}
        for r in range(4)
    ]
    assert [round(u["emb forward"] / FWD_EMB * 10) for u in us] == [
        7,
        7,
        6,
        6,
    ]  # tables x P=1 / P=10
    ratio = (13 * 512 + 512 * 256 + 256 * 128) / (3 * 128 * 128)
    assert us[0]["bottom forward"] == pytest.approx(FWD_BOT_MLP * ratio)


@pytest.mark.parametrize(
    "argv,world,words",
    [
        (TABLE + ["--model", "dlrm-tiny"], 8, ["4 embedding tables for 8 ranks", "--tables 8"]),
        (["--batch", "30"], 4, ["global batch 30 is not a multiple of the world size 4"]),
        (TABLE + ["--model", "mlperf"], 32, ["26 embedding tables for 32 ranks", "--sharding row"]),
        (
            TINY + ["--sharding", "column", "--column-shards", "3"],
            2,
            ["--column-shards 3 does not divide", "D = 8"],
        ),
        (
            TINY + ["--sharding", "column", "--column-shards", "2"],
            16,
            ["4 tables x 2 column shards = 8 shards for 16 ranks"],
        ),
        (
            TINY + ["--sharding", "column", "--batch", "64"],
            64,
            ["at most 32 column shards, fewer than 64 ranks"],
        ),
        (
            TINY + ["--sharding", "row", "--column-shards", "2"],
            2,
            ["--column-shards applies to --sharding column, not --sharding row"],
        ),
    ],
)
def test_bad_layouts_are_usage_errors(argv, world, words):
    with pytest.raises(UsageError) as e:
        job(argv, world)
    for w in words:
        assert w in str(e.value)


def test_max_rows_caps_tables_but_no_message():
    capped = job(["--model", "mlperf"], 4)
    full = job(["--model", "mlperf", "--max-rows", "0"], 4)
    assert max(capped.config["rows"]) == 1_000_000 and max(full.config["rows"]) == 39_979_771
    assert capped.config["rows_uncapped"] == full.config["rows"]
    assert capped.plan(0).bytes_by_category() == full.plan(0).bytes_by_category()


def test_auto_is_table_wise_while_every_rank_has_a_table_then_row_wise():
    assert job(["--model", "mlperf", "--batch", "2080"], 26).config["sharding"] == "table"
    assert job(["--model", "mlperf"], 32).config["sharding"] == "row"
    assert job(["--model", "dlrm-tiny", "--sharding", "column"], 4).config["column_shards"] == 1
    assert job(["--model", "dlrm-tiny", "--sharding", "column"], 16).config["column_shards"] == 4


def test_mlperf_row_wise_on_128_ranks_by_hand():
    """B = 2048, b = 16, NT = 26, D = 128, P = 1: TorchRec's row-wise messages."""
    j = job(["--model", "mlperf", "--sharding", "row", "--dry-run"], 128)
    plans = [j.plan(r) for r in range(128)]
    sim = simulate(
        plans, cost=lambda r, op: op.model_seconds(150e12) if isinstance(op, Compute) else 0
    )
    assert sim.time > 0
    for p in plans[::37]:
        colls = [
            (op.kind, op.buf, op.count, op.dtype, bool(op.req))
            for op in p.ops
            if isinstance(op, Collective) and op.group == "emb"
        ]
        assert colls == [
            ("alltoall", "emb_splits", 128 * 3, "int64", False),  # 3 per peer
            ("alltoall", "emb_lengths", 128 * 26 * 16, "int64", True),  # NT b per peer
            ("alltoallv", "emb_ids", 16 * 26 * 1, "int64", True),  # b NT P in all
            ("reduce_scatter", "emb_fwd", 2048 * 26 * 128, "float32", True),  # (B,NT,D)
            ("allgather", "emb_bwd", 2048 * 26 * 128, "float32", True),
        ]  # fmt: skip
        b = p.bytes_by_category()
        assert b["emb_input"] == 8 * (384 + 53_248 + 416) == 432_384
        assert b["emb_reduce_scatter"] == b["emb_allgather"] == 4 * 6_815_744 == 27_262_976
        names = [getattr(op, "name", "") for op in p.ops]
        assert names.index("emb input") < names.index("emb forward") < names.index("bottom forward")
    # every rank looks up 1/128 of the global batch's ids on average
    emb = {op.name: op for op in plans[0].ops if isinstance(op, Compute)}["emb forward"]
    assert emb.flops == pytest.approx(2048 * 26 * 1 * 128 / 128)


def test_mlperf_column_wise_on_128_ranks_by_hand():
    """K = 8 (the smallest divisor of 128 with 26 K >= 128): 208 shards of 16 columns, 2
    slots per rank (48 padded); (W,S,b,D/K) = 128 x 2 x 16 x 16 both ways."""
    j = job(["--model", "mlperf", "--sharding", "column"], 128)
    assert j.config["column_shards"] == 8 and j.config["table_slots"] == 2
    plans = [j.plan(r) for r in range(128)]
    simulate(plans, cost=lambda r, op: op.model_seconds(150e12) if isinstance(op, Compute) else 0)
    for p in plans:
        assert [op.count for op in collectives(p, "alltoall")] == [128 * 2 * 16 * 16] * 2
    # rank 0 holds shards 0 and 128 (table 0 columns 0-15, table 16 columns 0-15): 2/8 of
    # a table's lookups; rank 127 only shard 127
    flops = [
        {o.name: o for o in p.ops if isinstance(o, Compute)}["emb forward"].flops
        for p in (plans[0], plans[127])
    ]
    assert flops == [2048 * 2 * 16, 2048 * 1 * 16]
    assert "empty slot" in j.header[1] and "48 empty" in j.header[1]


def test_table_wise_plan_is_unchanged_by_the_option():
    for world in (1, 4):
        assert job(["--sharding", "table"], world).plan(0) == job([], world).plan(0)
    assert (
        job(["--model", "dlrm-tiny", "--sharding", "column", "--column-shards", "1"], 4).plan(1).ops
        == job(["--model", "dlrm-tiny"], 4).plan(1).ops
    )
