"""The GPT-2 proxy: pipeline x data parallelism with real NumPy training.

    mpirun -n 32 python -m proxies.gpt2 64 8      # 64 layers, 8 stages, DP = 32 / 8 = 4

Each rank holds one stage (a contiguous run of layers; stage 0 also the embeddings, the
last stage the final layernorm and the tied LM head) of one data-parallel replica. One
iteration: the pipeline schedule over M micro-batches (activations forward, activation
gradients backward), then the stage's gradients allreduced in its data-parallel group (one
fused buffer by default; or, with --grad-sync buckets, bucket by bucket while the last
micro-batch's backward still runs, as PyTorch DDP), then the tied token-embedding gradient
summed between the first and last stage (Megatron's embedding group), then AdamW.

--schedule cpp (the default of --model dnn-cpp-proxies) is instead the C++ proxy's iteration
message for message: no compute, one allreduce per layer, no embedding allreduce (cpp.py).
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict

import numpy as np

from proxies.core import cli, memory, runner
from proxies.core.grid import ProcessGrid
from proxies.core.pipeline import pipeline_ops
from proxies.core.plan import Collective, Compute, Plan, Wait, block_range
from proxies.core.schedules import SCHEDULES
from proxies.gpt2 import SPEC, cpp
from proxies.transformer.config import (
    PRESETS,
    GPT2Config,
    backward_pieces,
    layout_size,
    stage_flops,
    stage_layout,
)
from proxies.transformer.data import DataError, Synthetic, TokenFile, batch
from proxies.transformer.fast import adamw_update

PROG = "proxies.gpt2"
DEFAULT_MODEL = "gpt2-tiny"
MAX_TAG_MICROBATCHES = 16383  # pipeline tags stay below 32768, MPI's guaranteed minimum
DEFAULT_BUCKET_MB = 25.0  # PyTorch DDP's bucket_cap_mb
MAX_BUCKET_MB = 1e6  # a bucket past a TiB is one bucket


def parser() -> argparse.ArgumentParser:
    p = cli.Parser(
        prog=f"python -m {PROG}",
        description="GPT-2 training proxy: real NumPy forward/backward per pipeline stage, real "
        "activations and gradients over MPI, data-parallel gradient allreduce, AdamW. "
        "Arguments as the C++ proxy: LAYERS STAGES [MICROBATCHES].",
    )
    p.add_argument(
        "layers",
        type=cli.positive_int,
        nargs="?",
        metavar="LAYERS",
        help="transformer layers (default: the preset's depth)",
    )
    p.add_argument(
        "stages",
        type=cli.positive_int,
        nargs="?",
        default=1,
        metavar="STAGES",
        help="pipeline stages (default 1); data-parallel degree = world size / STAGES",
    )
    p.add_argument(
        "micro_batches",
        type=cli.positive_int,
        nargs="?",
        default=8,
        metavar="MICROBATCHES",
        help="micro-batches per iteration per replica (default 8, as the C++ proxy)",
    )
    p.add_argument(
        "--model",
        choices=sorted([*PRESETS, cpp.PRESET]),
        default=DEFAULT_MODEL,
        help=f"preset widths (default {DEFAULT_MODEL}: C=64, light enough for 32 ranks on 2 "
        f"cores; gpt2 is the 124M model, C=768); {cpp.PRESET}: the C++ proxy's GPT-2 "
        f"({cpp.WIDTHS} widths, 36 layers), whose defaults are --seq-len 632 --micro-batch 1 "
        "--schedule cpp --compute none",
    )
    p.add_argument(
        "--seq-len",
        type=cli.positive_int,
        metavar="T",
        help=f"tokens per sample (default 64; 632 for {cpp.PRESET})",
    )
    p.add_argument(
        "--micro-batch",
        type=cli.positive_int,
        metavar="B",
        help="samples per micro-batch (default 1)",
    )
    p.add_argument(
        "--schedule",
        choices=("1f1b", "gpipe", "cpp"),
        help="1f1b (default), gpipe (all forwards, then all backwards), or cpp: the C++ "
        "proxy's iteration message for message (all forward messages, all backward "
        "messages, one blocking allreduce per layer, no tied-embedding allreduce; "
        f"communication only; the default of --model {cpp.PRESET})",
    )
    p.add_argument(
        "--order",
        default="cpp",
        metavar="ORDER",
        help="rank order, fastest dimension first: cpp = pp-dp (stage = rank %% "
        "STAGES, as the C++ proxy; the default), megatron = dp-pp (stage = rank // DP)",
    )
    p.add_argument(
        "--grad-sync",
        choices=("fused", "per-tensor", "buckets"),
        help="data-parallel gradient allreduce: fused, one buffer per stage after the pipeline "
        "(the default); per-tensor, one message per parameter tensor (the tensors the C++ "
        "proxy sends with its aggregation off); buckets, each started non-blocking as soon as the "
        "last micro-batch's backward has finished its layers, overlapping the rest of that "
        "backward (PyTorch DDP), and completed after the pipeline (not with --zero 1)",
    )
    p.add_argument(
        "--bucket-mb",
        type=cli.number(
            min=0, max=MAX_BUCKET_MB, what=f"a number >= 0 (MiB, at most {MAX_BUCKET_MB:g})"
        ),
        metavar="MB",
        help=f"with --grad-sync buckets (an error without it): close a bucket once it holds "
        f"MB MiB of float32 gradients (default {DEFAULT_BUCKET_MB:g}, as PyTorch DDP); "
        "buckets are runs of whole backward pieces (LM head, layers, embeddings) in backward "
        "order; 0: one bucket per piece",
    )
    p.add_argument(
        "--zero",
        type=cli.integer(min=0, max=1, what="0 or 1"),
        choices=(0, 1),
        default=0,
        help="1: ZeRO stage 1 (as llm.c): reduce-scatter gradients over data-parallel ranks, "
        "AdamW on this rank's shard, allgather the parameters (default 0: off)",
    )
    p.add_argument(
        "--lr",
        type=cli.learning_rate,
        default=1e-3,
        help=f"AdamW learning rate, in (0, {cli.LR_MAX:g}] (default 1e-3)",
    )
    p.add_argument(
        "--weight-decay",
        type=cli.weight_decay,
        default=0.0,
        help="AdamW weight decay, in [0, 1] (default 0)",
    )
    p.add_argument(
        "--data", metavar="FILE", help="llm.c token file (.bin); default: synthetic tokens"
    )
    cli.add_common(
        p,
        compute=None,  # resolved in make_job (cpp.resolve): real, or none for --schedule cpp
        compute_help=cli.COMPUTE_HELP + " (default real; none with --schedule cpp, the only "
        "mode it allows)",
    )
    return p


def split_layers(L: int, pp: int) -> list[range]:
    """Contiguous layer ranges, sizes differing by at most one; the first L % pp stages take
    the extra layers (the last stage already carries the LM head). None is dropped."""
    base, extra = divmod(L, pp)
    bounds = np.cumsum([0] + [base + (s < extra) for s in range(pp)])
    return [range(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def stage_params(cfg: GPT2Config, layers: range, first: bool, last: bool) -> int:
    """Parameters held by one stage; wte is held by both the first and the last stage."""
    return layout_size(stage_layout(cfg, layers, first, last))


class GPT2Runtime:
    """Buffers and compute of one rank: the StageModel for real/replay compute, plain
    buffers of the right sizes for model/none."""

    def __init__(
        self,
        cfg: GPT2Config,
        layers: range,
        first: bool,
        last: bool,
        args,
        dp: int,
        dp_rank: int,
        source,
        mode: str,
    ):
        B, T, C, m = args.micro_batch, args.seq_len, cfg.n_embd, args.micro_batches
        self.B, self.T, self.C, self.m, self.dp = B, T, C, m, dp
        self.first, self.last = first, last
        self.piece = {
            name: i for i, (name, _) in enumerate(backward_pieces(cfg, layers, first, last))
        }
        self.source, self.lr, self.wd = source, args.lr, args.weight_decay
        self.dp_rank = dp_rank
        self.layout = {
            name: (offset, math.prod(shape))
            for name, shape, offset in stage_layout(cfg, layers, first, last)
        }
        self.model = None
        if mode in ("real", "replay"):
            from proxies.transformer.stage_model import StageModel

            self.model = StageModel(cfg, layers, first, last, B, T, seed=args.seed)
            self.params, self.grads = self.model.params, self.model.grads
        else:
            n = stage_params(cfg, layers, first, last)
            self.grads = np.zeros(n, dtype=np.float32)
            self.params = np.zeros(n, dtype=np.float32) if args.zero else self.grads
        # ZeRO-1: this rank's shard of the flat buffer and its AdamW moments.
        self.zero = args.zero and dp > 1
        if self.zero:
            self.shard = slice(*block_range(self.grads.size, dp, dp_rank))
            size = self.shard.stop - self.shard.start
            self.moments = np.zeros((2, size), np.float32)  # AdamW m, v of the shard
            self.steps = 0
        self.bufs: dict[tuple[str, int], np.ndarray] = {}
        self.loss_sum, self.loss_count = 0.0, 0

    def buffer(self, name: str, mb: int, chunk: int) -> np.ndarray:
        if name in ("grads", "params"):
            return self.grads if name == "grads" else self.params
        if name.startswith("grad:"):  # one parameter tensor's gradient, e.g. "grad:wte"
            offset, size = self.layout[name[5:]]
            return self.grads[offset : offset + size]
        if name.startswith("grads:"):  # a bucket: a flat range, "grads:LO:HI"
            lo, hi = map(int, name.split(":")[1:])
            return self.grads[lo:hi]
        buf = self.bufs.get((name, mb))
        if buf is None:
            buf = self.bufs[(name, mb)] = np.zeros((self.B, self.T, self.C), dtype=np.float32)
        return buf

    def compute(self, op: Compute, iteration: int) -> None:
        model = self.model
        if op.name == "forward":
            if self.first:
                g = (iteration * self.dp + self.dp_rank) * self.m * self.B + op.mb * self.B
                x, targets = batch(self.source, g, self.B)
            else:
                x = self.buffer("act_in", op.mb, 0)
            if self.last:
                g = (iteration * self.dp + self.dp_rank) * self.m * self.B + op.mb * self.B
                targets = batch(self.source, g, self.B)[1]
                # Scaled so the data-parallel SUM is the gradient of the global mean loss.
                self.loss_sum += model.forward(op.mb, x, targets, 1.0 / (self.m * self.dp))
                self.loss_count += 1
            else:
                self.bufs[("act_out", op.mb)] = model.forward(op.mb, x)
        elif op.name == "backward":
            dout = None if self.last else self.buffer("grad_out", op.mb, 0)
            din = model.backward(op.mb, dout)
            if not self.first:
                self.bufs[("grad_in", op.mb)] = din
        elif op.name.startswith("backward:"):  # one piece, e.g. "backward:h.3"
            i = self.piece[op.name[9:]]
            dout = None if self.last or i else self.buffer("grad_out", op.mb, 0)
            din = model.backward_piece(op.mb, i, dout)
            if i == len(self.piece) - 1 and not self.first:
                self.bufs[("grad_in", op.mb)] = din
        elif op.name == "optimizer":
            if self.zero:
                self.steps += 1
                sh, (m, v) = self.shard, self.moments
                adamw_update(
                    self.params[sh], self.grads[sh], m, v, self.steps, self.lr, weight_decay=self.wd
                )
            else:
                model.step(self.lr, self.wd)
            model.zero_grad()
        else:
            raise ValueError(f"unknown compute op {op.name}")

    def finish_iteration(self, iteration: int) -> tuple[float, int]:
        out = (self.loss_sum, self.loss_count)
        self.loss_sum, self.loss_count = 0.0, 0
        return out


def merge_ranges(ranges) -> list[tuple[int, int]]:
    """Sorted [lo, hi) ranges with adjacent ones joined."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def grad_buckets(pieces, min_count: float) -> list[tuple[int, list[tuple[int, int]]]]:
    """Gradient buckets in posting order: (index of the piece that completes it, its flat
    ranges). A bucket is a run of consecutive backward pieces (config.backward_pieces),
    closed once it holds min_count elements (0: every piece) or at the last piece."""
    out, ranges = [], []
    for i, (_, rs) in enumerate(pieces):
        ranges += rs
        if sum(hi - lo for lo, hi in ranges) >= min_count or i == len(pieces) - 1:
            out.append((i, merge_ranges(ranges)))
            ranges = []
    return out


def bucketed_backward(
    ops: list, last_mb: int, cfg: GPT2Config, layers: range, first: bool, last: bool, args
) -> tuple[list, list[str]]:
    """`ops` with micro-batch last_mb's backward cut into its pieces, each followed by the
    non-blocking data-parallel allreduces of the buckets it completes (one per contiguous
    range of the flat buffer); and the requests, for gradient_sync to wait for.

    Each piece's flops are twice its forward's (the LM head's, a layer's; the encoder's
    none), so the pieces add up to the unsplit backward."""
    B, T = args.micro_batch, args.seq_len
    pieces = backward_pieces(cfg, layers, first, last)
    flops = {"head": 2 * stage_flops(cfg, range(0), True, B, T), "embed": 0.0}
    layer = 2 * stage_flops(cfg, range(1), False, B, T)
    posts: dict[int, list[Collective]] = defaultdict(list)
    reqs: list[str] = []
    for i, ranges in grad_buckets(pieces, args.bucket_mb * 2**20 / 4):
        for lo, hi in ranges:
            reqs.append(f"dp{len(reqs)}")
            coll = Collective("allreduce", "dp", f"grads:{lo}:{hi}", hi - lo, req=reqs[-1])
            posts[i].append(coll)
    out = []
    for op in ops:
        if not (isinstance(op, Compute) and op.name == "backward" and op.mb == last_mb):
            out.append(op)
            continue
        for i, (name, _) in enumerate(pieces):
            out.append(Compute(f"backward:{name}", op.mb, op.chunk, flops.get(name, layer)))
            out += posts[i]
    return out, reqs


def gradient_sync(
    cfg: GPT2Config,
    layers: range,
    first: bool,
    last: bool,
    pp: int,
    dp: int,
    args,
    posted: tuple[str, ...] | list[str] = (),
) -> list:
    """The end of an iteration: gradients summed over data-parallel replicas, the tied
    embedding's between the first and last stage (Megatron's embedding group), AdamW.

    fused: one allreduce of the stage's flat gradient buffer (DP first, then embedding, as
    Megatron). per-tensor: one allreduce per parameter tensor. buckets: wait for the
    allreduces `posted` during the last backward (bucketed_backward). ZeRO-1: embedding
    allreduce first (the shards split wte), reduce-scatter, AdamW on the shard, allgather
    parameters.
    """
    layout = stage_layout(cfg, layers, first, last)
    n = layout_size(layout)
    embed = pp > 1 and (first or last)
    wte = cfg.vocab_size * cfg.n_embd
    ops = []
    if args.zero and dp > 1:
        if embed:
            ops.append(Collective("allreduce", "embed", "grad:wte", wte))
        ops.append(Collective("reduce_scatter", "dp", "grads", n))
        ops.append(Compute("optimizer"))
        ops.append(Collective("allgather", "dp", "params", n))
        return ops
    if dp > 1 and args.grad_sync == "fused":
        ops.append(Collective("allreduce", "dp", "grads", n))
    elif dp > 1 and args.grad_sync == "per-tensor":
        ops += [
            Collective("allreduce", "dp", f"grad:{name}", math.prod(shape))
            for name, shape, _ in layout
        ]
    ops += [Wait(req) for req in posted]
    if embed:
        ops.append(Collective("allreduce", "embed", "grad:wte", wte))
    ops.append(Compute("optimizer"))
    return ops


def make_job(args, world: int) -> runner.Job:
    cpp.resolve(args)  # defaults per preset and schedule; the cpp schedule's refusals
    cfg = PRESETS[cpp.WIDTHS if args.model == cpp.PRESET else args.model]
    L = args.layers or cfg.n_layer
    memory.check_layers(L)
    cfg = cfg.with_layers(L)
    pp, m, B, T = args.stages, args.micro_batches, args.micro_batch, args.seq_len
    if pp > L:
        raise cli.UsageError(
            f"STAGES = {pp} is more than LAYERS = {L}: every stage needs at least one layer"
        )
    if world % pp:
        raise cli.UsageError(
            f"world size {world} is not a multiple of STAGES = {pp} (the "
            "data-parallel degree is world size / STAGES)"
        )
    if T > cfg.max_seq_len:
        raise cli.UsageError(
            f"--seq-len {T} is longer than {args.model}'s context of {cfg.max_seq_len}"
        )
    if m > MAX_TAG_MICROBATCHES:
        raise cli.UsageError(f"MICROBATCHES = {m}: at most {MAX_TAG_MICROBATCHES} (message tags)")
    buckets = args.grad_sync == "buckets"
    if args.bucket_mb is not None and not buckets:
        raise cli.UsageError(
            f"--bucket-mb {args.bucket_mb:g} needs --grad-sync buckets (it is {args.grad_sync})"
        )
    if buckets and args.zero:
        raise cli.UsageError(
            "--zero 1 reduce-scatters one fused buffer after the pipeline: it does not combine "
            "with --grad-sync buckets"
        )
    if buckets and args.bucket_mb is None:
        args.bucket_mb = DEFAULT_BUCKET_MB
    dp = world // pp
    try:
        grid = ProcessGrid.create(args.order, pp=pp, dp=dp)
    except ValueError as e:
        raise cli.UsageError(str(e)) from None
    parity = args.schedule == "cpp"
    schedule = SCHEDULES["gpipe" if parity else args.schedule]
    source = None
    if args.data and not args.dry_run:
        try:
            source = TokenFile(args.data, cfg.vocab_size, T)
        except DataError as e:
            raise cli.UsageError(str(e)) from None
    elif not args.data and not parity:  # the C++ schedule trains nothing: no data
        source = Synthetic(args.seed, cfg.vocab_size, T)
    split = split_layers(L, pp)
    act = B * T * cfg.n_embd

    def plan(rank: int) -> Plan:
        c = grid.coords(rank)
        s = c["pp"]
        first, last = s == 0, s == pp - 1
        pp_ranks = grid.group("pp", rank)
        groups = {"pp": pp_ranks, "dp": grid.group("dp", rank)}
        if parity:
            ops = cpp.cpp_ops(cfg, split[s], s, pp_ranks, m, act, dp)
            return Plan(rank, tuple(ops), groups, c)
        fwd = stage_flops(cfg, split[s], last, B, T)
        actions = schedule(pp, m, s)
        ops = pipeline_ops(
            actions,
            s,
            pp_ranks,
            1,
            act,
            flops=lambda kind, chunk: fwd if kind == "forward" else 2 * fwd,
        )
        if pp > 1 and (first or last):
            groups["embed"] = (pp_ranks[0], pp_ranks[-1])
        posted = []
        if buckets and dp > 1:
            last_mb = [a.mb for a in actions if a.kind == "B"][-1]
            ops, posted = bucketed_backward(ops, last_mb, cfg, split[s], first, last, args)
        ops += gradient_sync(cfg, split[s], first, last, pp, dp, args, posted)
        return Plan(rank, tuple(ops), groups, c)

    def label(rank: int) -> str:
        s = grid.coords(rank)["pp"]
        r = split[s]
        extra = (" +emb" if s == 0 else "") + (" +head" if s == pp - 1 else "")
        return f"stage {s}: layers {r.start}-{r.stop - 1}{extra}"

    def runtime(rank, MPI, comms, mode):
        c = grid.coords(rank)
        s = c["pp"]
        return GPT2Runtime(cfg, split[s], s == 0, s == pp - 1, args, dp, c["dp"], source, mode)

    sizes = sorted({len(r) for r in split})
    config = {
        "model": args.model,
        "layers": L,
        "stages": pp,
        "micro_batches": m,
        "micro_batch": B,
        "seq_len": T,
        "n_embd": cfg.n_embd,
        "n_head": cfg.n_head,
        "vocab_size": cfg.vocab_size,
        "params": cfg.num_params,
        "schedule": args.schedule,
        "order": grid.order,
        "dp": dp,
        "global_batch": B * m * dp,
        "compute": args.compute,
        "lr": args.lr,
        "weight_decay": args.weight_decay,
        "seed": args.seed,
        "iters": args.iters,
        "warmup": args.warmup,
        "data": args.data or ("none" if parity else "synthetic"),
        "check": args.check,
        "allreduce": args.allreduce,
        "grad_sync": args.grad_sync,
        "bucket_mb": args.bucket_mb,
        "zero": args.zero,
        "device_tflops": args.device_tflops,
        "layers_per_stage": [len(r) for r in split],
    }
    sync = args.grad_sync
    if parity:
        sync = "one blocking allreduce per layer (the C++ proxy's), no tied-embedding allreduce"
    elif args.zero and dp > 1:
        sync = "ZeRO-1 (reduce-scatter, allgather)"
    elif buckets:
        size = f"{args.bucket_mb:g} MiB" if args.bucket_mb else "one per layer"
        sync = f"buckets ({size}) overlapping the last micro-batch's backward"
    header = [
        f"[bold]{PROG}[/] · {args.model} (C={cfg.n_embd}, {cfg.n_head} heads, V={cfg.vocab_size}) "
        f"· {L} layers = {cfg.num_params / 1e6:,.1f}M parameters",
        f"grid: {pp} pipeline stages x {dp} data-parallel (order {grid.order}) · layers per stage "
        + ("-".join(map(str, sizes)) if len(sizes) > 1 else str(sizes[0]))
        + f" · schedule {args.schedule} · {m} micro-batches of {B} x {T} tokens "
        f"(global batch {B * m * dp} samples)",
        f"messages: activation {act:,} floats ({act * 4:,} B); gradients per layer "
        f"{cfg.layer_params:,} floats · gradient sync {sync} · data: "
        + (source.describe() if source is not None else args.data or "none")
        + f" · iterations {args.warmup} warm-up + {args.iters} timed",
    ]
    return runner.Job(
        prog=PROG,
        proxy="gpt2",
        config=config,
        grid=grid,
        plan=plan,
        group_names=("pp", "dp", "embed"),
        label=label,
        header=header,
        runtime=runtime,
        dtypes=cli.wire_dtypes(args),
        grad_categories=GRAD_CATEGORIES,
        memory=lambda rank, plan: estimate_memory(cfg, split, grid, args, lambda _: plan, rank),
        categories=SPEC.categories,
        short=SPEC.short,
    )


def estimate_memory(cfg, split, grid, args, plan, rank: int) -> dict[str, int]:
    from proxies.gpt2.memory import estimate

    c = grid.coords(rank)
    s, dp = c["pp"], grid.degree("dp")
    return estimate(cfg, split[s], s, len(split), dp, c["dp"], args, plan(rank))


# Gradient reductions (--grad-dtype); the rest, ZeRO's parameter allgather included, is --dtype.
GRAD_CATEGORIES = frozenset({"dp_allreduce", "dp_reduce_scatter", "embed_allreduce"})


def main(argv: list[str] | None = None) -> int:
    return runner.main(make_job, parser(), argv)


def entry() -> None:
    cli.run_main(PROG, main)
