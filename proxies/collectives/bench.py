"""python -m proxies.collectives: collectives side by side, as nccl-tests prints them.

    mpiexec -n 4 python -m proxies.collectives -b 1M -e 64M -f 2 -a ring,mpi
    mpiexec -n 4 python -m proxies.collectives allgather -b 8 -e 1M -f 8 -c 1 -d half

The collective comes first (allreduce by default; allgather, reduce_scatter, alltoall,
broadcast, reduce, sendrecv; nccl-tests' binary names all_gather ... too), each with our
algorithms and MPI's (`mpi`). For each size from -b to -e (times -f each step) and each
algorithm, mpi4py's osu pattern: one buffer allocated for the largest size, -w warm-up
calls, a barrier, -n timed calls between two MPI.Wtime()s, the mean per call, max over
ranks. Algorithms alternate within a size, so load that drifts over the run touches them
alike. Columns (nccl-tests' names and meanings, bench_ops.py for sizes per op):

    size    bytes per rank, nccl-tests' convention per op; count: the count column
    redop   the reduction (-o), "none" for data movement; root: -r, -1 when rootless
    time    microseconds per call, the slowest rank's mean
    algbw   size / time, GB/s (1e9 B/s)
    busbw   algbw x the op's factor (2(n-1)/n allreduce, (n-1)/n allgather, reduce_scatter,
            alltoall, 1 broadcast, reduce, sendrecv): what each rank's link carried
    vs mpi  busbw / MPI's busbw at the same size
    #wrong  with -c: elements that differ from NumPy's result, over all ranks (N/A without)
    i_*     with -I 1: per-iteration times (each the slowest rank's), min, max, p99 (nearest
            rank) and coefficient of variation, as nccl-tests' -I prints them

With --wait yield (auto's choice when ranks outnumber cores) every algorithm completes its
requests by test-and-sleep, as the engine does, and `mpi` is the non-blocking call + that
wait; with --wait spin the algorithms use MPI's blocking Waitall and `mpi` the blocking call.

Timed buffers hold zeros (repeated in-place sums of anything else overflow; an add costs
the same whatever the finite values). The check is separate calls on small integers whose
results are exact in every order, so the expected values are exact too.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys

import numpy as np

from proxies.collectives import bench_ops
from proxies.collectives.bench_ops import ALIASES, OPS, REDOPS
from proxies.core import cli, exits, provenance, wire

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


def resolve_wait(MPI, comm, mode: str) -> str:
    """auto: yield when some node has more ranks than cores (as the proxies decide)."""
    if mode != "auto":
        return mode
    from proxies.core import threads

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    crowded = node.allreduce(node.size > threads.cores_available(), op=MPI.LOR)
    node.Free()
    return "yield" if crowded else "spin"


def time_one(comm, MPI, waiter, call, buf, recv, args) -> tuple[float, list[float] | None]:
    """Seconds per call (warm-up, barrier, timed loop; the slowest rank's mean) and with
    -I 1 each call's seconds, the slowest rank's per call (nccl-tests' max over ranks)."""
    for _ in range(args.warmup):
        call(buf, recv)
    waiter.barrier(comm)
    each = np.empty(args.iters) if args.per_iter_timing else None
    t0 = MPI.Wtime()
    if each is None:
        for _ in range(args.iters):
            call(buf, recv)
    else:
        for i in range(args.iters):
            t = MPI.Wtime()
            call(buf, recv)
            each[i] = MPI.Wtime() - t
    mine = np.array([(MPI.Wtime() - t0) / args.iters])
    slowest = np.empty(1)
    comm.Allreduce(mine, slowest, op=MPI.MAX)
    if each is None:
        return float(slowest[0]), None
    comm.Allreduce(MPI.IN_PLACE, each, op=MPI.MAX)
    return float(slowest[0]), each.tolist()


def make_row(args, alg: str, elements: int, count: int, dtype, n: int, seconds: float, bad):
    """One row (the JSON's and the table's); busbw = algbw x the op's nccl-tests factor."""
    size = elements * dtype.itemsize
    algbw = size / seconds / 1e9 if seconds > 0 else 0.0
    op = OPS[args.collective]
    return {
        "collective": op.name,
        "algorithm": alg,
        "bytes": size,
        "count": count,
        "dtype": dtype.name,
        "redop": args.op if op.reduces else "none",
        "root": args.root if op.rooted else -1,
        "ranks": n,
        "time_us": seconds * 1e6,
        "algbw": algbw,
        "busbw": algbw * op.factor(n),
        "wrong": bad,
    }


def table(rows: list[dict], *, head: bool = False, mpi_busbw=None, measured=True) -> str:
    """The table's header (head=True: two lines) or its rows; every printed table line
    goes through here. Columns after busbw: measured runs add vs mpi, #wrong, the i_*
    with -I, pred and meas/pred with --machine; dry runs their (predicted) busbw only."""
    if head:
        per_iter = any("per_iter" in r for r in rows)
        pred = any("predicted_busbw" in r for r in rows)
        a = f"# {'size':>10} {'count':>11} {'type':>8} {'redop':>5} {'root':>4} {'algorithm':>9}"
        a += f" {'time':>10} {'algbw':>7} {'busbw':>7}"
        b = f"# {'(B)':>10} {'(elements)':>11} {'':>8} {'':>5} {'':>4} {'':>9}"
        b += f" {'(us)':>10} {'(GB/s)':>7} {'(GB/s)':>7}"
        if measured:
            a += f" {'vs mpi':>6} {'#wrong':>7}"
            b += f" {'':>6} {'':>7}"
        if per_iter:
            a += f" {'i_min':>8} {'i_max':>8} {'i_p99':>8} {'i_cv%':>6}"
            b += f" {'(us)':>8} {'(us)':>8} {'(us)':>8} {'':>6}"
        if pred:
            a += f" {'pred':>7} {'meas/':>6}"
            b += f" {'(GB/s)':>7} {'pred':>6}"
        return f"{a}\n{b}" + ("   (predicted)" if not measured else "")
    out = []
    for row in rows:
        s = (
            f"  {row['bytes']:>10} {row['count']:>11} {row['dtype']:>8} {row['redop']:>5} "
            f"{row['root']:>4} {row['algorithm']:>9} {row['time_us']:>10.1f} "
            f"{row['algbw']:>7.2f} {row['busbw']:>7.2f}"
        )
        if measured:
            vs = f"{row['busbw'] / mpi_busbw:6.2f}" if mpi_busbw else f"{'':>6}"
            bad = f"{row['wrong']:>7}" if row["wrong"] is not None else f"{'N/A':>7}"
            s += f" {vs} {bad}"
        if "per_iter" in row:
            it = row["per_iter"]
            s += (
                f" {it['min_us']:>8.1f} {it['max_us']:>8.1f} {it['p99_us']:>8.1f} "
                f"{it['cv_pct']:>6.1f}"
            )
        if measured and "predicted_busbw" in row:
            pb = row["predicted_busbw"]
            s += f" {pb:>7.2f} {row['busbw'] / pb if pb else 0.0:>6.2f}"
        out.append(s)
    return "\n".join(out)


def write_rows(path: str | None, rows: list[dict]) -> int:
    """-J/--json: the rows as a JSON list; exit status (FAILED when nothing was written)."""
    from proxies.core import report

    if path and report.write_json(path, rows, prog=PROG) is None:
        return exits.FAILED
    return exits.OK


def load_machine(args):
    """The machine of --machine (None without it); bad files and lone options: exit 2."""
    if not args.machine:
        for given, what in ((args.machine_set, "--machine-set"), (args.dry_run, "--dry-run")):
            if given:
                raise cli.UsageError(f"{what} goes with --machine FILE")
        if args.world_size:
            raise cli.UsageError("--world-size goes with --dry-run --machine FILE")
        return None
    return cli.load_machine(args.machine, args.machine_set, args.ranks_per_node)


def predicted(machine, args, alg: str, count: int, dtype, n: int) -> float:
    return bench_ops.predicted_seconds(
        machine,
        args.collective,
        alg,
        n,
        count,
        dtype.name,
        args.root,
        args.ranks_per_node,
        args.predict,
    )


def describe_op(args, n: int) -> str:
    return bench_ops.describe(args.collective, args.op, args.root, n)


def check_root(args, n: int) -> None:
    if args.root >= n:
        raise cli.UsageError(f"-r/--root {args.root}: the ranks are 0..{n - 1}")


def dry_run(args, algs: list[str], machine) -> int:
    """Rows predicted for --world-size ranks, without MPI."""
    n = args.world_size or cli.env_world_size() or 1
    check_root(args, n)
    dtype = wire.numpy_dtype(args.dtype)
    rpn = args.ranks_per_node or machine.ranks_per_node
    if n > rpn and machine.inter is None:
        raise cli.UsageError(
            f"{args.machine}: {n} ranks at {rpn} per node need more than one node, but the "
            f"machine has no inter_node level; give --ranks-per-node {n}"
        )
    per = f"{rpn} rank{'s' * (rpn > 1)} per node"
    print(f"# {PROG}: {describe_op(args, n)} · predicted on {machine.name} ({per})")
    print(table([], head=True, measured=False), flush=True)
    rows = []
    for size in sizes(args.minbytes, args.maxbytes, args.stepfactor):
        elements, count = bench_ops.counts(OPS[args.collective], size, dtype.itemsize, n)
        for alg in algs:
            t = predicted(machine, args, alg, elements, dtype, n)
            row = make_row(args, alg, elements, count, dtype, n, t, None)
            row["predicted"] = True
            print(table([row], measured=False), flush=True)
            rows.append(row)
    origin = provenance.fields()
    rows = [{**row, **origin} for row in rows]  # each row says what made it
    return write_rows(args.json, rows)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    algs = resolve(args)
    machine = load_machine(args)
    if args.dry_run:
        cli.check_output(args.json)
        return dry_run(args, algs, machine)
    if args.world_size:
        raise cli.UsageError("--world-size only goes with --dry-run (a run has mpiexec's size)")
    from proxies.core import mpi
    from proxies.core.waiting import Waiter

    MPI = mpi.init()
    comm = MPI.COMM_WORLD
    mpi.abort_on_exception(comm, PROG)
    n, r = comm.size, comm.rank
    check_root(args, n)  # every rank decides alike: rank 0 says it, all exit 2
    op = OPS[args.collective]
    wait = resolve_wait(MPI, comm, args.wait)
    waiter = Waiter(MPI, wait)
    waitfn = waiter.waitall if wait == "yield" else None
    dtype = wire.numpy_dtype(args.dtype)
    steps = sizes(args.minbytes, args.maxbytes, args.stepfactor)
    calls = {
        a: bench_ops.caller(MPI, op.name, a, comm, args.root, args.op, waitfn, args.ranks_per_node)
        for a in algs
    }

    # -- one buffer for every size (osu: allocate once), touched so no timing page-faults;
    # sendrecv receives into a second one
    try:
        top = bench_ops.counts(op, steps[-1], dtype.itemsize, n)[0]
        whole, error = np.zeros(top, dtype=dtype), None
        other = np.zeros(top, dtype=dtype) if op.name == "sendrecv" else None
    except MemoryError:
        whole, error = None, f"-e/--maxbytes {args.maxbytes}: cannot allocate that buffer"
    if error is None and r == 0:  # rank 0 writes the rows: refuse now, not after timing
        error = cli.output_problem(args.json)
    mpi.agree(comm, error, PROG)

    if r == 0:
        from proxies.core.mpi import describe

        m = describe(MPI)
        nodes = f"--ranks-per-node {args.ranks_per_node}" if args.ranks_per_node else "MPI's split"
        head = [
            f"# {PROG}: {describe_op(args, n)}",
            f"# {m['library']} · mpi4py {m['mpi4py']} · thread level {m['thread_level']} · "
            f"waits {wait} · hier nodes: {nodes}",
            f"# {args.warmup} warm-up + {args.iters} timed calls per row, time = mean per "
            f"call, max over ranks"
            + (f" · --check {args.check}" if args.check else "")
            + (" · -I 1: i_* per call, max over ranks" if args.per_iter_timing else ""),
        ]
        if machine is not None:
            rpn = args.ranks_per_node or machine.ranks_per_node
            head.append(
                f"# predicted on {machine.name} ({rpn} ranks per node): pred = the "
                f"model's busbw, meas/pred = measured over predicted"
            )
        shape = {"per_iter": 1} if args.per_iter_timing else {}
        shape.update({"predicted_busbw": 1} if machine is not None else {})
        print("\n".join([*head, "#", table([shape], head=True)]), flush=True)
    rows: list[dict] = []
    for size in steps:
        elements, count = bench_ops.counts(op, size, dtype.itemsize, n)
        buf = whole[:elements]
        recv = other[:elements] if other is not None else None
        group = []
        for alg in algs:
            # -- timed calls on zeros
            buf[...] = 0
            seconds, each = time_one(comm, MPI, waiter, calls[alg], buf, recv, args)
            # -- checked calls on small integers
            bad = None
            if args.check:
                mine = 0
                for _ in range(args.check):
                    buf[...] = bench_ops.check_inputs(op.name, args.op, elements, r, dtype)
                    if recv is not None:
                        recv[...] = buf
                    calls[alg](buf, recv)
                    mine += bench_ops.check_wrong(op.name, args.op, args.root, buf, recv, n, r)
                bad = comm.allreduce(mine, op=MPI.SUM)
            row = make_row(args, alg, elements, count, dtype, n, seconds, bad)
            if each is not None:
                row["per_iter"] = bench_ops.iter_stats(each, args.per_iter_skip)
            if machine is not None and r == 0:
                t = predicted(machine, args, alg, elements, dtype, n)
                row["predicted_time_us"] = t * 1e6
                row["predicted_busbw"] = row["bytes"] / t / 1e9 * op.factor(n) if t > 0 else 0.0
            group.append(row)
        if r == 0:
            mpi_busbw = next((g["busbw"] for g in group if g["algorithm"] == "mpi"), None)
            print(table(group, mpi_busbw=mpi_busbw), flush=True)
        rows += group

    # Collective: rank 0 gathers the node names. The MPI library as a proxy's result has it.
    origin = provenance.fields(MPI, comm) | {"mpi": mpi.describe(MPI)}
    rows = [{**row, **origin} for row in rows]  # each row says what made it
    if r == 0:
        avg = " · ".join(
            f"{a} {statistics.fmean(g['busbw'] for g in rows if g['algorithm'] == a):.2f}"
            for a in algs
        )
        print(f"# average busbw (GB/s): {avg}")
        if args.check:
            print(f"# #wrong in all: {sum(g['wrong'] for g in rows)}", flush=True)
        written = write_rows(args.json, rows)
        if written != exits.OK:
            return written
    # every rank knows the totals (summed over ranks): wrong results are exit status 4
    if args.check and any(g["wrong"] for g in rows):
        if r == 0:
            print(f"{PROG}: --check found wrong results (#wrong above)", file=sys.stderr)
        return exits.CHECK
    return exits.OK


def entry() -> None:
    cli.run_main(PROG, main)
