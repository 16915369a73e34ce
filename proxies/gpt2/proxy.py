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

from proxies.core import cli, runner
from proxies.core.grid import ProcessGrid
from proxies.core.plan import Plan
from proxies.gpt2 import SPEC, cpp
from proxies.transformer import describe, options
from proxies.transformer.config import PRESETS, GPT2Config, layout_size, stage_layout
from proxies.transformer.fsdp import fsdp_text
from proxies.transformer.memory import estimate as estimate_memory
from proxies.transformer.options import DEFAULT_BUCKET_MB, split_layers
from proxies.transformer.plan import gpt2_plan, gpt3_plans
from proxies.transformer.runtime import BufferPool, Runtime
from proxies.transformer.setup import GPT2_ORDER, Setup

PROG = "proxies.gpt2"
DEFAULT_MODEL = "gpt2-tiny"


def parser() -> argparse.ArgumentParser:
    p = cli.Parser(
        prog=f"python -m {PROG}",
        description="GPT-2 training proxy: real NumPy forward/backward per pipeline stage, real "
        "activations and gradients over MPI, data-parallel gradient allreduce, AdamW. "
        "Arguments as the C++ proxy: LAYERS STAGES [MICROBATCHES].",
    )
    options.add_shape(p, "pipeline stages (default 1); data-parallel degree = world size / STAGES")
    options.add_micro_batches(
        p, "micro-batches per iteration per replica (default 8, as the C++ proxy)", positional=8
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
    options.add_seq_len(p, f"tokens per sample (default 64; 632 for {cpp.PRESET})")
    options.add_micro_batch(p, "samples per micro-batch (default 1)")
    options.add_schedule(
        p,
        ("1f1b", "gpipe", "cpp"),
        "1f1b (default), gpipe (all forwards, then all backwards), or cpp: the C++ "
        "proxy's iteration message for message (all forward messages, all backward "
        "messages, one blocking allreduce per layer, no tied-embedding allreduce; "
        f"communication only; the default of --model {cpp.PRESET})",
    )
    options.add_order(
        p,
        "rank order, fastest dimension first: cpp = pp-dp (stage = rank %% "
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
    options.add_bucket_mb(
        p,
        f"with --grad-sync buckets (an error without it): close a bucket once it holds "
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
    options.add_cp(p)
    options.add_fsdp(p)
    options.add_training(p, lr=1e-3, defaults_in_help=True)
    options.add_megatron(p)
    cli.add_common(
        p,
        compute=None,  # resolved in make_job (cpp.resolve): real, or none for --schedule cpp
        compute_help=cli.COMPUTE_HELP + " (default real; none with --schedule cpp, the only "
        "mode it allows)",
    )
    return p


def stage_params(cfg: GPT2Config, layers: range, first: bool, last: bool) -> int:
    """Parameters held by one stage; wte is held by both the first and the last stage."""
    return layout_size(stage_layout(cfg, layers, first, last))


def resolve(args, world: int) -> tuple[Setup, ProcessGrid]:
    """The options checked against each other and the world size, as one frozen Setup (tp =
    v = 1, no sequence parallelism or MoE); UsageError names the rule."""
    options.megatron_shape(args)  # --num-layers, --pipeline-model-parallel-size
    options.micro_batches(args)  # --micro-batches
    sync_given = args.grad_sync is not None  # before cpp.resolve's default (FSDP refuses it)
    if args.cp > 1:
        cp_defaults(args)
    cpp.resolve(args)  # defaults per preset and schedule; the cpp schedule's refusals
    options.megatron_batch(args, world, args.stages * args.cp, "MICROBATCHES")
    cfg = PRESETS[cpp.WIDTHS if args.model == cpp.PRESET else args.model]
    cfg = options.with_context(args, cfg)  # --context: a longer position embedding
    L = args.layers or cfg.n_layer
    pp, m, B, T = args.stages, args.micro_batches, args.micro_batch, args.seq_len
    options.check_shape(
        model=args.model,
        layers=L,
        stages=pp,
        world=world,
        seq_len=T,
        context=cfg.max_seq_len,
        micro_batches=m,
    )
    cp = args.cp
    cp_fields = options.cp_rules(args, world, T=T, heads=cfg.n_head, tp=1, pp=pp, sp=False)
    cfg = cfg.with_layers(L)
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
    bucket_mb = DEFAULT_BUCKET_MB if buckets and args.bucket_mb is None else args.bucket_mb
    dp = world // (pp * cp)
    fsdp_fields = options.fsdp_rules(
        args,
        dp,
        cp=cp,
        refused=(
            ("--schedule cpp", args.schedule == "cpp"),
            ("--grad-sync", sync_given),
            ("--bucket-mb", args.bucket_mb is not None),
            ("--zero 1", bool(args.zero)),
        ),
    )
    try:
        grid = ProcessGrid.create(
            args.order,
            pp=pp,
            dp=dp,
            **({"cp": cp, "tp": 1} if cp > 1 else {"tp": 1} if fsdp_fields else {}),
        )
    except ValueError as e:
        raise cli.UsageError(str(e)) from None
    S = Setup(
        cfg,
        B,
        T,
        m,
        tp=1,
        pp=pp,
        dp=dp,
        v=1,
        sp=False,
        vocab=cfg.vocab_size,
        split=tuple(split_layers(L, pp)),
        bucket=options.bucket_elements(bucket_mb) if buckets else 0,
        model=args.model,
        schedule=args.schedule,
        sync="zero1" if args.zero else args.grad_sync,
        bucket_mb=bucket_mb,
        **cp_fields,
        **fsdp_fields,
        # --cp > 1 and --fsdp plan as gpt3 at tp 1: gpt3's layout and in-flight bucket cap
        **(
            {}
            if cp_fields.get("cp", 1) > 1 or fsdp_fields
            else {"inflight": 0, "param_order": GPT2_ORDER}  # buckets each their own buffer
        ),
        lr=args.lr,
        weight_decay=args.weight_decay,
        seed=args.seed,
    )
    return S, grid


def cp_defaults(args) -> None:
    """--cp > 1: GPT-2 plans as GPT-3 does at tp 1 (per-layer pieces, so the cp exchanges
    sit inside each layer; GPT-3's gradient buckets of whole layers). Refuses what that
    cannot do; compute defaults to model (--compute real runs it too)."""
    err = cli.UsageError
    if args.schedule == "cpp" or (args.schedule is None and args.model == cpp.PRESET):
        raise err("--schedule cpp is the C++ proxy's iteration, which has no context parallelism")
    if args.zero or args.grad_sync not in (None, "buckets"):
        what = "--zero 1" if args.zero else f"--grad-sync {args.grad_sync}"
        raise err(
            f"--cp > 1 syncs gradients in buckets of whole layers, as gpt3 (--bucket-mb): "
            f"not {what}"
        )
    args.grad_sync = "buckets"
    if args.compute is None:
        args.compute = "model"


def sync_text(S: Setup) -> str:
    """The data-parallel gradient sync, as the header words it."""
    if S.schedule == "cpp":
        return "one blocking allreduce per layer (the C++ proxy's), no tied-embedding allreduce"
    if S.fsdp:
        return fsdp_text(S)
    if S.zero and S.dp > 1:
        return "ZeRO-1 (reduce-scatter, allgather)"
    if S.sync == "buckets":
        size = f"{S.bucket_mb:g} MiB" if S.bucket_mb else "one per layer"
        return f"buckets ({size}) overlapping the last micro-batch's backward"
    return S.sync


def make_job(args, world: int) -> runner.Job:
    S, grid = resolve(args, world)
    cfg, split, pp = S.cfg, list(S.split), S.pp
    parity = S.schedule == "cpp"
    # The C++ schedule trains nothing: no data.
    source = options.token_source(args, cfg.vocab_size, S.T, needed=not parity)
    cp_plan = gpt3_plans(S, grid, S.schedule) if S.cp > 1 or S.fsdp else None

    def plan(rank: int) -> Plan:
        if cp_plan is not None:
            return cp_plan(rank)
        if parity:
            c = grid.coords(rank)
            groups = {"pp": grid.group("pp", rank), "dp": grid.group("dp", rank)}
            ops = cpp.cpp_ops(S, c["pp"], groups["pp"])
            return Plan(rank, tuple(ops), groups, c)
        return gpt2_plan(S, grid, rank)

    def label(rank: int) -> str:
        s = grid.coords(rank)["pp"]
        r = split[s]
        extra = (" +emb" if s == 0 else "") + (" +head" if s == pp - 1 else "")
        return f"stage {s}: layers {r.start}-{r.stop - 1}{extra}"

    def runtime(rank, MPI, comms, mode):
        c = grid.coords(rank)
        return Runtime(S, plan(rank), c["pp"], 0, 0, c["dp"], source, mode)

    own = {"grad_sync": args.grad_sync, "bucket_mb": S.bucket_mb, "zero": S.zero}
    own["fsdp_shard_size"] = S.fsdp or None  # FSDP's shard group (dp, or HSDP's N); None: off
    config = describe.config(S, grid, args, own, data="none" if parity else "synthetic")
    messages = f"gradients per layer {cfg.layer_params:,} floats · gradient sync {sync_text(S)}"
    return runner.Job(
        prog=PROG,
        proxy="gpt2",
        config=config,
        grid=grid,
        plan=plan,
        group_names=("pp", "dp", "embed", *describe.cp_groups(S), "fsdp", "hsdp"),
        label=label,
        header=describe.header(PROG, S, grid, args, source, messages=messages),
        runtime=runtime,
        dtypes=cli.wire_dtypes(args),
        grad_categories=GRAD_CATEGORIES,
        memory=lambda rank, plan: estimate_memory(
            S, grid.coords(rank)["pp"], grid.coords(rank)["dp"], args.compute, plan
        ),
        buffers=lambda plan: BufferPool(plan, S.inflight).slot,  # compute none/model
        categories=SPEC.categories,
        short=SPEC.short,
    )


# Gradient reductions (--grad-dtype); the rest, ZeRO's parameter allgather included, is --dtype.
GRAD_CATEGORIES = frozenset(
    {
        "dp_allreduce",
        "dp_reduce_scatter",
        "embed_allreduce",
        "fsdp_reduce_scatter",
        "hsdp_allreduce",
    }
)


def main(argv: list[str] | None = None) -> int:
    return runner.main(make_job, parser(), argv)


def entry() -> None:
    cli.run_main(PROG, main)
