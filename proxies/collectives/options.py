"""The command line of python -m proxies.collectives (bench.py runs it): sizes, the
collective, the reduction, the data type, the algorithms; `resolve` checks the
combinations (one line, exit 2) before MPI starts."""

from __future__ import annotations

import argparse
import re

from proxies.collectives.bench_ops import ALIASES, OPS, REDOPS
from proxies.core import cli, provenance

PROG = "proxies.collectives"
DTYPES = ("float32", "float64", "int32", "int64", "bfloat16", "float16")
# nccl-tests' -d names for the same types
DTYPE_ALIASES = {"float": "float32", "double": "float64", "half": "float16", "int": "int32"}
# nccl-tests types we do not run: refused with one line saying so, not "invalid choice"
UNSUPPORTED = ("int8", "char", "uint8", "uint32", "uint64", "f8e4m3", "f8e5m2", "all")
UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
MAX_SIZE = 1 << 40  # one buffer of the largest size is allocated: 1 TiB is past any node


def parse_size(text: str) -> int:
    """nccl-tests sizes: 8, 64K, 128M, 1G (binary multiples; a trailing B is allowed)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMGkmg]?)[Bb]?\s*", text)
    what = f"a size from 1 byte to {MAX_SIZE >> 30}G like 8, 64K, 128M or 1G"
    if not m:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    size = int(m.group(1)) * UNITS[m.group(2).upper()]
    if not 1 <= size <= MAX_SIZE:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text.strip()}")
    return size


def collective(text: str) -> str:
    name = ALIASES.get(text.lower(), text.lower())
    if name not in OPS:
        raise argparse.ArgumentTypeError(
            f"unknown collective {text!r} (choose from {', '.join(OPS)})"
        )
    return name


def redop(text: str) -> str:
    word = text.lower()
    if word in REDOPS:
        return word
    if word == "avg":
        raise argparse.ArgumentTypeError("avg is NCCL's; MPI has no average (sum, prod, min, max)")
    if word in OPS or word in ALIASES:  # `--op allgather`: the collective goes first
        raise argparse.ArgumentTypeError(
            f"-o/--op is the reduction as in nccl-tests ({', '.join(REDOPS)}); name the "
            f"collective first: python -m {PROG} {collective(word)} ..."
        )
    raise argparse.ArgumentTypeError(f"expected one of {', '.join(REDOPS)}, got {text!r}")


def check_count(text: str) -> int:
    try:
        return cli.integer(min=0, max=cli.MAX_ITERS, what="0, 1 or a number of checked calls")(text)
    except argparse.ArgumentTypeError as e:
        hint = f" (the collective goes first: {text} -c 1)" if text.lower() in OPS else ""
        raise argparse.ArgumentTypeError(f"{e}{hint}") from None


factor = cli.integer(min=2, what="an integer >= 2")
zero_one = cli.integer(min=0, max=1, what="0 or 1")


def parser() -> cli.Parser:
    p = cli.Parser(
        prog=f"python -m {PROG}",
        description="Collectives, ours over point-to-point vs MPI's own: time, algbw, "
        "busbw per size, as nccl-tests' *_perf binaries print them.",
    )
    p.add_argument(
        "collective",
        nargs="?",
        type=collective,
        default="allreduce",
        help=f"{', '.join(OPS)} (default allreduce; nccl-tests' names all_gather ... too)",
    )
    p.add_argument(
        "-b",
        "--minbytes",
        type=parse_size,
        default=8,
        metavar="SIZE",
        help="smallest size in bytes, K/M/G suffixes allowed (default 8)",
    )
    p.add_argument(
        "-e",
        "--maxbytes",
        type=parse_size,
        default=32 << 20,
        metavar="SIZE",
        help="largest size in bytes (default 32M)",
    )
    p.add_argument(
        "-f",
        "--stepfactor",
        type=factor,
        default=2,
        metavar="F",
        help="multiply the size by F between rows (default 2)",
    )
    p.add_argument(
        "-a",
        "--algorithms",
        metavar="LIST",
        help="comma-separated, from the collective's (allreduce: naive, tree, ring, rhd, rd, "
        "dbtree, hier; allgather: ring, rd; reduce_scatter: ring, rh; alltoall: pairwise; "
        "broadcast, reduce: binomial) and mpi (default all; with -o other than sum: mpi)",
    )
    p.add_argument(
        "-n",
        "--iters",
        type=cli.positive_int,
        default=20,
        help="timed calls per size and algorithm (default 20)",
    )
    p.add_argument(
        "-w",
        "--warmup",
        "--warmup_iters",
        type=cli.nonneg_int,
        default=5,
        help="untimed calls before them (default 5)",
    )
    p.add_argument(
        "-c",
        "--check",
        nargs="?",
        type=check_count,
        const=1,
        default=0,
        metavar="N",
        help="after timing, N more calls (--check alone: 1) on known data, compared with "
        "NumPy; the #wrong column counts the elements that differ (default 0: off)",
    )
    p.add_argument(
        "-d",
        "--dtype",
        "--datatype",
        choices=(*DTYPES, *DTYPE_ALIASES, *UNSUPPORTED),
        default="float32",
        metavar="TYPE",
        help=f"element type: {', '.join(DTYPES)} or nccl-tests' float, double, half, int "
        "(default float32)",
    )
    p.add_argument(
        "-o",
        "--op",
        type=redop,
        metavar="REDOP",
        help="reductions (allreduce, reduce_scatter, reduce): sum (default), prod, min, "
        "max; ours only sum, so another runs MPI's",
    )
    p.add_argument(
        "-r",
        "--root",
        type=cli.nonneg_int,
        help="broadcast, reduce: the root rank (default 0)",
    )
    p.add_argument(
        "-I",
        "--per_iter_timing",
        type=zero_one,
        default=0,
        metavar="0|1",
        help="1: time every call alone and add i_min, i_max, i_p99, i_cv%% (and the times to "
        "the JSON)",
    )
    p.add_argument(
        "-K",
        "--per_iter_skip",
        type=cli.nonneg_int,
        default=0,
        metavar="K",
        help="with -I 1: leave the first K timed calls out of the i_* statistics",
    )
    p.add_argument(
        "--ranks-per-node",
        type=cli.positive_int,
        metavar="R",
        help="hier: nodes of R consecutive ranks (default: MPI's shared-memory "
        "split, one node per machine)",
    )
    p.add_argument(
        "--wait",
        choices=("auto", "spin", "yield"),
        default="auto",
        help="spin: MPI's blocking waits; yield: test and sleep 20 us..1 ms "
        "(the engine's Waiter); auto: yield when a node has more ranks than "
        "cores (default)",
    )
    p.add_argument(
        "-J",
        "--json",
        "--output_file",
        metavar="PATH",
        help="write the rows as a JSON list (rank 0)",
    )
    g = p.add_argument_group("prediction (is my number normal?)")
    g.add_argument(
        "--machine",
        metavar="FILE",
        help="a machine model (configs/machines/*.yaml or calibrate's): adds the predicted "
        "time and busbw of every row; --ranks-per-node places the ranks on its nodes",
    )
    g.add_argument(
        "--machine-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --machine: change one figure, e.g. 'inter_node.bandwidth=25 Gb/s'",
    )
    g.add_argument(
        "--predict",
        choices=cli.PREDICT_DETAILS,
        default="auto",
        help="with --machine: price every message (steps), aggregated phases (coarse), or "
        "steps while small (auto)",
    )
    g.add_argument(
        "--dry-run",
        action="store_true",
        help="with --machine: predict only, without MPI, for --world-size ranks",
    )
    g.add_argument(
        "--world-size", type=cli.positive_int, metavar="N", help="with --dry-run: ranks to predict"
    )
    provenance.add_version(p)  # --version
    return p


def sizes(lo: int, hi: int, f: int) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= f
    return out


def resolve(args) -> list[str]:
    """Check the combinations (one line, exit 2) and fill the defaults; the algorithms."""
    op = OPS[args.collective]
    if args.dtype in UNSUPPORTED:
        raise cli.UsageError(
            f"-d/--datatype {args.dtype}: not supported here (choose from {', '.join(DTYPES)} "
            f"or nccl-tests' {', '.join(DTYPE_ALIASES)})"
        )
    args.dtype = DTYPE_ALIASES.get(args.dtype, args.dtype)
    if args.op is not None and not op.reduces:
        raise cli.UsageError(
            f"-o/--op goes with allreduce, reduce_scatter and reduce, not {op.name}"
        )
    if args.root is not None and not op.rooted:
        raise cli.UsageError(f"-r/--root goes with broadcast and reduce, not {op.name}")
    args.op = args.op or "sum"
    args.root = args.root or 0
    if args.per_iter_skip and not args.per_iter_timing:
        raise cli.UsageError("-K/--per_iter_skip goes with -I 1")
    if args.per_iter_skip >= args.iters:
        raise cli.UsageError(
            f"-K/--per_iter_skip {args.per_iter_skip} leaves none of the -n {args.iters} calls"
        )
    if args.maxbytes < args.minbytes:
        raise cli.UsageError(
            f"-e/--maxbytes {args.maxbytes} is smaller than -b/--minbytes {args.minbytes}"
        )
    if args.algorithms is None:  # all that can run it: ours only sum
        return list(op.algorithms if args.op == "sum" else ("mpi",))
    algs = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    unknown = [a for a in algs if a not in op.algorithms]
    if unknown or not algs:
        what = f"unknown algorithm {unknown[0]!r}" if unknown else "no algorithm given"
        raise cli.UsageError(
            f"-a/--algorithms: {what} for {op.name} (choose from {', '.join(op.algorithms)})"
        )
    ours = [a for a in algs if a != "mpi"]
    if args.op != "sum" and ours:
        raise cli.UsageError(
            f"-o/--op {args.op}: our algorithms only sum ({ours[0]}); use -a mpi for {args.op}"
        )
    return list(dict.fromkeys(algs))
