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

from proxies.core import cli, memory, runner
from proxies.core.grid import ProcessGrid
from proxies.core.plan import Compute, Plan
from proxies.dlrm import SPEC
from proxies.dlrm.config import PRESETS, DLRMConfig
from proxies.dlrm.data import Synthetic
from proxies.dlrm.memory import estimate as estimate_memory
from proxies.dlrm.model import DLRMShard
from proxies.dlrm.plans import TABLE_WISE, Layout, compute_ops, plan_ops  # noqa: F401 (tests use them)
from proxies.dlrm.sharding import owned_shards, row_range, slots

PROG = "proxies.dlrm"
DEFAULT_MODEL = "dnn-cpp-proxies"
DEFAULT_MAX_ROWS = 1_000_000

SHARDINGS = ("auto", "table", "column", "row")


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
        "--sharding",
        choices=SHARDINGS,
        default="auto",
        help="how the tables are placed: table = whole tables, table t on rank t %% world "
        "(needs tables >= ranks); column = every table's D columns cut into --column-shards "
        "shards placed like tables; row = every table's rows cut over all ranks (TorchRec's "
        "row-wise: ids all-to-all, pooled reduce-scatter, gradient all-gather; any world "
        "size); auto = table when there are at least as many tables as ranks, else row "
        "(default auto)",
    )
    p.add_argument(
        "--column-shards",
        type=cli.positive_int,
        metavar="K",
        help="with --sharding column: shards per table, dividing D (default: the smallest "
        "divisor of D that gives every rank a shard)",
    )
    p.add_argument(
        "--lr",
        type=cli.learning_rate,
        help=f"SGD learning rate, in (0, {cli.LR_MAX:g}] (default: the preset's)",
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


# -- the runtime -----------------------------------------------------------------------------


class DLRMRuntime:
    """Buffers and compute of one rank. The model's tables exist for compute real/replay
    only; the communication and gradient buffers always (model/none move them unchanged)."""

    def __init__(
        self,
        cfg: DLRMConfig,
        rank: int,
        world: int,
        seed: int,
        mode: str,
        dtype=np.float32,
        layout: Layout = TABLE_WISE,
    ):
        self.cfg, self.rank, self.world, self.mode = cfg, rank, world, mode
        self.B, self.b = cfg.batch, cfg.batch // world
        self.model = DLRMShard(
            cfg, rank, world, seed, dtype, mode in ("real", "replay"), layout.kind, layout.columns
        )
        m, emb = self.model, self.model.emb
        self.data = m.data
        self.buffers = dict(emb.buffers)
        for name, mlp in (("top", m.top), ("bottom", m.bottom)):
            self.buffers[f"grad:{name}"] = mlp.grads
            for l in range(len(mlp.layers)):
                self.buffers[f"grad:{name}.{l}"] = mlp.grad(l)
        self.kernels = {
            "emb input": lambda it: emb.input(it),
            "emb forward": lambda it: emb.forward(it),
            "bottom forward": self._bottom_forward,
            "interaction forward": lambda it: m.interaction_forward(),
            "top forward": self._top_forward,
            "interaction backward": lambda it: m.interaction_backward(),
            "emb backward": lambda it: emb.backward(cfg.lr),
            "optimizer": lambda it: m.step(cfg.lr),
        }
        for name, mlp, step in (
            ("top", m.top, m.top_backward),
            ("bottom", m.bottom, m.bottom_backward),
        ):
            for l in range(len(mlp.layers)):
                self.kernels[f"{name}.{l} backward"] = lambda it, l=l, step=step: step(l)
        self.loss_sum, self.loss_count = 0.0, 0

    def _bottom_forward(self, it: int) -> None:
        self.model.bottom_forward(self.data.dense(it * self.B + self.rank * self.b, self.b))

    def _top_forward(self, it: int) -> None:
        labels = self.data.labels(it * self.B + self.rank * self.b, self.b)
        self.loss_sum += self.model.top_forward(labels, 1.0 / self.B)
        self.loss_count += self.b

    def buffer(self, name: str, mb: int, chunk: int) -> np.ndarray:
        return self.buffers[name]

    def alltoallv(self, name: str, iteration: int):
        """Row-wise ids: (send, send counts, receive buffer, receive counts)."""
        return self.model.emb.alltoallv(name, iteration, real=self.mode == "real")

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


def choose_layout(args, cfg: DLRMConfig, world: int) -> Layout:
    """The sharding of --sharding / --column-shards, or a usage error."""
    NT, D, kind = cfg.tables, cfg.dim, args.sharding
    if args.column_shards and kind != "column":
        raise cli.UsageError(f"--column-shards applies to --sharding column, not --sharding {kind}")
    if kind == "auto":  # table-wise sends the least where it fits; row-wise fits any world
        kind = "table" if NT >= world else "row"
    if kind == "table" and NT < world:
        raise cli.UsageError(
            f"{NT} embedding tables for {world} ranks: table-wise sharding places whole "
            f"tables (table t on rank t % {world}) and every rank needs one; use at most "
            f"{NT} ranks, --tables {world} or more, or --sharding row or column"
        )
    if kind != "column":
        return Layout(kind)
    K = args.column_shards
    if K is None:  # the smallest split of D that gives every rank a shard
        K = next((k for k in range(1, D + 1) if D % k == 0 and NT * k >= world), None)
        if K is None:
            raise cli.UsageError(
                f"{NT} tables x D = {D} columns give at most {NT * D} column shards, fewer "
                f"than {world} ranks; use --sharding row"
            )
    if D % K:
        raise cli.UsageError(f"--column-shards {K} does not divide the embedding dimension D = {D}")
    if NT * K < world:
        raise cli.UsageError(
            f"{NT} tables x {K} column shards = {NT * K} shards for {world} ranks: every "
            f"rank needs one; use more --column-shards (dividing D = {D}) or --sharding row"
        )
    return Layout("column", K)


def describe_layout(layout: Layout, cfg: DLRMConfig, world: int) -> str:
    NT, D = cfg.tables, cfg.dim
    if layout.kind == "row":
        lo, hi = row_range(max(cfg.rows), world, 0)
        return (
            f"tables row-wise (every table's rows in {world} blocks of ceil(R / {world}), "
            f"rank 0 holds {hi - lo:,} rows of the largest)"
        )
    NS, S = layout.shards(cfg), slots(world, layout.shards(cfg))
    padding = world * S - NS
    what = (
        f"table t on rank t % {world}"
        if layout.kind == "table"
        else f"{NT} x {layout.columns} column shards of {D // layout.columns}, shard "
        f"u = t {layout.columns} + k on rank u % {world}"
    )
    return (
        f"tables {layout.kind}-wise ({what}, up to {S} per rank"
        + (f"; {padding} empty slot(s) sent as zero padding" if padding else "")
        + ")"
    )


def describe_messages(layout: Layout, cfg: DLRMConfig, world: int) -> str:
    n = layout.messages(cfg, world)
    if layout.kind != "row":
        a2a = n["alltoall"]
        return (
            f"embedding all-to-all {a2a:,} floats ({a2a * 4:,} B) forward and backward "
            f"({a2a // world:,} per peer)"
        )
    return (
        f"ids all-to-alls (int64): splits {n['splits']:,}, lengths {n['lengths']:,}, "
        f"ids {n['ids']:,} sent (split by owner as the data falls); pooled reduce-scatter "
        f"{n['reduce_scatter']:,} floats ({n['reduce_scatter'] * 4:,} B) forward, gradient "
        f"all-gather {n['allgather']:,} floats backward"
    )


def make_job(args, world: int) -> runner.Job:
    memory.check_count("--tables", args.tables or 0, memory.MAX_TABLES, "plans are per table")
    cfg, uncapped = resolve(args)
    NT, B = cfg.tables, cfg.batch
    if B % world:
        raise cli.UsageError(
            f"global batch {B} is not a multiple of the world size {world} (the MLPs are "
            f"data-parallel: each rank trains batch / world samples); set --batch"
        )
    layout = choose_layout(args, cfg, world)
    grid = ProcessGrid.create("dp", dp=world)
    b = B // world
    S = slots(world, layout.shards(cfg))
    everyone = tuple(range(world))
    msgs = layout.messages(cfg, world)

    def plan(rank: int) -> Plan:
        ops = plan_ops(cfg, world, rank, args.schedule, args.model_times, layout)
        return Plan(rank, tuple(ops), {"dp": everyone, "emb": everyone}, {"dp": rank})

    def label(rank: int) -> str:
        if layout.kind == "row":
            return f"rank {rank}: rows of every table"
        mine = owned_shards(rank, world, layout.shards(cfg))
        shown = ",".join(map(str, mine[:6])) + (",..." if len(mine) > 6 else "")
        what = "table" if layout.kind == "table" else "shard"
        return f"rank {rank}: {len(mine)} {what}{'s' * (len(mine) != 1)} ({shown})"

    def runtime(rank, MPI, comms, mode):
        return DLRMRuntime(cfg, rank, world, args.seed, mode, layout=layout)

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
        "sharding": layout.kind,
        "column_shards": layout.columns,
        "table_slots": S if layout.kind != "row" else None,
        "alltoall_count": msgs.get("alltoall"),
        "messages": msgs,
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
    padding = world * S - layout.shards(cfg)
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
        f"grid: {world} ranks · MLPs data-parallel ({b} of the {B} samples per rank) · "
        f"{describe_layout(layout, cfg, world)} · schedule {args.schedule}",
        (
            f"messages per rank: {describe_messages(layout, cfg, world)}; gradient allreduce "
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
    return runner.Job(
        prog=PROG,
        proxy="dlrm",
        config=config,
        grid=grid,
        plan=plan,
        group_names=("dp", "emb"),
        label=label,
        header=header,
        runtime=runtime,
        dtypes=cli.wire_dtypes(args),
        grad_categories=frozenset({"dp_allreduce"}),  # the MLPs' (embeddings: all-to-all)
        # Replay measures on one rank per group and shares: fine when every rank holds as
        # many tables; otherwise each rank measures its own ops ("self" names no group).
        # Row-wise lookups depend on which ids fall in a rank's rows: each measures its own.
        replay_share="dp" if padding == 0 and layout.kind != "row" else "self",
        memory=lambda rank, plan: estimate_memory(
            cfg, rank, world, layout.kind, layout.columns, args.compute, plan
        ),
        categories=SPEC.categories,
        short=SPEC.short,
    )


def main(argv: list[str] | None = None) -> int:
    return runner.main(make_job, parser(), argv)


def entry() -> None:
    cli.run_main(PROG, main)
