"""The DLRM model without MPI: whole-model gradients against finite differences, and the
plans of 1..4 ranks run in lockstep in one process (collectives done with NumPy) training
exactly like one rank, in float64."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import check

from proxies.core.plan import Collective, Compute, Wait
from proxies.dlrm.plans import Layout
from proxies.dlrm.proxy import DLRMRuntime, make_job, parser, resolve

TINY = ["--model", "dlrm-tiny"]


def setup(argv: list[str], world: int, dtype=np.float64):
    args = parser().parse_args(argv)
    job = make_job(args, world)
    cfg, _ = resolve(args)
    layout = Layout(job.config["sharding"], job.config["column_shards"])
    runtimes = [DLRMRuntime(cfg, r, world, args.seed, "real", dtype, layout) for r in range(world)]
    return cfg, [job.plan(r) for r in range(world)], runtimes


def collective(op: Collective, bufs: list[np.ndarray], runtimes, it: int) -> None:
    """What MPI does, on the ranks' buffers in place (alltoallv: into the runtimes')."""
    W = len(bufs)
    if op.kind == "alltoallv":
        v = [rt.alltoallv(op.buf, it) for rt in runtimes]
        blocks = [np.split(send, np.cumsum(sc)[:-1]) for send, sc, _, _ in v]
        for r, (_, _, recv, rcounts) in enumerate(v):
            assert [blocks[j][r].size for j in range(W)] == list(rcounts)
            recv[...] = np.concatenate([blocks[j][r] for j in range(W)])
    elif op.kind == "reduce_scatter":  # block r of rank r <- the sum of every rank's block r
        total = sum(b.copy() for b in bufs)
        for r, b in enumerate(bufs):
            b.reshape(W, -1)[r] = total.reshape(W, -1)[r]
    elif op.kind == "allgather":  # block j of every rank <- block j of rank j
        for j, src in enumerate(bufs):
            for b in bufs:
                b.reshape(W, -1)[j] = src.reshape(W, -1)[j]
    elif op.kind == "alltoall":  # block j of rank r <- block r of rank j
        sent = [b.reshape(W, -1).copy() for b in bufs]
        for r, b in enumerate(bufs):
            b.reshape(W, -1)[...] = [sent[j][r] for j in range(W)]
    elif op.kind == "allreduce":
        total = sum(b.copy() for b in bufs)
        for b in bufs:
            b[...] = total
    else:
        raise AssertionError(op.kind)


def lockstep(argv: list[str], world: int, iters: int, dtype=np.float64, out=None) -> list[float]:
    """Every rank's plan, op by op; a non-blocking collective happens at its Wait, and its
    buffers must be untouched between its start and its Wait (MPI's rule)."""
    cfg, plans, runtimes = setup(argv, world, dtype)
    assert len({len(p.ops) for p in plans}) == 1
    losses = []
    for it in range(iters):
        pending = {}
        for i in range(len(plans[0].ops)):
            op = plans[0].ops[i]
            if isinstance(op, Compute):
                for p, rt in zip(plans, runtimes, strict=True):
                    rt.compute(p.ops[i], it)
            elif isinstance(op, Collective):
                bufs = [rt.buffer(op.buf, op.mb, 0) for rt in runtimes]
                if op.req:
                    pending[op.req] = (op, bufs, [b.copy() for b in bufs])
                else:
                    collective(op, bufs, runtimes, it)
            elif isinstance(op, Wait):
                coll, bufs, snapshot = pending.pop(op.req)
                for b, s in zip(bufs, snapshot, strict=True):
                    assert np.array_equal(b, s), f"{coll.buf} changed while in flight"
                collective(coll, bufs, runtimes, it)
        assert not pending
        total = np.sum([rt.finish_iteration(it) for rt in runtimes], axis=0)
        losses.append(total[0] / total[1])
    if out is not None:
        out.extend(runtimes)
    return losses


@pytest.mark.parametrize("schedule", ["overlap", "cpp"])
def test_every_world_size_trains_like_one_rank(schedule):
    ref = lockstep(TINY + ["--schedule", schedule], 1, 4)
    assert ref[0] == pytest.approx(0.80, abs=0.05)  # above ln 2: the init is not calibrated
    for world in (2, 3, 4):  # 3: four tables on three ranks, two empty slots padded
        got = lockstep(TINY + ["--batch", "24", "--schedule", schedule], world, 4)
        want = lockstep(TINY + ["--batch", "24"], 1, 4)
        assert got == pytest.approx(want, rel=1e-12), world
    assert lockstep(TINY + ["--schedule", schedule], 4, 4) == pytest.approx(ref, rel=1e-12)


def test_more_tables_than_ranks_and_float32():
    argv = TINY + ["--tables", "7", "--pooling", "3"]
    want = lockstep(argv, 1, 3)
    assert lockstep(argv, 4, 3) == pytest.approx(want, rel=1e-12)  # 2, 2, 2, 1 tables
    assert lockstep(argv, 4, 3, np.float32) == pytest.approx(want, rel=1e-5)


def test_training_lowers_the_loss():
    losses = lockstep(TINY + ["--lr", "0.1"], 1, 150, np.float32)
    assert np.mean(losses[-30:]) < np.mean(losses[:30]) - 0.05


def test_gradients_match_finite_differences():
    """One rank, float64: the MLP gradients, and the tables' sparse SGD step / lr, against
    centered differences of the loss of one global batch."""
    cfg, (plan,), (rt,) = setup(TINY + ["--pooling", "3"], 1)
    m = rt.model
    rng = np.random.default_rng(0)
    # move the biases off zero-ish inits so every ReLU path carries signal
    for mlp in (m.bottom, m.top):
        mlp.params += 0.1 * rng.standard_normal(mlp.params.size)
    for t in m.tables.values():
        t += 0.3 * rng.standard_normal(t.shape)
    forward = [op for op in plan.ops if op.name.endswith("forward")]

    def loss() -> float:
        for op in forward:
            rt.compute(op, 0)
        s, count = rt.finish_iteration(0)
        return s / count

    before = {t: tab.copy() for t, tab in m.tables.items()}
    for op in plan.ops:
        if isinstance(op, Compute) and op.name != "optimizer":
            rt.compute(op, 0)  # includes "emb backward": the sparse SGD step of every table
    rt.finish_iteration(0)
    dtables = {t: (before[t] - m.tables[t]) / cfg.lr for t in m.tables}
    for t, tab in m.tables.items():
        tab[...] = before[t]

    for name, mlp in (("bottom", m.bottom), ("top", m.top)):
        for i in rng.choice(mlp.params.size, 40, replace=False):
            old = mlp.params[i]
            mlp.params[i] = old + 1e-6
            fp = loss()
            mlp.params[i] = old - 1e-6
            fm = loss()
            mlp.params[i] = old
            check(f"{name} param {i}", mlp.grads[i], (fp - fm) / 2e-6, atol=1e-8, rtol=1e-5)
    for t, tab in m.tables.items():
        used = np.unique(rt.data.sparse(0, cfg.batch, t))
        for row in rng.choice(used, min(4, used.size), replace=False):
            for col in range(cfg.dim):
                old = tab[row, col]
                tab[row, col] = old + 1e-6
                fp = loss()
                tab[row, col] = old - 1e-6
                fm = loss()
                tab[row, col] = old
                check(
                    f"table {t} [{row},{col}]", dtables[t][row, col], (fp - fm) / 2e-6, 1e-8, 1e-5
                )
        unused = np.setdiff1d(np.arange(tab.shape[0]), used)
        assert not dtables[t][unused].any()  # sparse: untouched rows do not move


def whole_tables(runtimes) -> dict[int, np.ndarray]:
    """Every table reassembled from the ranks' shards (row blocks, column shards, whole)."""
    parts: dict[int, list] = {}
    for rt in runtimes:
        emb = rt.model.emb
        for key, shard in sorted(emb.tables.items()):
            if hasattr(emb, "ranges"):  # row-wise: key t, rows [lo, hi)
                parts.setdefault(key, []).append((emb.ranges[key][0], 0, shard))
            else:  # column shard u = t K + k (K = 1: the table)
                t, k = divmod(key, emb.K)
                parts.setdefault(t, []).append((0, k * emb.Dk, shard))
    out = {}
    for t, ps in parts.items():
        R = max(lo + s.shape[0] for lo, _, s in ps)
        D = max(c + s.shape[1] for _, c, s in ps)
        out[t] = np.full((R, D), np.nan)
        for lo, c, s in ps:
            out[t][lo : lo + s.shape[0], c : c + s.shape[1]] = s
    return out


@pytest.mark.parametrize(
    "sharding", [["--sharding", "row"], ["--sharding", "column", "--column-shards", "2"]]
)
@pytest.mark.parametrize("schedule", ["overlap", "cpp"])
def test_sharded_model_trains_like_the_unsharded_one(sharding, schedule):
    """Row-wise and column-wise on 1..4 ranks (3: rows and batch 24 not divisible alike,
    tables of 50 rows in blocks of 17, 17, 16) against one rank holding whole tables: the
    same losses and, after 3 SGD steps, the same tables, in float64."""
    argv = TINY + ["--batch", "24", "--pooling", "3", "--schedule", schedule]
    ref_rt: list = []
    want = lockstep(argv + ["--sharding", "table"], 1, 3, out=ref_rt)
    ref = whole_tables(ref_rt)
    for world in (1, 2, 3, 4):
        got_rt: list = []
        got = lockstep(argv + sharding, world, 3, out=got_rt)
        assert got == pytest.approx(want, rel=1e-12), world
        tables = whole_tables(got_rt)
        for t in ref:
            np.testing.assert_allclose(tables[t], ref[t], rtol=1e-12, atol=1e-15)
        if sharding[1] == "row":  # every rank moved its own rows only, some of them
            assert sum(rt.model.emb.tables[0].shape[0] for rt in got_rt) == 50


def test_row_wise_float32_and_more_ranks_than_tables():
    """8 ranks for 4 tables, float32: within float32 rounding of one rank (the partial sums
    are added in another order)."""
    argv = TINY + ["--pooling", "3"]
    want = lockstep(argv, 1, 3)
    assert lockstep(argv + ["--sharding", "row"], 8, 3, np.float32) == pytest.approx(want, rel=1e-5)
