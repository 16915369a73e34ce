"""What the GPT front ends share of their command lines: the options both take, the rules
that check them against each other and the world size (written once, so gpt2 and gpt3
refuse the same mistakes with the same words), and the stage split."""

from __future__ import annotations

import argparse
import math

import numpy as np

from proxies.core import cli, memory
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
        default=1,
        metavar="STAGES",
        help=stages_help,
    )


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
        raise err(f"--seq-len {seq_len} is longer than {model}'s context of {context}")
    if micro_batches * virtual > MAX_TAG_MICROBATCHES:
        what = (
            f"MICROBATCHES = {micro_batches}"
            if tp is None
            else f"--micro-batches {micro_batches} x --virtual-stages {virtual}"
        )
        raise err(f"{what}: at most {MAX_TAG_MICROBATCHES} (message tags)")
