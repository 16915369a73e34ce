"""The options every proxy shares, and the error discipline.

Bad input is one line on stderr from rank 0 and exit status 2 on every rank: never a hang,
never one traceback per rank. Parsing happens before MPI starts (and `--dry-run` never
starts it), so the rank comes from the launcher's environment here.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from proxies.core.machine import Machine

COMPUTE_MODES = ("real", "replay", "model", "none")
ALLREDUCE_ALGS = (
    "mpi",
    "ring",
    "tree",
    "rhd",
    "rd",
    "dbtree",
    "hier",
    "naive",
)  # proxies.collectives
# --dtype / --grad-dtype names -> the dtype names plans carry (see core/wire.py).
WIRE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# --predict: how collectives are priced on a machine model (see core/predict.py)
PREDICT_DETAILS = ("auto", "steps", "coarse")

# Launchers export the world rank under different names; MPI itself is not started yet.
RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PALS_RANKID", "SLURM_PROCID")


class UsageError(Exception):
    """Bad input: shown once by rank 0, exit status 2."""


def env_rank() -> int:
    for var in RANK_VARS:
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 0


def say(msg: str, *, file=sys.stderr) -> None:
    """Print on rank 0 only."""
    if env_rank() == 0:
        print(msg, file=file, flush=True)


class Parser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of printing usage on every rank."""

    def error(self, message: str):  # noqa: D102
        raise UsageError(message)

    def print_help(self, file=None):  # noqa: D102
        if env_rank() == 0:
            super().print_help(file)


def _int_type(minimum: int, what: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse


positive_int = _int_type(1, "a positive integer")
nonneg_int = _int_type(0, "a non-negative integer")


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


class _Given(argparse.Action):
    """Store the value and remember it came from the command line (a machine file's figure
    then does not replace it)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, self.dest + "_given", True)


COMPUTE_HELP = (
    "real: run the NumPy kernels every micro-batch; replay: time each compute op with the "
    "real kernels once, ranks on a node taking turns, then sleep those times "
    "(one-device-per-rank timing on few cores); model: sleep FLOPs / --device-tflops (or "
    "a proxy's known per-op times); none: communication only"
)


def add_common(
    p: argparse.ArgumentParser,
    *,
    iters: int = 5,
    warmup: int = 2,
    compute: str | None = "real",
    compute_help: str = COMPUTE_HELP,
) -> None:
    """The shared options. `compute=None` leaves the mode for the proxy to resolve (e.g.
    per preset); `compute_help` then says how, with the default."""
    g = p.add_argument_group("common proxy options")
    g.add_argument(
        "--iters", type=positive_int, default=iters, help=f"timed iterations (default {iters})"
    )
    g.add_argument(
        "--warmup",
        type=nonneg_int,
        default=warmup,
        help=f"untimed iterations before them (default {warmup})",
    )
    g.add_argument(
        "--compute",
        choices=COMPUTE_MODES,
        default=compute,
        help=compute_help + (f" (default {compute})" if compute else ""),
    )
    g.add_argument(
        "--device-tflops",
        type=positive_float,
        action=_Given,
        default=150.0,
        metavar="TFLOPS",
        help="achieved device rate for --compute model, in TFLOP/s (default 150: "
        "about half an A100's 312 bf16 peak)",
    )
    g.add_argument(
        "--allreduce",
        choices=ALLREDUCE_ALGS,
        default="mpi",
        help="algorithm of every allreduce: mpi (the library's own, the default) or ours over "
        "point-to-point (see python -m proxies.collectives); ours run to completion where "
        "they start, so a non-blocking allreduce loses its overlap",
    )
    g.add_argument(
        "--dtype",
        choices=tuple(WIRE_DTYPES),
        default="fp32",
        help="element type on the wire of activations and of tensor-, sequence- and "
        "expert-parallel traffic: fp32 (default), bf16 or fp16 (2 bytes; real compute stays "
        "float32 and is rounded to it when sent)",
    )
    g.add_argument(
        "--grad-dtype",
        choices=tuple(WIRE_DTYPES),
        default="fp32",
        help="element type of gradient reductions: fp32 (default), bf16 or fp16 (summed in "
        "float32, rounded to 16 bits after each addition, as NCCL does)",
    )
    g.add_argument(
        "--seed", type=nonneg_int, default=0, help="seed for weights and synthetic data (default 0)"
    )
    g.add_argument(
        "--check",
        action="store_true",
        help="verify every received message against the sender's checksum and "
        "every reduced buffer against the sum of its inputs (adds small "
        "messages: do not time with it)",
    )
    g.add_argument(
        "--json", metavar="PATH", help="write the results as one JSON object to PATH (rank 0)"
    )
    g.add_argument(
        "--dry-run",
        action="store_true",
        help="print and validate the plan of one iteration per rank, without MPI",
    )
    g.add_argument(
        "--world-size",
        type=positive_int,
        metavar="N",
        help="with --dry-run: plan for N ranks (default: the launcher's size, or 1)",
    )
    g.add_argument(
        "--show-ranks",
        metavar="LIST",
        help="with --dry-run: ranks whose ops are listed, e.g. 0,5,7 or all "
        "(default: all up to 16 ranks, else the first rank of each stage)",
    )
    g.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="watchdog: abort with a diagnosis when a rank makes no progress for "
        "this long (default 300; 0 disables)",
    )
    g.add_argument(
        "--wait",
        choices=("auto", "spin", "yield"),
        default="auto",
        help="how ranks wait for peers: spin = MPI's blocking calls (busy-polling); "
        "yield = test and sleep 20 us..1 ms, leaving the cores to ranks with "
        "work; auto = yield when a node has more ranks than cores, else spin",
    )
    g.add_argument(
        "--progress",
        choices=("thread", "test"),
        default="thread",
        help="how non-blocking collectives (gradient buckets) advance while the rank computes: "
        "thread = a helper thread polls MPI every 100 us while any is pending (as a GPU's "
        "communication stream; the default); test = only when tested between ops (MPI "
        "without asynchronous progress moves nothing during compute)",
    )
    g.add_argument("--quiet", action="store_true", help="print only the summary line")
    from proxies.core import memory  # imports cli: here, not at the top

    memory.add_option(g)
    add_machine(p)


def env_world_size() -> int | None:
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "PALS_SIZE", "SLURM_NTASKS"):
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return None


def run_main(
    prog: str, main: Callable[[list[str] | None], int | None], argv: list[str] | None = None
) -> None:
    """Run a proxy's main: UsageError -> one line from rank 0, exit 2."""
    try:
        code = main(argv)
    except UsageError as e:
        say(f"{prog}: error: {e}")
        sys.exit(2)
    sys.exit(code or 0)


def wire_dtypes(args) -> tuple[str, str]:
    """(activation/parallel traffic dtype, gradient dtype) as plan dtype names."""
    return WIRE_DTYPES[args.dtype], WIRE_DTYPES[args.grad_dtype]


def add_machine(p: argparse.ArgumentParser) -> None:
    """The prediction options: a machine model file, its placement, what-if overrides."""
    g = p.add_argument_group("machine model (prediction)")
    g.add_argument(
        "--machine",
        metavar="FILE",
        help="predict on this machine model (configs/machines/*.yaml, or one written by "
        "python -m proxies calibrate): with --dry-run the predicted iteration and "
        "breakdown; on a real run predicted beside measured",
    )
    g.add_argument(
        "--ranks-per-node",
        type=positive_int,
        metavar="N",
        help="with --machine: N ranks per node (ranks k*N .. k*N+N-1 on node k), instead "
        "of the file's nodes.ranks_per_node",
    )
    g.add_argument(
        "--machine-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --machine: change one figure of the file, e.g. "
        "'inter_node.bandwidth=25 Gb/s' (a what-if; repeatable; null removes a key)",
    )
    g.add_argument(
        "--predict",
        choices=PREDICT_DETAILS,
        default="auto",
        help="with --machine: collectives priced message by message (steps: exact to the "
        "algorithm), by aggregated phases (coarse: scales to thousands of ranks), or steps "
        "while that stays small (auto, the default)",
    )


def machine(args: argparse.Namespace) -> Machine | None:
    """The Machine of --machine (None without it); a bad file or override is a UsageError."""
    if getattr(args, "machine", None) is None:
        for given, option in (
            (args.machine_set, "--machine-set"),
            (args.ranks_per_node, "--ranks-per-node"),
        ):
            if given:
                raise UsageError(f"{option} goes with --machine FILE")
        return None
    return load_machine(args.machine, args.machine_set, args.ranks_per_node)


def load_machine(path: str, overrides=(), ranks_per_node: int | None = None) -> Machine:
    """A machine file with its overrides; a bad file or override is a UsageError."""
    from proxies.core import machine as machines

    try:
        return machines.load(path, overrides, ranks_per_node)
    except machines.MachineError as e:
        raise UsageError(str(e)) from None


def use_machine(args):
    """The machine model of --machine (None without it), with what it implies for the run:
    its device rate becomes --device-tflops unless that was given."""
    m = machine(args)
    if m is None:
        return None
    if m.device_flops and not getattr(args, "device_tflops_given", False):
        args.device_tflops = m.device_flops / 1e12
    return m
