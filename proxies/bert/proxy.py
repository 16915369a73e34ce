"""The BERT proxy: a bidirectional encoder trained with the masked-LM loss, pipeline x data
(x tensor) parallel, on the GPT family's transformer (plans, runtime, layout, kernels).

    mpirun -n 8 python -m proxies.bert 24 4                # bert-large, DP = 8 / 4 = 2
    mpirun -n 4 python -m proxies.bert 4 2 --model bert-tiny --tp 2 --compute real
    python -m proxies.bert --model dnn-cpp-proxies --dry-run --world-size 8

The iteration is GPT-3's (transformer/plan.py): the pipeline schedule over m micro-batches,
Megatron's tensor-parallel collectives per layer, the data-parallel gradient buckets
overlapping the last micro-batch's backward, the tied word-embedding allreduce between the
first and last stage, AdamW. BERT's own parts (transformer/encoder.py): attention without
the causal mask, the token-type embedding and embedding LayerNorm, the masked-LM head
(dense + GELU + LayerNorm, the decoder tied to the word embeddings, an output bias) and the
loss on the 15% masked positions. Layers are post-LN as BERT's (--norm pre: GPT's pre-LN).

--model dnn-cpp-proxies is the C++ BERT-large proxy's iteration instead (cpp.py): its
activation size, one blocking allreduce per gradient tensor, no compute.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from proxies.bert import SPEC, cpp
from proxies.core import cli, runner
from proxies.core.grid import ProcessGrid
from proxies.core.plan import Compute, Plan
from proxies.core.schedules import SCHEDULES
from proxies.gpt3 import proxy as gpt3
from proxies.transformer import describe, options
from proxies.transformer.encoder import (
    BERT_ORDER,
    NORMS,
    PRESETS,
    BertRuntime,
    masked_per_sample,
)
from proxies.transformer.fsdp import fsdp_text
from proxies.transformer.plan import gpt3_plans
from proxies.transformer.setup import Setup, padded_vocab

PROG = "proxies.bert"
DEFAULT_MODEL = "bert-large"
ORDERS = {"cpp": "pp-tp-dp", "megatron": "tp-dp-pp"}


def parser() -> argparse.ArgumentParser:
    p = cli.Parser(
        prog=f"python -m {PROG}",
        description="BERT training proxy: a bidirectional encoder with the masked-LM head, "
        "pipeline x data (x tensor) parallel, with real message sizes and compute that is "
        "real (NumPy, small presets), modelled (FLOPs / rate) or absent. Arguments as the "
        "C++ proxy: LAYERS STAGES; DP = world size / (tp * STAGES).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    options.add_shape(p, "pipeline stages")
    p.add_argument(
        "--model",
        choices=sorted([*PRESETS, cpp.PRESET]),
        default=DEFAULT_MODEL,
        help="preset widths (Devlin et al. 2019); bert-tiny (C=64) for tests; "
        f"{cpp.PRESET}: the C++ BERT-large proxy's iteration (24 layers, 4 stages, 8 "
        "micro-batches of 8 x 128 tokens, one allreduce per gradient tensor, no compute)",
    )
    p.add_argument("--tp", type=cli.positive_int, default=1, help="tensor-parallel degree")
    p.add_argument(
        "--norm",
        choices=NORMS,
        default="post",
        help="post: BERT's LayerNorm after each residual add; pre: before attention and MLP "
        "with a final LayerNorm (GPT's)",
    )
    options.add_micro_batch(p, "samples per micro-batch (default 8)")
    options.add_micro_batches(p, "micro-batches per iteration per replica (default 8)")
    p.add_argument(
        "--seq-len",
        type=cli.positive_int,
        metavar="T",
        help="tokens per sample (default 128, BERT's phase-1 length; at most 512)",
    )
    options.add_schedule(
        p, ("1f1b", "gpipe"), "gpipe: all forwards then all backwards (the C++ proxy's order)",
        default="1f1b",
    )  # fmt: skip
    options.add_order(
        p, "rank order, fastest dimension first: cpp = pp-tp-dp (stage = rank %% STAGES, "
        "as the C++ proxy), megatron = tp-dp-pp, or explicit like tp-pp-dp",
    )  # fmt: skip
    options.add_bucket_mb(
        p,
        "data-parallel gradient bucket size in MiB of float32 gradients: buckets are whole "
        "layers, allreduced as soon as the last micro-batch's backward finishes them "
        "(default: one bucket per layer)",
    )
    p.add_argument(
        "--inflight-buckets",
        type=cli.nonneg_int,
        default=2,
        metavar="N",
        help="gradient buckets in flight at once (0: no limit)",
    )
    p.add_argument(
        "--cp",
        type=cli.positive_int,
        default=1,
        metavar="N",
        help="context parallelism: not supported for BERT (only 1)",
    )
    options.add_fsdp(p)
    options.add_training(p, lr=1e-4, defaults_in_help=False)
    cli.add_common(
        p,
        compute=None,
        compute_help="real: the NumPy kernels on this rank's tensor-parallel shard; replay: "
        "each compute op timed once with the real kernels, then slept; model: sleep FLOPs / "
        f"--device-tflops; none: communication only (default: real for bert-tiny, none for "
        f"{cpp.PRESET}, model for the other presets)",
    )
    return p


def resolve(args, world: int) -> tuple[Setup, ProcessGrid]:
    """Check the options against each other and the world size; UsageError names the rule."""
    err = cli.UsageError
    preset = args.model == cpp.PRESET
    cfg = dataclasses.replace(PRESETS[cpp.WIDTHS if preset else args.model], norm=args.norm)
    if args.compute is None:
        args.compute = "none" if preset else "real" if args.model == "bert-tiny" else "model"
    if args.cp > 1:
        raise err(f"--cp {args.cp}: BERT's attention kernels have no context parallelism")
    L = args.layers or (cpp.LAYERS if preset else cfg.n_layer)
    pp = int(args.stages if options.given(args.stages) or not preset else cpp.STAGES)
    tp, B = args.tp, args.micro_batch or (cpp.B if preset else 8)
    T = args.seq_len or (cpp.T if preset else min(128, cfg.max_seq_len))
    m = args.micro_batches or cpp.MICRO_BATCHES
    if preset:
        for flag, bad in (
            ("--compute " + args.compute, args.compute != "none"),
            ("--tp", tp > 1),
            ("--bucket-mb", args.bucket_mb is not None),
            ("--data", args.data is not None),
        ):
            if bad:
                raise err(
                    f"{flag} does not apply to --model {cpp.PRESET}: the C++ BERT proxy "
                    "computes nothing and allreduces one message per gradient tensor after "
                    "the pipeline"
                )
        if pp < 2:
            raise err(f"--model {cpp.PRESET} needs STAGES >= 2 (the C++ proxy's pipeline)")
    if cfg.n_head % tp:
        raise err(f"--tp {tp} does not divide {args.model}'s {cfg.n_head} attention heads")
    options.check_shape(
        model=args.model, layers=L, stages=pp, world=world, seq_len=T,
        context=cfg.max_seq_len, micro_batches=m, tp=tp,
    )  # fmt: skip
    if T < 2:
        raise err(f"--seq-len {T}: BERT's two segments need at least 2 tokens")
    bucket = options.bucket_elements(args.bucket_mb) if args.bucket_mb is not None else 0
    fsdp_fields = options.fsdp_rules(
        args,
        world // (tp * pp),
        refused=((f"--model {cpp.PRESET}", preset), ("--bucket-mb", args.bucket_mb is not None)),
    )
    S = Setup(
        cfg.with_layers(L), B, T, m, tp, pp, world // (tp * pp), 1, False,
        padded_vocab(cfg.vocab_size, tp, 128), tuple(options.split_layers(L, pp)),
        bucket=bucket, inflight=args.inflight_buckets, model=args.model,
        schedule="cpp" if preset else args.schedule, bucket_mb=args.bucket_mb,
        param_order=BERT_ORDER, lr=args.lr, weight_decay=args.weight_decay, seed=args.seed,
        **fsdp_fields,
    )  # fmt: skip
    try:
        if not preset:
            SCHEDULES[S.schedule](pp, m, 0, 1)
        grid = ProcessGrid.create(ORDERS.get(args.order, args.order), tp=tp, pp=pp, dp=S.dp)
    except ValueError as e:
        raise err(str(e)) from None
    return S, grid


def make_job(args, world: int) -> runner.Job:
    S, grid = resolve(args, world)
    preset = S.schedule == "cpp"
    source = options.token_source(args, S.cfg.vocab_size, S.T, needed=not preset)
    plans = None if preset else gpt3_plans(S, grid, S.schedule)

    def plan(rank: int) -> Plan:
        if not preset:
            return with_transform_flops(plans(rank), S)
        c = grid.coords(rank)
        groups = {"pp": grid.group("pp", rank), "dp": grid.group("dp", rank)}
        ops = cpp.cpp_ops(S.cfg, S.split[c["pp"]], S.m, S.dp, c["pp"], groups["pp"], S.B, S.T)
        return Plan(rank, tuple(ops), groups, c)

    own = {"tp": S.tp, "vocab_padded": S.vocab, "dp_bucket": S.bucket, "norm": S.cfg.norm}
    own["masked_per_sample"] = masked_per_sample(S.T)
    own["fsdp_shard_size"] = S.fsdp or None  # FSDP's shard group (dp, or HSDP's N); None: off
    config = describe.config(S, grid, args, own, data="none" if preset else "synthetic")
    if preset:
        messages = (
            "activations B T (C+1) floats as the C++ proxy's · one blocking allreduce per "
            "gradient tensor after the pipeline"
        )
    else:
        messages = (
            f"TP collectives {S.N * S.cfg.n_embd:,} floats per layer part · masked "
            f"{masked_per_sample(S.T)} of {S.T} tokens per sample"
            + (f" · {fsdp_text(S)}" if S.fsdp else "")
        )
    header = describe.header(PROG, S, grid, args, source, messages=messages)
    if preset:  # the C++ message, not GPT's B T C
        act = cpp.activation(S.cfg.n_embd, S.B, S.T)
        gpt = f"pipeline {S.act:,} floats ({4 * S.act:,} B)"
        header[2] = header[2].replace(gpt, f"pipeline {act:,} floats ({4 * act:,} B)")
    hooks = gpt3.dry_run_hooks(S)
    if preset:  # no pools of GPT-3's: the C++ iteration
        hooks = {"traffic_by": ("pp", "stages"), "ops_by_default": False}
    return gpt3.transformer_job(
        PROG,
        SPEC,
        S,
        grid,
        args,
        plan=plan,
        runtime=gpt3.stage_runtime(S, grid, plan, source, BertRuntime),
        config=config,
        header=header,
        groups=("pp", "tp", "dp", "embed", "fsdp", "hsdp"),
        grads=("dp_allreduce", "embed_allreduce"),
        hooks=hooks,
    )


def with_transform_flops(plan: Plan, S: Setup) -> Plan:
    """GPT's head pieces plus the MLM transform's FLOPs (dense C x C, replicated on every
    TP rank): 2 N C^2 forward, twice that backward; the decoder's are GPT's LM head's."""
    f = 2.0 * S.N * S.cfg.n_embd**2
    extra = {"fwd_head": f, "bwd_head": 2 * f}
    ops = tuple(
        dataclasses.replace(op, flops=op.flops + extra[op.name])
        if isinstance(op, Compute) and op.name in extra
        else op
        for op in plan.ops
    )
    return dataclasses.replace(plan, ops=ops)


def main(argv: list[str] | None = None) -> int:
    return runner.main(make_job, parser(), argv)


def entry() -> None:
    cli.run_main(PROG, main, sys.argv[1:])
