"""The GPT-3 proxy: data x tensor x pipeline (x expert) parallelism, as Megatron-LM issues it.

    mpirun -n 64 python -m proxies.gpt3 96 8 --tp 4          # DP = 64 / (8 * 4) = 2
    mpirun -n 64 python -m proxies.gpt3 96 8 --tp 4 --moe-experts 8
    python -m proxies.gpt3 --dry-run --world-size 1536 --tp 8 96 16

One iteration of one rank: the pipeline schedule (proxies.core.schedules) over m
micro-batches; inside every forward and backward, per layer, the pieces of compute between
the tensor-parallel collectives (model.py): forward attention -> allreduce -> MLP ->
allreduce, backward the mirror image (allgather / reduce-scatter with sequence parallelism;
MoE: gate -> all-to-all dispatch -> experts -> all-to-all combine). During the last
micro-batch's backward, each gradient bucket is allreduced over the data-parallel group as
soon as its layers are done (Megatron's overlap_grad_reduce; expert gradients over the
expert-data-parallel group), then the tied embedding gradient between the first and last
stage, the sequence-parallel layernorm gradients over TP, and AdamW.

Memory (compute model/none): no parameters exist; every message lives in a pool of reusable
buffers: one per pipeline direction, one for all blocking collectives, and --inflight-buckets
(default 2) for the gradient buckets, which the plan never lets more of be in flight. A
rank needs about twice its largest message, not all its gradients: at most 2.64 GiB per rank
for the C++ proxy's 175B layout with DP (a layer shard's bucket is 1.8 GB), as --dry-run
prints.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable

from proxies.core import cli, runner
from proxies.core.grid import ProcessGrid
from proxies.core.plan import Plan
from proxies.core.schedules import SCHEDULES
from proxies.gpt3 import SPEC
from proxies.transformer import describe, options
from proxies.transformer.fsdp import fsdp_text
from proxies.transformer.layout import Layout
from proxies.transformer.memory import estimate as estimate_memory
from proxies.transformer.plan import gpt3_plans
from proxies.transformer.runtime import BufferPool, Runtime
from proxies.transformer.setup import (
    DEFAULT_MODEL,
    PRESETS,
    MoESpec,
    Setup,
    cpp_device_tflops,
    padded_vocab,
)

PROG = "proxies.gpt3"
# cp next to tp (Megatron-LM's tp-cp-ep-dp-pp); absent from a grid without cp
ORDERS = {"cpp": "pp-tp-cp-ep-dp", "megatron": "tp-cp-ep-dp-pp"}


def parser() -> argparse.ArgumentParser:
    p = cli.Parser(
        prog=f"python -m {PROG}",
        description="GPT-3 training proxy: Megatron-LM's tensor, pipeline and data "
        "parallelism (and expert parallelism for MoE) with its real message sizes, and "
        "compute that is real (NumPy, small presets), modelled (FLOPs / rate) or absent. "
        "Arguments as the C++ proxy: LAYERS STAGES; DP = world size / (tp * STAGES).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    options.add_shape(p, "pipeline stages")
    p.add_argument(
        "--model",
        choices=sorted(PRESETS),
        default=DEFAULT_MODEL,
        help="preset widths (Brown et al. 2020); gpt3-tiny (C=64) for tests",
    )
    p.add_argument(
        "--tp",
        "--tensor-model-parallel-size",
        type=cli.positive_int,
        default=1,
        help="tensor-parallel degree",
    )
    options.add_micro_batch(p, "samples per micro-batch", default=1)
    options.add_micro_batches(
        p, "micro-batches per iteration per replica (default 2 x STAGES, as the C++ proxy)"
    )
    options.add_seq_len(p, "tokens per sample (default: the preset's context, 2048)")
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="Megatron's sequence parallelism: per layer 2 allgathers and 2 reduce-scatters "
        "forward, 4 and 2 backward (qkv's and fc's inputs gathered again); pipeline "
        "messages shrink by tp; with MoE, Megatron's token dispatch (A2A ep, AG/RS tp)",
    )
    options.add_schedule(
        p,
        tuple(sorted(SCHEDULES)),
        "gpipe: all forwards then all backwards (the C++ proxy's order); interleaved: "
        "1F1B with --virtual-stages model chunks per rank",
        default="1f1b",
    )
    p.add_argument(
        "--virtual-stages",
        type=cli.positive_int,
        default=options.Default(1),
        metavar="V",
        help="model chunks per rank (interleaved schedule; > 1 selects it)",
    )
    options.add_order(
        p,
        "rank order, fastest dimension first: cpp = pp-tp-ep-dp (stage = rank %% "
        "STAGES, as the C++ proxy), megatron = tp-ep-dp-pp, or explicit like tp-pp-dp",
    )
    g = p.add_argument_group("mixture of experts")
    g.add_argument(
        "--moe-experts",
        "--num-experts",
        type=cli.nonneg_int,
        default=0,
        metavar="E",
        help="experts per MoE layer (0: dense MLPs); every layer's MLP becomes an MoE",
    )
    g.add_argument(
        "--moe-top-k",
        type=cli.positive_int,
        default=2,
        metavar="K",
        help="experts each token is routed to",
    )
    g.add_argument(
        "--capacity-factor",
        type=cli.number(min=0, open_min=True, max=1000, what="a capacity factor in (0, 1000]"),
        default=1.0,
        metavar="CF",
        help="expert capacity = ceil(CF * K * tokens / E) per source rank; tokens past it "
        "drop; in (0, 1000]",
    )
    g.add_argument(
        "--moe-ffn-hidden",
        type=cli.positive_int,
        metavar="F",
        help="hidden width of one expert (default 4C; 4C/E gives the C++ MoE proxy's sizes)",
    )
    g.add_argument(
        "--ep",
        "--expert-model-parallel-size",
        type=cli.positive_int,
        metavar="EP",
        help="expert-parallel degree, a divisor of DP (default gcd(E, DP)); experts are "
        "spread over EP ranks and their gradients allreduced over DP / EP",
    )
    g = p.add_argument_group("gradients and layout")
    options.add_bucket_mb(
        g,
        "data-parallel gradient bucket size in MiB of float32 gradients (as gpt2's); "
        "buckets are whole layers, allreduced as soon as the last micro-batch's backward "
        "finishes them (default 0: one bucket per layer)",
    )
    g.add_argument(
        "--dp-bucket",
        type=cli.nonneg_int,
        metavar="ELEMENTS",
        help="the same bucket size in float32 elements (4 bytes each), instead of --bucket-mb "
        "(default 0: one bucket per layer)",
    )
    g.add_argument(
        "--inflight-buckets",
        type=cli.nonneg_int,
        default=2,
        metavar="N",
        help="gradient buckets in flight at once; compute model/none keep N bucket buffers "
        "(0: no limit, every gradient in memory)",
    )
    g.add_argument(
        "--make-vocab-size-divisible-by",
        type=cli.positive_int,
        default=128,
        metavar="N",
        help="pad the vocabulary to a multiple of N * tp (Megatron's option)",
    )
    g.add_argument(
        "--layers-only",
        action="store_true",
        help="only the transformer layers, no embedding, LM head or loss: the C++ proxy's "
        "pattern (compute model/none only)",
    )
    options.add_cp(p)
    options.add_fsdp(p)
    options.add_training(p, lr=1e-4, defaults_in_help=False)  # the formatter adds them
    options.add_megatron(p, virtual=True)
    tflops = cpp_device_tflops()
    cli.add_common(
        p,
        compute=None,  # resolved per preset in resolve()
        tflops=tflops,
        tflops_help=f"achieved device rate for --compute model, in TFLOP/s (default "
        f"{tflops:.2f}: one 175B layer shard at tp 4 then takes the C++ proxy's A100 times, "
        "15,915 us forward and 31,830 us backward)",
        compute_help=(
            "real: the NumPy kernels on this rank's tensor-parallel shard; replay: each "
            "compute op timed once with the real kernels, ranks on a node taking turns, then "
            "slept; model: sleep FLOPs / --device-tflops; none: communication only (default: "
            "real for gpt3-tiny, model for the other presets)"
        ),
    )
    return p


# ----------------------------------------------------------------------------------------
# the setup, validated


def resolve(
    args, world: int, presets: dict | None = None, real: tuple[str, ...] = ("gpt3-tiny",)
) -> tuple[Setup, ProcessGrid]:
    """Check the options against each other and the world size; UsageError names the rule.
    `presets` and `real` (the presets real compute is the default for): another front end's
    (proxies/llama), GPT-3's by default."""
    options.megatron_shape(args)  # --num-layers, --pipeline-model-parallel-size
    cfg = (presets or PRESETS)[args.model]
    cfg = options.with_context(args, cfg)  # --context: a longer position embedding
    L = args.layers or cfg.n_layer
    pp, tp, B, cp = args.stages, args.tp, args.micro_batch, args.cp
    options.megatron_batch(args, world, tp * pp * cp, "--micro-batches")
    v = options.megatron_virtual(args, L, pp)
    T = args.seq_len or cfg.max_seq_len
    m = args.micro_batches or 2 * pp
    err = cli.UsageError
    if args.compute is None:
        # real for the tiny preset; with --cp > 1 model (--compute real runs it too)
        args.compute = "real" if args.model in real and args.cp == 1 else "model"
    if cfg.n_head % tp:
        raise err(f"--tp {tp} does not divide {args.model}'s {cfg.n_head} attention heads")
    options.check_shape(
        model=args.model,
        layers=L,
        stages=pp,
        world=world,
        seq_len=T,
        context=cfg.max_seq_len,
        micro_batches=m,
        tp=tp,
        virtual=v,
    )
    cfg = cfg.with_layers(L)
    schedule = args.schedule
    if v > 1:
        if schedule == "gpipe":
            raise err(f"--virtual-stages {v} needs the interleaved schedule, not gpipe")
        schedule = "interleaved"
        if L % pp:
            raise err(f"--virtual-stages {v}: LAYERS = {L} must be a multiple of STAGES = {pp}")
        if (L // pp) % v:
            raise err(
                f"--virtual-stages {v} does not divide the {L // pp} layers per stage "
                f"(LAYERS {L} / STAGES {pp})"
            )
    if schedule == "interleaved" and v > 1 and m % pp:
        raise err(
            f"the interleaved schedule needs --micro-batches ({m}) to be a multiple of "
            f"STAGES = {pp}"
        )
    sp = args.sequence_parallel and tp > 1
    if sp and T % tp:
        raise err(f"--sequence-parallel: --seq-len {T} is not a multiple of --tp {tp}")
    cp_fields = options.cp_rules(args, world, T=T, heads=cfg.n_head, tp=tp, pp=pp, sp=sp)
    dp = world // (tp * pp * cp)
    moe = None
    E = args.moe_experts
    if E:
        ep = args.ep or math.gcd(E, dp)
        if dp % ep:
            raise err(f"--ep {ep} does not divide the data-parallel degree {dp}")
        if E % ep:
            raise err(
                f"--moe-experts {E} cannot be spread evenly over the {ep} expert-parallel ranks"
            )
        if args.moe_top_k > E:
            raise err(f"--moe-top-k {args.moe_top_k} is more than --moe-experts {E}")
        F = args.moe_ffn_hidden or cfg.mlp_hidden  # 4C (LLaMA's preset: its F)
        if F % tp:
            raise err(f"--moe-ffn-hidden {F} is not a multiple of --tp {tp}")
        moe = MoESpec(E, args.moe_top_k, args.capacity_factor, F, ep)
        if cp > 1:
            raise err("--cp with --moe-experts is not supported yet")
    elif args.ep:
        raise err("--ep needs --moe-experts")
    if args.layers_only and args.compute in ("real", "replay"):
        raise err(
            f"--layers-only has no loss to train: use --compute model or none, not {args.compute}"
        )
    if v > 1:
        per = L // (pp * v)
        split = tuple(range(i * per, (i + 1) * per) for i in range(pp * v))
    else:
        split = tuple(options.split_layers(L, pp))
    if args.bucket_mb is not None and args.dp_bucket is not None:
        raise err("--bucket-mb and --dp-bucket are one size in two units: give one")
    if args.bucket_mb is not None:
        bucket = options.bucket_elements(args.bucket_mb)
    else:
        bucket = args.dp_bucket or 0
    fsdp_fields = options.fsdp_rules(
        args,
        dp,
        moe=moe is not None,
        cp=cp,
        sp=sp,
        virtual=v,
        refused=(
            ("--bucket-mb", args.bucket_mb is not None),
            ("--dp-bucket", args.dp_bucket is not None),
        ),
    )
    vocab = padded_vocab(cfg.vocab_size, tp, args.make_vocab_size_divisible_by)
    S = Setup(
        cfg,
        B,
        T,
        m,
        tp,
        pp,
        dp,
        v,
        sp,
        vocab,
        split,
        moe,
        bucket,
        args.inflight_buckets,
        args.layers_only,
        model=args.model,
        schedule=schedule,
        **cp_fields,
        **fsdp_fields,
        lr=args.lr,
        weight_decay=args.weight_decay,
        seed=args.seed,
    )
    try:
        SCHEDULES[schedule](pp, m, 0, v)
        degrees = {"tp": tp, "pp": pp, "dp": dp // (moe.ep if moe else 1)}
        if moe:
            degrees["ep"] = moe.ep
        if cp > 1:
            degrees["cp"] = cp
        order = ORDERS.get(args.order, args.order)
        grid = ProcessGrid.create(order, **degrees)
    except ValueError as e:
        raise err(str(e)) from None
    return S, grid


# ----------------------------------------------------------------------------------------
# the job


def make_job(args, world: int) -> runner.Job:
    S, grid = resolve(args, world)
    schedule = S.schedule
    source = options.token_source(args, S.cfg.vocab_size, S.T)
    plan = gpt3_plans(S, grid, schedule)

    config = describe.config(S, grid, args, own_config(S), data="synthetic")
    header = describe.header(
        PROG,
        S,
        grid,
        args,
        source,
        model_extra=moe_text(S),
        messages=f"TP collectives {S.N * S.cfg.n_embd:,} floats per layer part"
        + (f" · {fsdp_text(S)}" if S.fsdp else ""),
    )
    groups = ("pp", "tp", "dp", "embed", "ep", "edp", *describe.cp_groups(S), "fsdp", "hsdp")
    return transformer_job(
        PROG,
        SPEC,
        S,
        grid,
        args,
        plan=plan,
        runtime=stage_runtime(S, grid, plan, source),
        config=config,
        header=header,
        groups=groups,
        grads=("dp_allreduce", "edp_allreduce", "embed_allreduce"),
        hooks=dry_run_hooks(S),
    )


# The pieces every front end on the one transformer (gpt3, llama, bert) builds its job from.


def stage_label(S: Setup, grid: ProcessGrid) -> Callable[[int], str]:
    """rank -> "stage s: layers a-b[,c-d] [+emb] [+head]" (its model chunks)."""

    def label(rank: int) -> str:
        s = grid.coords(rank)["pp"]
        chunks = S.chunks(s)
        parts = [f"{ch.layers.start}-{ch.layers.stop - 1}" for ch in chunks]
        extra = (" +emb" if any(ch.embed for ch in chunks) else "") + (
            " +head" if any(ch.head for ch in chunks) else ""
        )
        return f"stage {s}: layers {','.join(parts)}{extra}"

    return label


def stage_runtime(S: Setup, grid: ProcessGrid, plan, source, cls: type = Runtime) -> Callable:
    """The Job's runtime factory: a `cls` (the one Runtime, or a front end's subclass) on the
    rank's stage, tensor shard and data-parallel index (expert-parallel ranks counted among
    the data-parallel ones, as the batch is split)."""

    def runtime(rank, MPI, comms, mode):
        c = grid.coords(rank)
        ep_rank = c.get("ep", 0)
        dp_rank = c["dp"] * (S.moe.ep if S.moe else 1) + ep_rank
        return cls(S, plan(rank), c["pp"], c["tp"], ep_rank, dp_rank, source, mode)

    return runtime


def transformer_job(
    prog: str, spec, S: Setup, grid: ProcessGrid, args, *, plan, runtime, config, header,
    groups: tuple[str, ...], grads: tuple[str, ...], hooks: dict,
) -> runner.Job:  # fmt: skip
    """The runner.Job of a front end on the one transformer: its plan, runtime, description
    and dry-run hooks, and what they all share (gradient categories `grads` plus FSDP's,
    the float32 loss buffers, folding, the memory estimate)."""
    return runner.Job(
        prog=prog,
        proxy=spec.name,
        config=config,
        grid=grid,
        plan=plan,
        group_names=groups,
        label=stage_label(S, grid),
        header=header,
        runtime=runtime,
        dtypes=cli.wire_dtypes(args),
        grad_categories=frozenset({*grads, "fsdp_reduce_scatter", "hsdp_allreduce"}),
        # The vocabulary-parallel loss's (max, sum-exp, target logit): float32, as Megatron's.
        fp32_buffers=frozenset({"ce"}),
        # tensor-parallel shards and data-parallel replicas run the same plan op for op
        fold=("tp", "dp"),
        setup=S,  # for the dry run
        memory=lambda rank, plan: estimate_memory(
            S, grid.coords(rank)["pp"], 0, args.compute, plan
        ),
        buffers=lambda plan: BufferPool(plan, S.inflight).slot,  # compute none/model
        categories=spec.categories,
        short=spec.short,
        **hooks,
    )


def own_config(S: Setup) -> dict:
    """GPT-3's keys of the JSON config: tensor, sequence and expert parallelism, chunks,
    the padded vocabulary and the gradient buckets."""
    moe = S.moe
    return {
        "tp": S.tp,
        "virtual_stages": S.v,
        "sequence_parallel": S.sp,
        "vocab_padded": S.vocab,
        "moe_experts": moe.experts if moe else 0,
        "moe_top_k": moe.top_k if moe else None,
        "capacity_factor": moe.capacity_factor if moe else None,
        "moe_ffn_hidden": moe.ffn_hidden if moe else None,
        "ep": moe.ep if moe else 1,
        "dp_bucket": S.bucket,  # elements, whichever of --bucket-mb / --dp-bucket set it
        "inflight_buckets": S.inflight,
        "layers_only": S.layers_only,
        "fsdp_shard_size": S.fsdp or None,  # FSDP's shard group (dp, or HSDP's N); None: off
    }


def moe_text(S: Setup) -> str:
    """The model line's MoE part (empty for dense layers)."""
    moe = S.moe
    if not moe:
        return ""
    return (
        f" · MoE: {moe.experts} experts of width {moe.ffn_hidden}, top-{moe.top_k}, "
        f"capacity factor {moe.capacity_factor:g} ({moe.capacity(S.N)} slots per expert), "
        f"ep {moe.ep}"
    )


# ----------------------------------------------------------------------------------------
# dry run: what GPT-3 adds to the shared one (core/dryrun.py)


def dry_run_hooks(S: Setup) -> dict:
    """Job fields: the parameter and comm-only memory lines and JSON fields, and the traffic
    table per stage, on top of the shared dry run."""

    def pools(plans: dict[int, Plan]) -> int:
        return max(BufferPool(p, S.inflight).nbytes for p in plans.values())

    def lines(console, plans: dict[int, Plan]) -> None:
        lay = [Layout(S, s) for s in range(S.pp)]
        held = [lay[s].dense_size + lay[s].expert_size for s in range(S.pp)]
        console.print(
            f"parameters: {S.cfg.num_params:,} in the model; per rank (one tensor-parallel "
            f"shard of its stage) {min(held):,} to {max(held):,}"
        )
        console.print(
            f"comm-only memory (compute model/none): {pools(plans) / 2**30:,.2f} GiB per rank "
            f"of message buffers, at most (no parameters are allocated)"
        )

    def fields(plans: dict[int, Plan]) -> dict:
        return {"params": S.cfg.num_params, "comm_only_bytes_per_rank": pools(plans)}

    return {
        "dry_run_lines": lines,
        "dry_run_json": fields,
        "traffic_by": ("pp", "stages"),
        "ops_by_default": False,  # thousands of ops per rank: --show-ranks asks for them
    }


def main(argv: list[str] | None = None) -> int:
    return runner.main(make_job, parser(), argv)


def entry() -> None:
    cli.run_main(PROG, main, sys.argv[1:])
