"""What the GPT front ends share of their command lines: the options both take, the rules
that check them against each other and the world size (written once, so gpt2 and gpt3
refuse the same mistakes with the same words), and the stage split."""

from __future__ import annotations

import argparse
import dataclasses
import math

import numpy as np

from proxies.core import cli, memory
from proxies.transformer.config import GPT2Config
from proxies.transformer.data import DataError, Synthetic, TokenFile

MAX_TAG_MICROBATCHES = 16383  # m * v: pipeline tags stay below 32768 (core/pipeline.py)
DEFAULT_BUCKET_MB = 25.0  # PyTorch DDP's bucket_cap_mb
MAX_BUCKET_MB = 1e6  # a bucket past a TiB is one bucket
BUCKET_MB = cli.number(
    min=0, max=MAX_BUCKET_MB, what=f"a number >= 0 (MiB, at most {MAX_BUCKET_MB:g})"
)


def add_shape(p: argparse.ArgumentParser, stages_help: str) -> None:
    """LAYERS STAGES, positional as the C++ proxies take them."""
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
        default=Default(1),
        metavar="STAGES",
        help=stages_help,
    )


MAX_CONTEXT = 2**24  # position-embedding rows: 16M tokens, past any model trained today


def add_seq_len(p: argparse.ArgumentParser, help: str) -> None:
    """--seq-len (Megatron's --seq-length), the default the front end's to resolve; and
    --context (Megatron's --max-position-embeddings), the rows of the position embedding,
    for sequences longer than the preset's (context parallelism's long contexts)."""
    p.add_argument("--seq-len", "--seq-length", type=cli.positive_int, metavar="T", help=help)
    p.add_argument(
        "--context",
        "--max-position-embeddings",
        type=cli.integer(min=1, max=MAX_CONTEXT, what=f"an integer in 1..{MAX_CONTEXT}"),
        metavar="N",
        help="rows of the position embedding, the longest --seq-len (default: the preset's "
        "context); e.g. gpt2-xl at --seq-len 16384 --context 16384 --cp 8",
    )


def with_context(args: argparse.Namespace, cfg: GPT2Config) -> GPT2Config:
    """The preset with --context rows of position embedding, where given."""
    n = getattr(args, "context", None)
    return cfg if n is None else dataclasses.replace(cfg, max_seq_len=n)


def add_micro_batch(p: argparse.ArgumentParser, help: str, default: int | None = None) -> None:
    """--micro-batch (Megatron's --micro-batch-size): samples per micro-batch."""
    p.add_argument(
        "--micro-batch",
        "--micro-batch-size",
        type=cli.positive_int,
        default=default,
        metavar="B",
        help=help,
    )


def add_micro_batches(p: argparse.ArgumentParser, help: str, positional: int | None = None) -> None:
    """--micro-batches M: micro-batches per iteration per replica. `positional`: the front
    end also takes them as its third positional (gpt2, as the C++ proxy), defaulting to
    this; `micro_batches` resolves the two."""
    if positional is not None:
        p.add_argument(
            "micro_batches",
            type=cli.positive_int,
            nargs="?",
            default=Default(positional),
            metavar="MICROBATCHES",
            help=help,
        )
    p.add_argument(
        "--micro-batches",
        dest="micro_batches_option" if positional is not None else "micro_batches",
        type=cli.positive_int,
        metavar="M",
        help="the same as MICROBATCHES (give one, or equal)" if positional is not None else help,
    )


def micro_batches(args: argparse.Namespace) -> None:
    """MICROBATCHES from --micro-batches where the front end has both: only where the
    positional is not given, or gives the same number."""
    option = getattr(args, "micro_batches_option", None)
    if option is None:
        return
    if given(args.micro_batches) and args.micro_batches != option:
        raise cli.UsageError(
            f"--micro-batches {option} and MICROBATCHES = {args.micro_batches} differ: give one"
        )
    args.micro_batches = option


def add_schedule(
    p: argparse.ArgumentParser, choices: tuple[str, ...], help: str, default: str | None = None
) -> None:
    """--schedule: the pipeline schedule (core/schedules.py)."""
    p.add_argument("--schedule", choices=choices, default=default, help=help)


def add_bucket_mb(p: argparse.ArgumentParser, help: str) -> None:
    """--bucket-mb: a data-parallel gradient bucket's size in MiB of float32 gradients
    (bucket_elements converts it; core/grads.py closes buckets at it)."""
    p.add_argument("--bucket-mb", type=BUCKET_MB, metavar="MB", help=help)


def add_order(p: argparse.ArgumentParser, help: str) -> None:
    """--order: the rank order, fastest dimension first (core/grid.py reads it)."""
    p.add_argument("--order", default="cpp", metavar="ORDER", help=help)


def add_training(p: argparse.ArgumentParser, lr: float, defaults_in_help: bool) -> None:
    """AdamW's learning rate and weight decay, and the token source. `defaults_in_help`:
    the parser's formatter does not add the defaults itself."""

    def d(text: str) -> str:
        return f" (default {text})" if defaults_in_help else ""

    p.add_argument(
        "--lr",
        type=cli.learning_rate,
        default=lr,
        help=f"AdamW learning rate, in (0, {cli.LR_MAX:g}]" + d(f"{lr:g}"),
    )
    p.add_argument(
        "--weight-decay",
        type=cli.weight_decay,
        default=0.0,
        help="AdamW weight decay, in [0, 1]" + d("0"),
    )
    p.add_argument(
        "--data", metavar="FILE", help="llm.c token file (.bin); default: synthetic tokens"
    )


def token_source(args: argparse.Namespace, vocab: int, T: int, *, needed: bool = True):
    """--data's token file (a dry run does not open it), else synthetic tokens from --seed;
    None for a dry run with --data, or without --data when the run trains nothing
    (`needed` False: gpt2's C++ schedule). A file that does not fit is a usage error."""
    if args.data and not args.dry_run:
        try:
            return TokenFile(args.data, vocab, T)
        except DataError as e:
            raise cli.UsageError(str(e)) from None
    if not args.data and needed:
        return Synthetic(args.seed, vocab, T)
    return None


def bucket_elements(mb: float) -> int:
    """A bucket size in MiB as float32 elements: a bucket closes once it holds this many."""
    return math.ceil(mb * 2**20 / 4)


def split_layers(L: int, pp: int) -> list[range]:
    """Contiguous layer ranges, sizes differing by at most one; the first L % pp stages take
    the extra layers (the last stage already carries the LM head). None is dropped."""
    base, extra = divmod(L, pp)
    bounds = np.cumsum([0] + [base + (s < extra) for s in range(pp)])
    return [range(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def check_shape(
    *,
    model: str,
    layers: int,
    stages: int,
    world: int,
    seq_len: int,
    context: int,
    micro_batches: int,
    tp: int | None = None,
    virtual: int = 1,
) -> None:
    """The rules every GPT front end applies; UsageError names the one broken. `tp`: the
    tensor-parallel degree of a front end that has --tp (None: it has none)."""
    memory.check_layers(layers)
    err = cli.UsageError
    pp, L = stages, layers
    if pp > L:
        raise err(f"STAGES = {pp} is more than LAYERS = {L}: every stage needs at least one layer")
    if tp is None and world % pp:
        raise err(
            f"world size {world} is not a multiple of STAGES = {pp} (the "
            "data-parallel degree is world size / STAGES)"
        )
    if tp is not None and world % (tp * pp):
        raise err(
            f"world size {world} is not dp * tp * pp: not a multiple of --tp {tp} x "
            f"STAGES {pp} = {tp * pp}"
        )
    if seq_len > context:
        raise err(
            f"--seq-len {seq_len} is longer than {model}'s context of {context} (--context N "
            "lengthens its position embedding)"
        )
    if micro_batches * virtual > MAX_TAG_MICROBATCHES:
        what = (
            f"MICROBATCHES = {micro_batches}"
            if tp is None
            else f"--micro-batches {micro_batches} x --virtual-stages {virtual}"
        )
        raise err(f"{what}: at most {MAX_TAG_MICROBATCHES} (message tags)")


# -- Megatron-LM's names -----------------------------------------------------------------
# Options whose meaning is exactly a native one's take Megatron's spelling as a second
# option string (--tensor-model-parallel-size = --tp, ...). The ones below stand for a
# positional, or are converted, so they are options of their own, resolved by megatron_*.


class Default(int):
    """A positional's default that can be told from the same number given: Megatron's
    name for it may replace a default, not a value given."""


def given(value: int | None) -> bool:
    return value is not None and not isinstance(value, Default)


def add_megatron(p: argparse.ArgumentParser, *, virtual: bool = False) -> None:
    """--num-layers, --pipeline-model-parallel-size, --global-batch-size (and, `virtual`,
    --num-layers-per-virtual-pipeline-stage) in a group of their own."""
    g = p.add_argument_group(
        "Megatron-LM's names",
        "accepted for what they mean in Megatron-LM; Megatron's names of options above "
        "(--seq-length, --micro-batch-size ...) are listed with them",
    )
    g.add_argument(
        "--num-layers", type=cli.positive_int, metavar="L", help="LAYERS (give one, or equal)"
    )
    g.add_argument(
        "--pipeline-model-parallel-size",
        type=cli.positive_int,
        metavar="PP",
        help="STAGES (give one, or equal)",
    )
    g.add_argument(
        "--global-batch-size",
        type=cli.positive_int,
        metavar="GBS",
        help="samples per iteration = micro-batch x micro-batches x data-parallel degree: "
        "sets the micro-batches once the world size is known (refused unless it divides)",
    )
    if virtual:
        g.add_argument(
            "--num-layers-per-virtual-pipeline-stage",
            type=cli.positive_int,
            metavar="N",
            help="layers per model chunk: --virtual-stages = layers per stage / N",
        )


def megatron_shape(args: argparse.Namespace) -> None:
    """LAYERS and STAGES from --num-layers / --pipeline-model-parallel-size: only where the
    positional is not given, or gives the same number."""
    for dest, alias, name, option in (
        ("layers", "num_layers", "LAYERS", "--num-layers"),
        ("stages", "pipeline_model_parallel_size", "STAGES", "--pipeline-model-parallel-size"),
    ):
        value, other = getattr(args, dest), getattr(args, alias, None)
        if other is not None:
            if given(value) and value != other:
                raise cli.UsageError(f"{option} {other} and {name} = {value} differ: give one")
            value = other
        setattr(args, dest, None if value is None else int(value))


def megatron_batch(args: argparse.Namespace, world: int, model_parallel: int, name: str) -> None:
    """--micro-batches (named `name` on this front end) from --global-batch-size: GBS /
    (micro-batch x dp), dp = world / `model_parallel`. A world that does not divide is left
    for check_shape to name."""
    gbs = getattr(args, "global_batch_size", None)
    m = args.micro_batches
    if gbs is not None and world % model_parallel == 0:
        dp = world // model_parallel
        per = args.micro_batch * dp
        if gbs % per:
            raise cli.UsageError(
                f"--global-batch-size {gbs} is not a multiple of micro-batch {args.micro_batch} "
                f"x data-parallel degree {dp} = {per}"
            )
        if given(m) and m != gbs // per:
            raise cli.UsageError(
                f"--global-batch-size {gbs} is {gbs // per} micro-batches of {args.micro_batch} "
                f"x dp {dp}, not {name} {m}: give one"
            )
        m = gbs // per
    args.micro_batches = None if m is None else int(m)


def megatron_virtual(args: argparse.Namespace, layers: int, stages: int) -> int:
    """--virtual-stages, from --num-layers-per-virtual-pipeline-stage N where given: the
    layers per stage / N (Megatron: num_layers // pp // N)."""
    n, v = args.num_layers_per_virtual_pipeline_stage, args.virtual_stages
    if n is None:
        return int(v)
    if layers % stages:
        raise cli.UsageError(
            f"--num-layers-per-virtual-pipeline-stage {n}: LAYERS = {layers} must be a "
            f"multiple of STAGES = {stages}"
        )
    per = layers // stages
    if per % n:
        raise cli.UsageError(
            f"--num-layers-per-virtual-pipeline-stage {n} does not divide the {per} layers "
            f"per stage (LAYERS {layers} / STAGES {stages})"
        )
    if given(v) and v != per // n:
        raise cli.UsageError(
            f"--num-layers-per-virtual-pipeline-stage {n} is {per // n} virtual stages, not "
            f"--virtual-stages {v}: give one"
        )
    return per // n


# -- context parallelism -------------------------------------------------------------------


def add_cp(p: argparse.ArgumentParser) -> None:
    """--cp and how it splits the sequence and exchanges keys and values
    (transformer/cpmod.py); the rules are cp_rules'."""
    from proxies.transformer import cp as cpmod

    g = p.add_argument_group("context parallelism")
    g.add_argument(
        "--cp",
        "--context-parallel-size",
        type=cli.positive_int,
        default=1,
        metavar="N",
        help="context-parallel degree: each sequence split over N ranks by its tokens "
        "(cp x dp x tp x pp = world size)",
    )
    g.add_argument(
        "--cp-split",
        choices=cpmod.SPLITS,
        default="zigzag",
        help="which tokens each cp rank holds: contiguous blocks, interleaved (token t on "
        "rank t mod N) or zigzag (2N chunks, rank i holds i and 2N-1-i: Megatron-LM's, "
        "balanced; the default)",
    )
    g.add_argument(
        "--cp-comm",
        choices=cpmod.COMMS,
        default="ring",
        help="what attention exchanges per layer: allgather (the keys and values of all "
        "ranks), ring (N-1 key/value block passes, Megatron-LM's p2p; the default) or "
        "alltoall (DeepSpeed Ulysses: sequence shards <-> head shards)",
    )
    g.add_argument(
        "--cp-grad-reduce",
        choices=cpmod.GRAD_REDUCES,
        help="with --cp-comm allgather: the key/value gradients' reduction: one allreduce "
        "(the default), N reduces each rooted at the keys' owner, or a reduce-scatter",
    )


def cp_rules(
    args: argparse.Namespace, world: int, *, T: int, heads: int, tp: int, pp: int, sp: bool
) -> dict:
    """The --cp options checked against each other and the world size (UsageError names
    the rule broken): Setup's cp fields."""
    n, err = args.cp, cli.UsageError
    if n == 1:
        return {}
    if world % (n * tp * pp):
        tp_text = f"--tp {tp} x " if tp > 1 else ""
        raise err(
            f"world size {world} is not cp * dp * tp * pp: not a multiple of --cp {n} x "
            f"{tp_text}STAGES {pp} = {n * tp * pp}"
        )
    if args.cp_grad_reduce is not None and args.cp_comm != "allgather":
        raise err(f"--cp-grad-reduce needs --cp-comm allgather (it is {args.cp_comm})")
    parts = 2 * n if args.cp_split == "zigzag" else n
    if T % parts:
        what = f"2 x --cp {n} = {parts} (zigzag's chunks)" if parts != n else f"--cp {n}"
        raise err(f"--seq-len {T} is not a multiple of {what}")
    if sp and (T // n) % tp:
        raise err(
            f"--sequence-parallel with --cp {n}: the {T // n} tokens per cp rank are not a "
            f"multiple of --tp {tp}"
        )
    if args.cp_comm == "alltoall" and (heads // tp) % n:
        raise err(
            f"--cp-comm alltoall splits the {heads // tp} attention heads per tensor-parallel "
            f"rank over --cp {n}: not a multiple"
        )
    return {
        "cp": n,
        "cp_split": args.cp_split,
        "cp_comm": args.cp_comm,
        "cp_reduce": args.cp_grad_reduce or "allreduce",
    }


# -- FSDP / ZeRO-3 -------------------------------------------------------------------------


def add_fsdp(p: argparse.ArgumentParser) -> None:
    """--fsdp and --fsdp-shard-size (transformer/fsdp.py); the rules are fsdp_rules'."""
    g = p.add_argument_group("fully sharded data parallelism (FSDP, ZeRO-3)")
    g.add_argument(
        "--fsdp",
        action="store_true",
        help="shard parameters, gradients and optimizer state over the data-parallel group "
        "by unit (a layer, the embedding, the rest); each unit all-gathered before its "
        "forward and again before its backward, the next unit's gather prefetched; its "
        "gradients reduce-scattered as soon as the last micro-batch's backward is done with "
        "it; AdamW on this rank's shards",
    )
    g.add_argument(
        "--fsdp-shard-size",
        type=cli.positive_int,
        metavar="N",
        help="with --fsdp: hybrid sharding (HSDP): shard within groups of N consecutive "
        "data-parallel ranks, replicate over the dp / N groups (the reduced shards "
        "allreduced across them); default: the whole data-parallel group",
    )


def fsdp_rules(
    args: argparse.Namespace,
    dp: int,
    *,
    moe: bool = False,
    cp: int = 1,
    sp: bool = False,
    virtual: int = 1,
    refused: tuple[tuple[str, bool], ...] = (),
) -> dict:
    """--fsdp / --fsdp-shard-size checked against the run (UsageError names the rule):
    Setup's fsdp field. `refused`: the front end's own options that do not combine with
    FSDP, as (option text, given). Context parallel ranks hold the same parameters: FSDP
    shards over the dp x cp ranks of a (tp, pp) coordinate (torchtitan's and Megatron's
    layout); sequence parallelism's partial gradients are summed over tp on the shards."""
    err = cli.UsageError
    n = getattr(args, "fsdp_shard_size", None)
    if not getattr(args, "fsdp", False):
        if n is not None:
            raise err(f"--fsdp-shard-size {n} needs --fsdp")
        return {}
    ranks = dp * cp  # the group FSDP shards over
    if ranks < 2:
        raise err("--fsdp shards over the data-parallel group, and its degree is 1")
    for what, bad in (
        *refused,
        ("--moe-experts", moe),
        (f"--virtual-stages {virtual}", virtual > 1),
    ):
        if bad:
            raise err(f"--fsdp does not combine with {what}")
    n = ranks if n is None else n
    if n < 2 or ranks % n:
        group = f"data-parallel degree {dp}" if cp == 1 else f"dp x cp ranks {ranks}"
        raise err(f"--fsdp-shard-size {n} must be at least 2 and divide the {group}")
    return {"fsdp": n}
