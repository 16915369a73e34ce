"""CosmoFlow sharded == unsharded, without MPI: every rank's plan is run in one process in
lockstep (halos copied, collectives done with NumPy) in float64, so the halo geometry, the
dense slices and the feature order are checked exactly; the multi-rank tests repeat this
through MPI in float32."""

from __future__ import annotations

import numpy as np
import pytest

from proxies.core import check
from proxies.core.plan import P2P, Collective, Compute, Wait
from proxies.cosmoflow.config import PRESETS, CosmoFlowConfig
from proxies.cosmoflow.proxy import make_job, parser


def run_in_process(world: int, argv: list[str], iters: int = 3) -> list[float]:
    """Losses of `iters` iterations of the plans of `world` ranks, executed in lockstep."""
    job = make_job(parser().parse_args([*argv, "--compute", "real"]), world)
    plans = [job.plan(r) for r in range(world)]
    rts = [job.runtime(r, None, None, "real", dtype=np.float64) for r in range(world)]
    n = len(plans[0].ops)
    assert all(len(p.ops) == n for p in plans)
    losses = []
    for it in range(iters):
        for i in range(n):
            ops = [p.ops[i] for p in plans]
            op = ops[0]
            assert all(type(o) is type(op) for o in ops)
            if isinstance(op, Compute):
                for r, rt in enumerate(rts):
                    rt.compute(ops[r], it)
            elif isinstance(op, P2P):
                sent = {
                    (r, m.peer, m.tag): rts[r].buffer(m.buf, m.mb, m.chunk).copy()
                    for r in range(world)
                    for m in ops[r].sends
                }
                for r in range(world):
                    for m in ops[r].recvs:
                        rts[r].buffer(m.buf, m.mb, m.chunk)[...] = sent.pop((m.peer, r, m.tag))
                assert not sent, f"unreceived messages {list(sent)}"
            elif isinstance(op, Collective):
                collective(plans, rts, ops)
            else:
                assert isinstance(op, Wait)  # collectives above completed at once
        losses.append(sum(rt.finish_iteration(it)[0] for rt in rts))
    return losses


def collective(plans, rts, ops) -> None:
    groups = {plans[r].groups[op.group] for r, op in enumerate(ops)}
    for members in groups:
        bufs = [rts[r].buffer(ops[r].buf, ops[r].mb, 0) for r in members]
        kind, g = ops[members[0]].kind, len(members)
        blocks = [check.blocks(b, g, ops[r].unit) for r, b in zip(members, bufs, strict=True)]
        if kind == "allreduce":
            total = np.sum(bufs, axis=0)
            for b in bufs:
                b[...] = total
        elif kind == "allgather":  # block j from member j, as the engine splits the array
            for b in blocks:
                for j in range(g):
                    b[j][...] = blocks[j][j]
        elif kind == "reduce_scatter":
            for j in range(g):
                blocks[j][j][...] = np.sum([b[j] for b in blocks], axis=0)
        else:
            raise AssertionError(kind)


# A large learning rate: later losses then depend strongly on the gradients.
TINY = ["--model", "cosmoflow-tiny", "--global-batch", "2", "--lr", "0.01"]


@pytest.fixture(scope="module")
def reference():
    return run_in_process(1, [*TINY, "--shards", "1"])


@pytest.mark.parametrize(
    "world,argv",
    [
        (2, ["--shards", "1x2"]),  # W split: w/e faces
        (4, ["--shards", "2x1", "--order", "dp-sp"]),  # H split, 2 replicas, far apart
        (8, ["--shards", "2x2"]),  # faces and diagonals, 2 replicas
    ],
    ids=str,
)
def test_sharded_equals_unsharded(reference, world, argv):
    got = run_in_process(world, [*TINY, *argv])
    assert got == pytest.approx(reference, rel=1e-10)


# Grids whose shards do not divide the dense widths 16-6-4 (uneven column slices, shards
# without any column of a layer), each with the dense layers split and replicated.
@pytest.mark.parametrize("dense", ["split", "replicate"])
@pytest.mark.parametrize(
    "world,argv",
    [
        (8, ["--shards", "2x4"]),  # dense1 6 columns: 1 on shards 0-5, 0 on 6-7
        (8, ["--shards", "4x2"]),
        (16, ["--shards", "4x4"]),  # dense1 and dense2 on shards 0-5 / 0-3 only
        (16, ["--shards", "2x4", "--order", "dp-sp"]),  # and 2 replicas of 1 sample
        (4, ["--shards", "2x2"]),  # 6 columns: 2, 2, 1, 1
    ],
    ids=str,
)
def test_any_grid_equals_unsharded(reference, world, argv, dense):
    got = run_in_process(world, [*TINY, *argv, "--dense", dense])
    assert got == pytest.approx(reference, rel=1e-10)


def test_interior_shards_with_every_neighbour(monkeypatch):
    """3x2 shards: the middle row has neighbours on every side and diagonal."""
    cfg = CosmoFlowConfig(
        "test-3x2", volume=(4, 12, 8), in_channels=2, filters=(3, 4), dense=(6, 6), batch=2
    )
    monkeypatch.setitem(PRESETS, cfg.name, cfg)
    argv = ["--model", cfg.name, "--global-batch", "2"]
    ref = run_in_process(1, [*argv, "--shards", "1"])
    assert run_in_process(6, [*argv, "--shards", "3x2"]) == pytest.approx(ref, rel=1e-10)
    assert run_in_process(12, [*argv, "--shards", "3x2"]) == pytest.approx(ref, rel=1e-10)
