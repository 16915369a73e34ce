"""The DLRM proxy: model-parallel embedding tables x data-parallel MLPs, real NumPy training.

    mpirun -n 4 python -m proxies.dlrm       # the C++ proxy's DLRM, 4 tables on 4 ranks

Every rank holds a replica of the bottom and top MLPs (data-parallel, b = B / W samples
each) and whole embedding tables (model-parallel, table t on rank t % W). One iteration
(letters as in config.py), in the default `overlap` schedule, as dlrm_s_pytorch runs it:

    emb forward           look up the owned tables for all B samples of the global batch
    alltoall  (start)     each rank gets every table's bags for its own b samples
    bottom forward        ... under the all-to-all
    wait alltoall
    interaction, top forward, loss
    top.L-1 .. top.0 backward     each layer's gradient allreduce starts right after it
    interaction backward
    alltoall  (start)     the bags' gradients go back to the tables' owners
    bottom.L-1 .. bottom.0 backward (allreduce per layer)
    wait alltoall
    emb backward          sparse gradients of the owned tables, SGD on the touched rows
    wait allreduces, SGD on the MLPs

The `cpp` schedule is the C++ proxy's (spcl/DNN-cpp-proxies dlrm.cpp): blocking all-to-alls,
the bottom MLP's forward after the exchange and its backward before it, and one allreduce
per MLP (top, then bottom).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np

from proxies.core import cli, runner
from proxies.core.grid import ProcessGrid
from proxies.core.plan import Collective, Compute, Op, Plan, Wait
from proxies.dlrm.config import PRESETS, DLRMConfig
from proxies.dlrm.data import Synthetic
from proxies.dlrm.model import DLRMShard, owned_tables, slots

PROG = "proxies.dlrm"
DEFAULT_MODEL = "dnn-cpp-proxies"
DEFAULT_MAX_ROWS = 1_000_000

# compute=model: the C++ proxy's per-kernel A100 times (us), measured for its configuration
# (dnn-cpp-proxies on 4 GPUs: b = 512, one table per rank). Forward of the bottom MLP, top
# MLP, interaction and embedding lookups; the backward takes 2x, 2x, 1x, 2x (dlrm.cpp).
CPP_US = {"bottom": 341.0, "top": 455.0, "interaction": 209.0, "emb": 95.0}
CPP_BACKWARD = {"bottom": 2.0, "top": 2.0, "interaction": 1.0, "emb": 2.0}
CPP_WORLD = 4


def parser() -> argparse.ArgumentParser:
    p = cli.Parser(
        prog=f"python -m {PROG}",
        description="DLRM training proxy: embedding tables model-parallel (table t on rank "
        "t % world), bottom and top MLPs data-parallel; real NumPy embedding bags, MLPs, dot "
        "interaction, sigmoid + BCE and SGD; the pooled embeddings and their gradients "
        "exchanged by all-to-all, the MLP gradients allreduced under the backward.",
    )
    p.add_argument(
        "--model",
        choices=sorted(PRESETS),
        default=DEFAULT_MODEL,
        help="preset: dnn-cpp-proxies is the C++ proxy's (4 tables x 80,000 x 128, bottom "
        "128-128-128-128, top 138-512-512-512-256-1, batch 2048); mlperf is MLPerf's "
        "(26 Criteo Terabyte tables, bottom 13-512-256-128, top 479-1024-1024-512-256-1); "
        f"dlrm-tiny is for tests (default {DEFAULT_MODEL})",
    )
    p.add_argument(
        "--batch",
        type=cli.positive_int,
        metavar="B",
        help="global batch in samples, a multiple of the world size (default: the preset's)",
    )
    p.add_argument(
        "--tables",
        type=cli.positive_int,
        metavar="N",
        help="embedding tables, at least the world size; rows cycle through the preset's "
        "(default: the preset's)",
    )
    p.add_argument(
        "--pooling",
        type=cli.positive_int,
        metavar="P",
        help="indices per sample per table, summed into one bag (default: the preset's)",
    )
    p.add_argument(
        "--max-rows",
        type=cli.nonneg_int,
        default=DEFAULT_MAX_ROWS,
        metavar="R",
        help="cap every table at R rows, as dlrm_s_pytorch's --max-ind-range; 0: no cap "
        f"(MLPerf's full tables take 96 GB). Rows change no message size (default "
        f"{DEFAULT_MAX_ROWS:,})",
    )
    p.add_argument(
        "--lr", type=cli.positive_float, help="SGD learning rate (default: the preset's)"
    )
    p.add_argument(
        "--schedule",
        choices=("overlap", "cpp"),
        default="overlap",
        help="overlap: all-to-alls non-blocking under the bottom MLP, one allreduce per "
        "layer started as its backward ends (dlrm_s_pytorch); cpp: the C++ proxy's order, "
        "blocking all-to-alls and one allreduce per MLP (default overlap)",
    )
    p.add_argument(
        "--model-times",
        choices=("cpp", "flops"),
        default="cpp",
        help="durations for --compute model: cpp = the C++ proxy's A100 times, scaled "
        "linearly with each op's work (exact for dnn-cpp-proxies on 4 ranks); flops = "
        "FLOPs / --device-tflops (default cpp)",
    )
    cli.add_common(p)
    return p


# -- work and time per compute op ------------------------------------------------------------


def mlp_flops(layers: list[tuple[int, int]], n: int) -> list[float]:
    """Forward FLOPs per layer for n samples: 2 per multiply-add (biases, ReLU not counted)."""
    return [2.0 * n * C * OC for C, OC in layers]


def interaction_flops(cfg: DLRMConfig, n: int) -> float:
    """The (F,F) Gram matrix of n samples, as one batched matmul."""
    return 2.0 * n * cfg.features**2 * cfg.dim


def emb_work(cfg: DLRMConfig, tables: int) -> float:
    """Adds of the lookups: each owned table, B bags of P rows of D."""
    return float(tables * cfg.batch * cfg.pooling * cfg.dim)


def reference_work() -> dict[str, float]:
    """Forward work of each kind in the configuration the C++ times were measured at."""
    ref = PRESETS["dnn-cpp-proxies"]
    b = ref.batch // CPP_WORLD
    return {
        "bottom": sum(mlp_flops(ref.bottom_layers, b)),
        "top": sum(mlp_flops(ref.top_layers, b)),
        "interaction": interaction_flops(ref, b),
        "emb": emb_work(ref, 1),
    }


def compute_ops(cfg: DLRMConfig, world: int, rank: int, times: str) -> dict[str, Compute]:
    """Every compute op of one rank, by name, with FLOPs and (times="cpp") A100 seconds."""
    b, ref = cfg.batch // world, reference_work()
    cpp = times == "cpp"

    def op(name: str, kind: str, flops: float, work: float, backward: bool) -> Compute:
        seconds = 0.0
        if cpp:
            factor = CPP_BACKWARD[kind] if backward else 1.0
            seconds = CPP_US[kind] * 1e-6 * factor * work / ref[kind]
        return Compute(name, flops=flops, seconds=seconds)

    emb = emb_work(cfg, len(owned_tables(rank, world, cfg.tables)))
    inter = interaction_flops(cfg, b)
    ops = [
        op("emb forward", "emb", emb, emb, False),
        op("interaction forward", "interaction", inter, inter, False),
        op("interaction backward", "interaction", 2 * inter, inter, True),
        op("emb backward", "emb", emb, emb, True),
    ]
    for mlp, layers in (("bottom", cfg.bottom_layers), ("top", cfg.top_layers)):
        fwd = mlp_flops(layers, b)
        ops.append(op(f"{mlp} forward", mlp, sum(fwd), sum(fwd), False))
        ops += [op(f"{mlp}.{l} backward", mlp, 2 * f, f, True) for l, f in enumerate(fwd)]
    # SGD is not in the C++ proxy's times: zero there; 2 FLOPs per MLP parameter otherwise.
    ops.append(Compute("optimizer", flops=0.0 if cpp else 2.0 * cfg.mlp_params))
    return {o.name: o for o in ops}


# -- the plan --------------------------------------------------------------------------------


def alltoall_count(cfg: DLRMConfig, world: int) -> int:
    """Elements of each all-to-all on every rank: (W,S,b,D), S the most tables per rank."""
    return world * slots(world, cfg.tables) * (cfg.batch // world) * cfg.dim


def plan_ops(cfg: DLRMConfig, world: int, rank: int, schedule: str, times: str) -> list[Op]:
    c = compute_ops(cfg, world, rank, times)
    comm, overlap = world > 1, schedule == "overlap"
    a2a = alltoall_count(cfg, world)
    mlps = {"top": cfg.top_layers, "bottom": cfg.bottom_layers}
    ops: list[Op] = []
    waits: list[Wait] = []

    def alltoall(buf: str) -> None:
        if comm:
            ops.append(Collective("alltoall", "emb", buf, a2a, req=buf if overlap else ""))

    def backward(mlp: str) -> None:
        sizes = DLRMConfig.layer_params(mlps[mlp])
        for l in reversed(range(len(sizes))):
            ops.append(c[f"{mlp}.{l} backward"])
            if comm and overlap:  # this layer's gradients are final: start their allreduce
                ops.append(
                    Collective("allreduce", "dp", f"grad:{mlp}.{l}", sizes[l], req=f"{mlp}.{l}")
                )
                waits.append(Wait(f"{mlp}.{l}"))
        if comm and not overlap:
            ops.append(Collective("allreduce", "dp", f"grad:{mlp}", sum(sizes), req=mlp))
            waits.append(Wait(mlp))

    # forward
    ops.append(c["emb forward"])
    alltoall("emb_fwd")
    ops.append(c["bottom forward"])
    if comm and overlap:
        ops.append(Wait("emb_fwd"))
    ops += [c["interaction forward"], c["top forward"]]
    # backward
    backward("top")
    ops.append(c["interaction backward"])
    if overlap:
        alltoall("emb_bwd")
    backward("bottom")
    if comm and overlap:
        ops.append(Wait("emb_bwd"))
    if not overlap:
        alltoall("emb_bwd")
    ops.append(c["emb backward"])
    ops += waits
    ops.append(c["optimizer"])
    return ops


# -- the runtime -----------------------------------------------------------------------------


class DLRMRuntime:
    """Buffers and compute of one rank. The model's tables exist for compute real/replay
    only; the all-to-all and gradient buffers always (model/none move them unchanged)."""

    def __init__(
        self,
        cfg: DLRMConfig,
        rank: int,
        world: int,
        seed: int,
        mode: str,
        dtype=np.float32,
    ):
        self.cfg, self.rank, self.world = cfg, rank, world
        self.B, self.b = cfg.batch, cfg.batch // world
        self.model = DLRMShard(cfg, rank, world, seed, dtype, tables=mode in ("real", "replay"))
        self.data = Synthetic(seed, cfg.dense, cfg.rows, cfg.pooling)
        shape = (world, slots(world, cfg.tables), self.b, cfg.dim)
        self.buffers = {"emb_fwd": np.zeros(shape, dtype), "emb_bwd": np.zeros(shape, dtype)}
        m = self.model
        for name, mlp in (("top", m.top), ("bottom", m.bottom)):
            self.buffers[f"grad:{name}"] = mlp.grads
            for l in range(len(mlp.layers)):
                self.buffers[f"grad:{name}.{l}"] = mlp.grad(l)
        self.kernels = {
            "emb forward": self._emb_forward,
            "bottom forward": self._bottom_forward,
            "interaction forward": lambda it: m.interaction_forward(self.buffers["emb_fwd"]),
            "top forward": self._top_forward,
            "interaction backward": lambda it: m.interaction_backward(self.buffers["emb_bwd"]),
            "emb backward": lambda it: m.emb_backward(self.buffers["emb_bwd"], cfg.lr),
            "optimizer": lambda it: m.step(cfg.lr),
        }
        for name, mlp, step in (
            ("top", m.top, m.top_backward),
            ("bottom", m.bottom, m.bottom_backward),
        ):
            for l in range(len(mlp.layers)):
                self.kernels[f"{name}.{l} backward"] = lambda it, l=l, step=step: step(l)
        self.loss_sum, self.loss_count = 0.0, 0

    def _emb_forward(self, it: int) -> None:
        g0 = it * self.B  # the iteration's global batch is samples g0 .. g0 + B - 1
        idx = {t: self.data.sparse(g0, self.B, t) for t in self.model.owned}
        self.model.emb_forward(self.buffers["emb_fwd"], idx)

    def _bottom_forward(self, it: int) -> None:
        self.model.bottom_forward(self.data.dense(it * self.B + self.rank * self.b, self.b))

    def _top_forward(self, it: int) -> None:
        labels = self.data.labels(it * self.B + self.rank * self.b, self.b)
        self.loss_sum += self.model.top_forward(labels, 1.0 / self.B)
        self.loss_count += self.b

    def buffer(self, name: str, mb: int, chunk: int) -> np.ndarray:
        return self.buffers[name]

    def compute(self, op: Compute, iteration: int) -> None:
        self.kernels[op.name](iteration)

    def finish_iteration(self, iteration: int) -> tuple[float, int]:
        out = (self.loss_sum, self.loss_count)
        self.loss_sum, self.loss_count = 0.0, 0
        return out


# -- the job ---------------------------------------------------------------------------------


def resolve(args) -> tuple[DLRMConfig, tuple[int, ...]]:
    """The preset with the options applied; also the rows before --max-rows."""
    cfg = PRESETS[args.model]
    if args.tables:
        cfg = cfg.with_tables(args.tables)
    cfg = replace(
        cfg,
        batch=args.batch or cfg.batch,
        pooling=args.pooling or cfg.pooling,
        lr=args.lr or cfg.lr,
    )
    return cfg.with_max_rows(args.max_rows), cfg.rows


def describe_rows(rows: tuple[int, ...]) -> str:
    if len(set(rows)) == 1:
        return f"{len(rows)} x {rows[0]:,} rows"
    return f"{len(rows)} tables, {min(rows):,}..{max(rows):,} rows ({sum(rows):,} in all)"


def make_job(args, world: int) -> runner.Job:
    cfg, uncapped = resolve(args)
    NT, B = cfg.tables, cfg.batch
    if NT < world:
        raise cli.UsageError(
            f"{NT} embedding tables for {world} ranks: tables are model-parallel (whole "
            f"tables, table t on rank t % {world}) and every rank needs one; use at most "
            f"{NT} ranks or --tables {world} or more"
        )
    if B % world:
        raise cli.UsageError(
            f"global batch {B} is not a multiple of the world size {world} (the MLPs are "
            f"data-parallel: each rank trains batch / world samples); set --batch"
        )
    grid = ProcessGrid.create("dp", dp=world)
    S, b = slots(world, NT), B // world
    everyone = tuple(range(world))
    a2a = alltoall_count(cfg, world)

    def plan(rank: int) -> Plan:
        ops = plan_ops(cfg, world, rank, args.schedule, args.model_times)
        return Plan(rank, tuple(ops), {"dp": everyone, "emb": everyone}, {"dp": rank})

    def label(rank: int) -> str:
        mine = owned_tables(rank, world, NT)
        shown = ",".join(map(str, mine[:6])) + (",..." if len(mine) > 6 else "")
        return f"rank {rank}: {len(mine)} table{'s' * (len(mine) != 1)} ({shown})"

    def runtime(rank, MPI, comms, mode):
        return DLRMRuntime(cfg, rank, world, args.seed, mode)

    capped = cfg.rows != uncapped
    config = {
        "model": args.model,
        "tables": NT,
        "rows": list(cfg.rows),
        "rows_uncapped": list(uncapped),
        "max_rows": args.max_rows,
        "dim": cfg.dim,
        "pooling": cfg.pooling,
        "dense": cfg.dense,
        "bottom_mlp": [cfg.dense, *cfg.bottom],
        "top_mlp": [cfg.interaction, *cfg.top],
        "interaction": cfg.interaction,
        "mlp_params": cfg.mlp_params,
        "embedding_params": cfg.embedding_params,
        "global_batch": B,
        "local_batch": b,
        "dp": world,
        "table_slots": S,
        "alltoall_count": a2a,
        "schedule": args.schedule,
        "model_times": args.model_times,
        "compute": args.compute,
        "lr": cfg.lr,
        "seed": args.seed,
        "iters": args.iters,
        "warmup": args.warmup,
        "data": "synthetic",
        "check": args.check,
        "allreduce": args.allreduce,
        "device_tflops": args.device_tflops,
    }
    padding = world * S - NT
    top = "-".join(map(str, [cfg.interaction, *cfg.top]))
    bottom = "-".join(map(str, [cfg.dense, *cfg.bottom]))
    source = Synthetic(args.seed, cfg.dense, cfg.rows, cfg.pooling)
    sizes = [DLRMConfig.layer_params(cfg.top_layers), DLRMConfig.layer_params(cfg.bottom_layers)]
    header = [
        f"[bold]{PROG}[/] · {args.model}: {describe_rows(cfg.rows)} x D={cfg.dim}"
        + (
            f" (capped at --max-rows {args.max_rows:,}; preset {describe_rows(uncapped)})"
            if capped
            else ""
        )
        + f", {cfg.pooling} index(es) per bag · bottom MLP {bottom} · dot interaction of "
        f"{cfg.features} vectors · top MLP {top} · {cfg.mlp_params:,} MLP + "
        f"{cfg.embedding_params:,} embedding parameters",
        f"grid: {world} ranks · MLPs data-parallel ({b} of the {B} samples per rank) · tables "
        f"model-parallel (table t on rank t % {world}, up to {S} per rank"
        + (f"; {padding} empty slot(s) sent as zero padding" if padding else "")
        + f") · schedule {args.schedule}",
        (
            f"messages per rank: embedding all-to-all {a2a:,} floats ({a2a * 4:,} B) forward "
            f"and backward ({a2a // world:,} per peer); gradient allreduce "
            + (
                f"per layer as issued, top {'/'.join(f'{n:,}' for n in reversed(sizes[0]))}, "
                f"bottom {'/'.join(f'{n:,}' for n in reversed(sizes[1]))} floats"
                if args.schedule == "overlap"
                else f"per MLP, top {sum(sizes[0]):,}, bottom {sum(sizes[1]):,} floats"
            )
            if world > 1
            else "messages: none on 1 rank (no all-to-all, no allreduce)"
        ),
        f"data: {source.describe()} · lr {cfg.lr:g} · iterations {args.warmup} warm-up + "
        f"{args.iters} timed",
    ]
    job = runner.Job(
        PROG,
        "dlrm",
        config,
        grid,
        plan,
        ("dp", "emb"),
        label,
        header,
        runtime,
        dtypes=cli.wire_dtypes(args),
        grad_categories=frozenset({"dp_allreduce"}),  # the MLPs' (embeddings: all-to-all)
    )
    # Replay measures on one rank per group and shares: fine when every rank holds as many
    # tables; otherwise each rank measures its own ops ("self" names no group).
    job.replay_share = "dp" if padding == 0 else "self"
    return job


def main(argv: list[str] | None = None) -> int:
    return runner.main(make_job, parser(), argv)


def entry() -> None:
    cli.run_main(PROG, main)
