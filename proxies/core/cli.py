"""The options every proxy shares, and the error discipline.

Bad input is one line on stderr from rank 0 and exit status 2 on every rank: never a hang,
never one traceback per rank. Parsing happens before MPI starts (and `--dry-run` never
starts it), so the rank comes from the launcher's environment here.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from proxies.core import exits

if TYPE_CHECKING:
    from proxies.core.machine import Machine

COMPUTE_MODES = ("real", "replay", "model", "none")
# --dtype / --grad-dtype names -> the dtype names plans carry (see core/wire.py).
WIRE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# --predict: how collectives are priced on a machine model (see core/predict.py)
PREDICT_DETAILS = ("auto", "steps", "coarse")

# Launchers export the world rank under different names; MPI itself is not started yet.
RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PALS_RANKID", "SLURM_PROCID")
# Each rank variable with the size variable its launcher sets beside it.
SIZE_OF = {
    "PMI_RANK": "PMI_SIZE",
    "OMPI_COMM_WORLD_RANK": "OMPI_COMM_WORLD_SIZE",
    "PMIX_RANK": "PMIX_SIZE",
    "PALS_RANKID": "PALS_SIZE",
    "SLURM_PROCID": "SLURM_NTASKS",
}
# A live MPICH hydra / Slurm PMI-1/2 launch also hands the process its PMI connection; a
# PMI_RANK without one is left over from a batch script (no launcher started this process).
PMI_LINKS = ("PMI_FD", "PMI_PORT")


class UsageError(Exception):
    """Bad input: shown once by rank 0, exit status 2."""


def _launch() -> tuple[int, int] | None:
    """(rank, size) from the first launcher whose variables are consistent, else None.

    Only rank 0 prints errors, so a stale rank variable (PMI_RANK=3 exported by a batch
    script around a plain `python -m ...`) would silence every message: a rank variable
    counts only with its size variable beside it, rank < size, and for PMI a connection.
    """
    for var in RANK_VARS:
        rank, size = os.environ.get(var, "").strip(), os.environ.get(SIZE_OF[var], "").strip()
        if not rank:
            continue
        if not (rank.isdigit() and size.isdigit() and int(rank) < int(size)):
            continue  # inconsistent: no launcher we can trust under this name
        if var == "PMI_RANK" and not any(os.environ.get(v) for v in PMI_LINKS):
            continue
        return int(rank), int(size)
    return None


def env_rank() -> int:
    """This process's world rank as its launcher says; 0 when no consistent launcher
    environment is found (then this process prints its own errors)."""
    found = _launch()
    return found[0] if found else 0


def say(msg: str, *, file=sys.stderr) -> None:
    """Print on rank 0 only."""
    if env_rank() == 0:
        print(msg, file=file, flush=True)


class Parser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of printing usage on every rank, and keeps
    `arguments`: every Action added, in order, argument groups included. argparse has no
    public list of a parser's actions; the sweep (sweep/proxyargs.py) checks a sweep file's
    args against this one."""

    def __init__(self, *args, **kwargs) -> None:
        self.arguments: list[argparse.Action] = []  # before super(): it adds --help
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs) -> argparse.Action:  # noqa: D102
        action = super().add_argument(*args, **kwargs)
        self.arguments.append(action)
        return action

    def add_argument_group(self, *args, **kwargs):  # noqa: D102
        return self._recording(super().add_argument_group(*args, **kwargs))

    def add_mutually_exclusive_group(self, *args, **kwargs):  # noqa: D102
        return self._recording(super().add_mutually_exclusive_group(*args, **kwargs))

    def _recording(self, group):
        """The group, its add_argument also recording into self.arguments."""
        add = group.add_argument

        def add_argument(*args, **kwargs) -> argparse.Action:
            action = add(*args, **kwargs)
            self.arguments.append(action)
            return action

        group.add_argument = add_argument
        group.add_argument_group = lambda *a, **k: self._recording(
            type(group).add_argument_group(group, *a, **k)
        )
        group.add_mutually_exclusive_group = lambda *a, **k: self._recording(
            type(group).add_mutually_exclusive_group(group, *a, **k)
        )
        return group

    def error(self, message: str):  # noqa: D102
        raise UsageError(message)

    def print_help(self, file=None):  # noqa: D102
        if env_rank() == 0:
            super().print_help(file)


INT_MAX = 2**63 - 1  # every count ends up in NumPy's int64 or MPI's counts
# Counts whose work explodes (documented in the README, "Memory and huge counts"):
MAX_ITERS = 1_000_000  # --iters, --warmup: a million iterations of even 1 ms is 17 minutes
# --world-size of a dry run: at 2^20 ranks the folded dry run takes about a second and
# 120 MB; at 10^8 it took 29 s and 6 GB (per-rank arrays and JSON lists).
MAX_WORLD = 1 << 20


class _Number:
    """An argparse type: a finite number in a range, one clear message otherwise.

    Every numeric option of every entry point goes through one of these, so nan, inf, an
    empty string, a float where an integer is due ("2.5", "1e3": never truncated) and a
    value out of range are refused at parse time, before MPI starts. The bounds stay on the
    object (`minimum`, `maximum`) for --help texts and the tests.
    """

    def __init__(
        self,
        *,
        integer: bool,
        minimum: float | None,
        maximum: float | None,
        open_min: bool,
        open_max: bool,
        zero: bool,
        what: str | None,
    ):
        self.integer, self.minimum, self.maximum = integer, minimum, maximum
        self.open_min, self.open_max, self.zero = open_min, open_max, zero
        self.what = what or self.describe()
        self.__name__ = "integer" if integer else "number"  # argparse names the type in errors

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a number"
        lo, hi = self.minimum, self.maximum
        if lo == 0 and self.open_min and hi is None:
            text = f"a positive {kind.split()[-1]}"
        elif lo == 0 and hi is None:
            text = f"a non-negative {kind.split()[-1]}"
        else:
            parts = []
            if lo is not None:
                parts.append(f"{'>' if self.open_min else '>='} {lo:g}")
            if hi is not None and not (self.integer and hi == INT_MAX):
                parts.append(f"{'<' if self.open_max else '<='} {hi:g}")
            text = f"{kind} {' and '.join(parts)}" if parts else kind
        return text + (" (or 0)" if self.zero else "")

    def __call__(self, text: str) -> int | float:
        value: int | float
        try:
            value = int(text) if self.integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {self.what}, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected {self.what}, got {text!r}")
        value += 0  # -0.0 -> 0.0
        if self.zero and value == 0:
            return value
        lo, hi = self.minimum, self.maximum
        below = lo is not None and (value < lo or (self.open_min and value == lo))
        above = hi is not None and (value > hi or (self.open_max and value == hi))
        if above and self.integer and hi != INT_MAX:  # a documented cap: say it
            raise argparse.ArgumentTypeError(f"{value:,}: at most {hi:,}")
        if below or above:
            raise argparse.ArgumentTypeError(f"expected {self.what}, got {text.strip()}")
        return value


def number(
    *,
    min: float | None = None,  # noqa: A002 (the names read best at the call sites)
    max: float | None = None,  # noqa: A002
    open_min: bool = False,
    open_max: bool = False,
    zero: bool = False,
    what: str | None = None,
) -> Callable[[str], float]:
    """A finite float in [min, max] (open ends with open_min / open_max); `zero` also
    admits exactly 0 (an "off" value outside the range, as --timeout 0)."""
    return _Number(
        integer=False,
        minimum=min,
        maximum=max,
        open_min=open_min,
        open_max=open_max,
        zero=zero,
        what=what,
    )


def integer(
    *, min: float | None = None, max: float = INT_MAX, zero: bool = False, what: str | None = None
) -> Callable[[str], int]:  # noqa: A002
    """An integer (written as one: "2.0" and "1e3" are refused, not truncated) in [min, max]."""
    return _Number(
        integer=True,
        minimum=min,
        maximum=max,
        open_min=False,
        open_max=False,
        zero=zero,
        what=what,
    )


positive_int = integer(min=1, what="a positive integer")
nonneg_int = integer(min=0, what="a non-negative integer")
positive_float = number(min=0, open_min=True, what="a positive number")
nonneg_float = number(min=0, what="a number >= 0")

# Ranges of the shared options (stated in --help).
TIMEOUT_MIN_S = 1.0  # a shorter watchdog would fire between two healthy ops
TIMEOUT_MAX_S = 1e6  # about 11 days; far longer sleeps overflow the C timers
timeout_seconds = number(
    min=TIMEOUT_MIN_S,
    max=TIMEOUT_MAX_S,
    zero=True,
    what=f"0 (off) or seconds from {TIMEOUT_MIN_S:g} to {TIMEOUT_MAX_S:g}",
)
# A device from 1 MFLOP/s (benchmarks/predict.py fits tiny presets' overhead-bound compute
# down to 3e-5 TFLOP/s) to 1 EFLOP/s; the engine caps one slept op at TIMEOUT_MAX_S.
TFLOPS_MIN, TFLOPS_MAX = 1e-6, 1e6
device_tflops = number(
    min=TFLOPS_MIN, max=TFLOPS_MAX, what=f"TFLOP/s from {TFLOPS_MIN:g} to {TFLOPS_MAX:g}"
)
# Optimizer settings: beyond these the step overflows float32 at the first update.
LR_MAX = 10.0
learning_rate = number(min=0, open_min=True, max=LR_MAX, what=f"a learning rate in (0, {LR_MAX:g}]")
weight_decay = number(min=0, max=1, what="a weight decay in [0, 1]")
momentum = number(min=0, max=1, open_max=True, what="a momentum in [0, 1)")


# Pseudo-filesystems: writing a result there fails (or worse, pokes the kernel).
SPECIAL_ROOTS = ("/proc", "/sys", "/dev")


def output_problem(path: str | None, option: str = "--json") -> str | None:
    """Why the output file `path` cannot be written, in one line; None when it can.

    Checked before the first iteration so a run's results are not lost at its end: the
    folder exists and is writable, the target is not a folder, not on /proc, /sys or /dev.
    """
    if path is None:
        return None
    if not path.strip():
        return f"{option}: empty path"
    full = os.path.realpath(path)
    if any(full == root or full.startswith(root + "/") for root in SPECIAL_ROOTS):
        return f"{option} {path}: not a place for results ({full.split('/')[1]} is the kernel's)"
    if os.path.isdir(full):
        return f"{option} {path}: is a directory"
    folder = os.path.dirname(full)
    if not os.path.isdir(folder):
        return f"{option} {path}: no such directory {folder}"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{option} {path}: cannot write in {folder}"
    return None


def check_output(path: str | None, option: str = "--json") -> None:
    """output_problem as a UsageError (for checks made before MPI starts)."""
    problem = output_problem(path, option)
    if problem:
        raise UsageError(problem)


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
    tflops: float = 150.0,
    tflops_help: str = "",
) -> None:
    """The shared options. `compute=None` leaves the mode for the proxy to resolve (e.g.
    per preset); `compute_help` then says how, with the default. A proxy with its own
    --device-tflops default passes it with the help that explains it."""
    # Imported here: the algorithm programs (and NumPy) load only when a parser is built.
    from proxies.core.collectives import ALLREDUCE_NAMES

    g = p.add_argument_group("common proxy options")
    g.add_argument(
        "--iters",
        type=integer(min=1, max=MAX_ITERS, what="a positive integer"),
        default=iters,
        help=f"timed iterations (default {iters}; at most {MAX_ITERS:,})",
    )
    g.add_argument(
        "--warmup",
        type=integer(min=0, max=MAX_ITERS, what="a non-negative integer"),
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
        type=device_tflops,
        action=_Given,
        default=tflops,
        metavar="TFLOPS",
        help=tflops_help
        or "achieved device rate for --compute model, in TFLOP/s, from "
        f"{TFLOPS_MIN:g} to {TFLOPS_MAX:g} (default 150: about half an A100's 312 bf16 peak)",
    )
    g.add_argument(
        "--allreduce",
        choices=ALLREDUCE_NAMES,
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
        type=integer(min=1, max=MAX_WORLD, what="a positive integer"),
        metavar="N",
        help="with --dry-run: plan for N ranks (default: the launcher's size, or 1)",
    )
    g.add_argument(
        "--chakra",
        metavar="DIR",
        help="write Chakra execution traces of one iteration into DIR: <proxy>.<rank>.et per "
        "rank and comm_group.json, for ASTRA-sim (needs the mlc-chakra package); compute "
        "times modelled in a dry run, measured in a run (mean over the timed iterations)",
    )
    g.add_argument(
        "--show-ranks",
        metavar="LIST",
        help="with --dry-run: ranks whose ops are listed, e.g. 0,5,7 or all "
        "(default: all up to 16 ranks, else the first rank of each stage)",
    )
    g.add_argument(
        "--timeout",
        type=timeout_seconds,
        default=300.0,
        metavar="SECONDS",
        help="watchdog: abort with a diagnosis when a rank makes no progress for "
        f"this long, {TIMEOUT_MIN_S:g} to {TIMEOUT_MAX_S:g} s (default 300; 0 disables)",
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
    from proxies.core import trace  # --trace, --trace-iters, --trace-ranks

    trace.add_options(g)
    from proxies.core import memory  # imports cli: here, not at the top
    from proxies.core.faults import add_faults  # (faults.py imports this module)

    memory.add_option(g)
    add_faults(p)  # --slow-rank, --jitter, --slow-link, --kill-rank
    add_machine(p)
    from proxies.core.provenance import add_version

    add_version(p)  # --version


def env_world_size() -> int | None:
    """The launcher's world size, None without a consistent launcher environment."""
    found = _launch()
    return found[1] if found else None


def quiet_interrupts() -> None:
    """Until run_main takes over: Ctrl-C ends the process at once, one line from rank 0,
    exit 130. Imports take a second or more on a loaded machine, and a KeyboardInterrupt
    inside one prints a traceback per rank (or worse, inside an extension's import)."""
    loud = env_rank() == 0

    def handler(signum, frame):
        if loud:
            os.write(2, b"proxies: interrupted while starting\n")
        os._exit(exits.INTERRUPTED)

    signal.signal(signal.SIGINT, handler)


def run_main(
    prog: str, main: Callable[[list[str] | None], int | None], argv: list[str] | None = None
) -> None:
    """Run a proxy's main: UsageError -> one line from rank 0, exit 2; Ctrl-C -> one line,
    exit 130 (core/mpi.interrupted ends a job MPI already runs)."""
    if signal.getsignal(signal.SIGINT) not in (signal.SIG_IGN, signal.SIG_DFL):
        signal.signal(signal.SIGINT, signal.default_int_handler)  # KeyboardInterrupt below
    try:
        code = main(argv)
    except UsageError as e:
        say(f"{prog}: error: {e}")
        from proxies.core import mpi

        mpi.leave(exits.USAGE, said=env_rank() == 0)  # Open MPI: rank 0 first (mpi.leave)
    except KeyboardInterrupt:
        from proxies.core import mpi

        mpi.interrupted(prog)
    if code:
        from proxies.core import mpi

        mpi.leave(code, said=env_rank() == 0)
    sys.exit(code or exits.OK)


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
    from proxies.core import configs
    from proxies.core import machine as machines

    path = configs.resolve(path, "machines")  # a shipped file by name, from any folder
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
        if not TFLOPS_MIN <= m.device_flops / 1e12 <= TFLOPS_MAX:  # as --device-tflops
            raise UsageError(
                f"{args.machine}: device rate {m.device_flops / 1e12:g} TFLOP/s is outside "
                f"{TFLOPS_MIN:g}..{TFLOPS_MAX:g}"
            )
        args.device_tflops = m.device_flops / 1e12
    return m
