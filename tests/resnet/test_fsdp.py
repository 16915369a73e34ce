"""ResNet --fsdp without MPI: units and padded layout, the plan against hand arithmetic
(2 gathers + 1 reduce-scatter of each padded unit, prefetch one ahead), the shards really
gathered (a missing or partial gather spoils the loss), the memory estimate about 1/dp,
bad input refused."""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys

import numpy as np
import pytest

from proxies.core import cli
from proxies.core.plan import Collective, Compute, Wait
from proxies.core.simulate import simulate
from proxies.resnet.config import PRESETS
from proxies.resnet.fsdp import ResNetShards, shard_units
from proxies.resnet.model import ResNetModel, batch, layout
from proxies.resnet.plans import pieces
from proxies.resnet.proxy import make_job, parser

TINY = PRESETS["resnet-tiny"]


def job(*argv: str, world: int = 4):
    return make_job(parser().parse_args(list(argv)), world)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_units_are_the_pieces_each_padded_to_a_multiple_of_n(n):
    offsets, total = layout(TINY, n)
    table = shard_units(TINY, n)
    assert [u.key for u, _, _ in table] == pieces(TINY)
    assert sum(u.size for u, _, _ in table) == TINY.num_params
    assert total == sum(u.padded(n) for u, _, _ in table)
    for u, lo, hi in table:
        assert lo % n == 0 and hi - lo == u.size and u.padded(n) % n == 0
    # backward order: the head first, the stem last, each range padded before the next
    spans = sorted((lo, lo + u.padded(n)) for u, lo, _ in table)
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert min(spans)[0] == next(lo for u, lo, _ in table if u.key == "head")
    if n == 1:  # no padding: the DDP layout
        assert offsets == ResNetModel(TINY).offsets


@pytest.mark.parametrize("world,shard", [(2, 2), (4, 4), (4, 2)])
def test_plan_gathers_twice_and_reduce_scatters_once_per_unit(world, shard):
    args = ["--fsdp"] + (["--fsdp-shard-size", str(shard)] if shard != world else [])
    j = job(*args, world=world)
    units = [u for u, _, _ in shard_units(TINY, shard)]
    padded = sum(u.padded(shard) for u in units)
    for rank in range(world):
        plan = j.plan(rank)
        colls = [o for o in plan.ops if isinstance(o, Collective)]
        ag = [o for o in colls if o.kind == "allgather"]
        rs = [o for o in colls if o.kind == "reduce_scatter"]
        ar = [o for o in colls if o.kind == "allreduce"]
        assert sum(o.count for o in ag) == 2 * padded
        assert sum(o.count for o in rs) == padded
        assert sorted(o.mb for o in ag) == sorted(2 * list(range(len(units))))
        assert all(o.group == "fsdp" and o.req for o in ag + rs)
        assert len(plan.groups["fsdp"]) == shard and rank in plan.groups["fsdp"]
        if shard < world:  # HSDP: each reduced shard allreduced over the replicas
            assert [o.count for o in ar] == [u.shard(shard) for u in reversed(units)]
            assert plan.groups["hsdp"] == tuple(range(rank % shard, world, shard))
        else:
            assert ar == [] and "hsdp" not in plan.groups
    simulate([j.plan(r) for r in range(world)])  # every collective matched


def test_prefetch_one_ahead_and_reduce_scatter_after_each_backward():
    ops = job("--fsdp", world=2).plan(0).ops
    names = [o.name if isinstance(o, Compute) else o for o in ops]
    fwd = [i for i, o in enumerate(ops) if isinstance(o, Compute) and o.name.endswith(".forward")]
    gathers = [i for i, o in enumerate(ops) if isinstance(o, Collective) and o.kind == "allgather"]
    # forward: unit j+1's gather is posted before unit j's compute (after the first two)
    for j, i in enumerate(fwd[:-1]):
        assert gathers[j + 1] < i
    for p in pieces(TINY):  # a piece's compute between its unshard and its reshard
        k = names.index(f"{p}.forward")
        assert names[k - 1] == f"fsdp_unshard:{p}" and names[k + 1] == f"fsdp_reshard:{p}"
        k = names.index(f"{p}.backward")
        assert names[k - 1] == f"fsdp_unshard:{p}" and names[k + 1] == f"fsdp_reshard:{p}"
        nxt = ops[k + 2] if isinstance(ops[k + 2], Collective) else ops[k + 3]
        assert nxt.kind == "reduce_scatter" and nxt.mb == pieces(TINY).index(p)
    assert isinstance(ops[-1], Compute) and ops[-1].name == "optimizer"
    assert all(isinstance(o, Wait) for o in ops[-3:-1])  # the last two reduce-scatters
    shard = sum(u.shard(2) for u, _, _ in shard_units(TINY, 2))
    assert ops[-1].flops == 5.0 * shard  # SGD on the shard only


def forward_loss(model, cfg) -> float:
    x, y = batch(cfg, 0, 0, 2)
    for p in pieces(cfg)[:-1]:
        x = model.forward_piece(p, x)
    return model.forward_piece("head", x, y)


def test_the_shards_are_really_gathered():
    """Two ranks' shards (one process): the gather fills only this rank's block; with the
    other rank's block copied in as the all-gather would, the forward is the unsharded
    model's; without it, or without any gather, the loss is spoilt."""
    cfg = dataclasses.replace(TINY, image_size=16)
    want = forward_loss(ResNetModel(cfg), cfg)
    ranks = [ResNetShards(cfg, ResNetModel(cfg, pad=2), 2, r) for r in range(2)]
    a, b = ranks
    assert not np.isfinite(forward_loss(a.model, cfg))  # nothing gathered: NaN

    for i in range(len(a.table)):
        a.buffer("fsdp_ag0", i)  # this rank's block only
    assert not np.isfinite(forward_loss(a.model, cfg))  # half the parameters

    for i in range(len(a.table)):
        k = a.table[i][0].shard(2)  # rank 1's block, as MPI's in-place all-gather
        a._range(a.model.params, i)[k:] = b.shards[i]
    assert forward_loss(a.model, cfg) == pytest.approx(want, rel=1e-6)

    for i in range(len(a.table)):
        a.compute(f"fsdp_reshard:{a.table[i][0].key}", i)
    assert np.isnan(a.model.params).any()  # freed: NaN where its pages are not given back


def test_reduced_shard_is_saved_and_the_unsharded_gradients_given_back():
    cfg = dataclasses.replace(TINY, image_size=16)
    sh = ResNetShards(cfg, ResNetModel(cfg, pad=2), 2, 1)
    u, lo, _ = sh.table[-1]
    k = u.shard(2)
    buf = sh.buffer("fsdp_rs0", len(sh.table) - 1)
    buf[:] = np.arange(buf.size)  # the reduce-scatter's result: block 1 at its place
    sh.buffer("fsdp_rs0", 0)  # the slot reused: the head's block saved first
    assert np.array_equal(sh.grads[-1], np.arange(k, 2 * k))
    assert not sh.model.grads[lo : lo + u.padded(2)].any()  # zeroed: the backward adds


def test_memory_about_one_over_dp_plus_the_gathered_units():
    n = 1024
    j = job("--model", "resnet152", "--fsdp", "--compute", "real", world=n)
    est = j.memory_estimate(0)
    units = [u for u, _, _ in shard_units(j_cfg(j), n)]
    shards = sum(u.shard(n) for u in units)
    two_largest = sum(sorted(u.padded(n) for u in units)[-2:])
    assert 4 * 2 * shards < est["parameters"] <= 4 * (2 * shards + two_largest)
    full = make_job(parser().parse_args(["--model", "resnet152", "--compute", "real"]), n)
    unsharded = full.memory_estimate(0)["parameters"]  # weights and momentum
    assert est["parameters"] < unsharded / 5
    # unsharded gradients: a unit's from its backward until its reduced block is saved,
    # when its slot's next reduce-scatter starts (2 in flight): at most three units at once
    three = sum(sorted(u.padded(n) for u in units)[-3:])
    assert 4 * shards < est["gradients"] <= 4 * (shards + three)
    assert est["gradients"] < full.memory_estimate(0)["gradients"] / 3


def j_cfg(j):
    return dataclasses.replace(
        PRESETS[j.config["model"]], image_size=j.config["image_size"], classes=j.config["classes"]
    )


BAD = [
    (["--fsdp"], 1, "--fsdp shards over the data-parallel group"),
    (["--fsdp-shard-size", "2"], 4, "--fsdp-shard-size 2 needs --fsdp"),
    (["--fsdp", "--fsdp-shard-size", "3"], 4, "must be at least 2 and divide"),
    (["--fsdp", "--fsdp-shard-size", "1"], 4, "must be at least 2 and divide"),
    (["--fsdp", "--grad-sync", "fused"], 4, "--fsdp does not combine with --grad-sync"),
    (["--fsdp", "--bucket-mb", "1"], 4, "--fsdp does not combine with --bucket-mb"),
    (["--model", "dnn-cpp-proxies-resnet50", "--fsdp"], 4, "--fsdp: --model dnn-cpp"),
    (["--model", "dnn-cpp-proxies-resnet152", "--fsdp"], 4, "--fsdp: --model dnn-cpp"),
]


@pytest.mark.parametrize("argv,world,words", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_input_refused(argv, world, words):
    with pytest.raises(cli.UsageError, match=words.replace("-", "\\-")):
        job(*argv, world=world)


@pytest.mark.slow
def test_resnet152_fsdp_dry_run_at_1024_ranks_and_bad_input_exit_2():
    base = [sys.executable, "-m", "proxies.resnet", "--model", "resnet152", "--fsdp"]
    r = subprocess.run(
        [*base, "--dry-run", "--world-size", "1024"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert "FSDP (ZeRO-3) over dp 1024: 52 units" in r.stdout.replace("\n", " ")
    r = subprocess.run(
        [*base, "--fsdp-shard-size", "3", "--dry-run", "--world-size", "8"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1
