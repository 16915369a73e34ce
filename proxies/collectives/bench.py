"""python -m proxies.collectives: the allreduce algorithms side by side, nccl-tests style.

    mpiexec -n 4 python -m proxies.collectives -b 1M -e 64M -f 2 -a ring,mpi

For each size from -b to -e (times -f each step) and each algorithm, mpi4py's osu pattern:
one buffer allocated for the largest size, -w warm-up calls, a barrier, -n timed calls
between two MPI.Wtime()s, the mean per call, max over ranks. Algorithms alternate within a
size, so load that drifts over the run touches them alike. Columns (nccl-tests):

    size    bytes per rank (rounded down to whole elements), count elements of `type`
    time    microseconds per allreduce, the slowest rank's mean
    algbw   size / time, GB/s (1e9 B/s)
    busbw   algbw * 2(n-1)/n with n the group size: what each rank's link carried, so
            algorithms and world sizes compare against the hardware's bandwidth
    vs mpi  busbw / MPI Allreduce's busbw at the same size
    #wrong  with -c: elements that differ from NumPy's sum, over all ranks (N/A without)

With --wait yield (auto's choice when ranks outnumber cores) every algorithm completes its
requests by test-and-sleep, as the engine does, and `mpi` is Iallreduce + that wait; with
--wait spin the algorithms use MPI's blocking Waitall and `mpi` is the blocking Allreduce.

Timed buffers hold zeros (repeated in-place sums of anything else overflow; an add costs
the same whatever the finite values). The check is a separate call on small integers,
whose sums are exact in every order, so the expected values are exact too.
"""

from __future__ import annotations

import argparse
import re
import statistics

import numpy as np

from proxies.collectives import ALGORITHMS, allreduce
from proxies.core import cli, exits, provenance, wire

PROG = "proxies.collectives"
DTYPES = ("float32", "float64", "int32", "int64", "bfloat16", "float16")
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


factor = cli.integer(min=2, what="an integer >= 2")


def parser() -> cli.Parser:
    p = cli.Parser(
        prog=f"python -m {PROG}",
        description="Allreduce algorithms over point-to-point vs MPI's own: time, algbw, "
        "busbw per size, as nccl-tests' all_reduce_perf prints them.",
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
        default=",".join(ALGORITHMS),
        metavar="LIST",
        help=f"comma-separated, from {', '.join(ALGORITHMS)} (default all)",
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
        type=cli.nonneg_int,
        default=5,
        help="untimed calls before them (default 5)",
    )
    p.add_argument(
        "-c",
        "--check",
        action="store_true",
        help="after timing, one more call on known data, compared with NumPy; "
        "the #wrong column counts the elements that differ",
    )
    p.add_argument(
        "-d", "--dtype", choices=DTYPES, default="float32", help="element type (default float32)"
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
    p.add_argument("--json", metavar="PATH", help="write the rows as a JSON list (rank 0)")
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


def check_inputs(count: int, rank: int, dtype) -> np.ndarray:
    """Small integers: |v| <= 15, whose sums over up to 2^20 ranks are exact in float32;
    for 16-bit floats |v| <= 1, exact up to 256 ranks in bfloat16 and 2048 in float16."""
    span = 3 if wire.is_sixteen(dtype) else 31
    ints = (np.arange(count, dtype=np.int64) * 7 + rank * 13) % span - span // 2
    return ints.astype(dtype)


def wrong(buf: np.ndarray, n: int) -> int:
    want = np.zeros(buf.size, dtype=np.int64)
    for i in range(n):
        want += check_inputs(buf.size, i, buf.dtype).astype(np.int64)
    return int(np.count_nonzero(buf != want.astype(buf.dtype)))


def resolve(args) -> list[str]:
    algs = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    unknown = [a for a in algs if a not in ALGORITHMS]
    if unknown or not algs:
        what = f"unknown algorithm {unknown[0]!r}" if unknown else "no algorithm given"
        raise cli.UsageError(f"-a/--algorithms: {what} (choose from {', '.join(ALGORITHMS)})")
    if args.maxbytes < args.minbytes:
        raise cli.UsageError(
            f"-e/--maxbytes {args.maxbytes} is smaller than -b/--minbytes {args.minbytes}"
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


def time_one(comm, MPI, waiter, alg, buf, args, wait) -> float:
    """Seconds per call: warm-up, barrier, timed loop; the slowest rank's mean."""

    def call():
        allreduce(comm, buf, alg, wait=wait, ranks_per_node=args.ranks_per_node)

    for _ in range(args.warmup):
        call()
    waiter.barrier(comm)
    t0 = MPI.Wtime()
    for _ in range(args.iters):
        call()
    mine = np.array([(MPI.Wtime() - t0) / args.iters])
    slowest = np.empty(1)
    comm.Allreduce(mine, slowest, op=MPI.MAX)
    return float(slowest[0])


def header(comm, MPI, args, wait: str) -> list[str]:
    from proxies.core.mpi import describe

    n, m = comm.size, describe(MPI)
    nodes = f"--ranks-per-node {args.ranks_per_node}" if args.ranks_per_node else "MPI's split"
    return [
        f"# {PROG}: allreduce (sum, in place) on {n} ranks · busbw = algbw x 2(n-1)/n = "
        f"algbw x {2 * (n - 1) / n:.3f}",
        f"# {m['library']} · mpi4py {m['mpi4py']} · thread level {m['thread_level']} · "
        f"waits {wait} · hier nodes: {nodes}",
        f"# {args.warmup} warm-up + {args.iters} timed calls per row, time = mean per call, "
        f"max over ranks" + (" · --check on" if args.check else ""),
        "#",
        f"# {'size':>10} {'count':>11} {'type':>8} {'algorithm':>9} {'time':>10} "
        f"{'algbw':>7} {'busbw':>7} {'vs mpi':>6} {'#wrong':>7}",
        f"# {'(B)':>10} {'(elements)':>11} {'':>8} {'':>9} {'(us)':>10} "
        f"{'(GB/s)':>7} {'(GB/s)':>7} {'':>6} {'':>7}",
    ]


def make_row(alg: str, count: int, dtype: np.dtype, n: int, seconds: float, bad: int | None):
    """One JSON row; busbw uses the group size n (nccl-tests' allreduce factor)."""
    size = count * dtype.itemsize
    algbw = size / seconds / 1e9 if seconds > 0 else 0.0
    return {
        "algorithm": alg,
        "bytes": size,
        "count": count,
        "dtype": dtype.name,
        "ranks": n,
        "time_us": seconds * 1e6,
        "algbw": algbw,
        "busbw": algbw * 2 * (n - 1) / n,
        "wrong": bad,
    }


def line(row: dict, mpi_busbw: float | None) -> str:
    vs = f"{row['busbw'] / mpi_busbw:6.2f}" if mpi_busbw else f"{'':>6}"
    bad = f"{row['wrong']:>7}" if row["wrong"] is not None else f"{'N/A':>7}"
    return (
        f"  {row['bytes']:>10} {row['count']:>11} {row['dtype']:>8} {row['algorithm']:>9} "
        f"{row['time_us']:>10.1f} {row['algbw']:>7.2f} {row['busbw']:>7.2f} {vs} {bad}"
    )


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
    from proxies.core.prediction import collective_seconds

    return collective_seconds(
        machine,
        "allreduce",
        alg,
        n,
        count,
        dtype.name,
        args.ranks_per_node,
        detail=args.predict,
    )


def dry_run(args, algs: list[str], machine) -> int:
    """Rows predicted for --world-size ranks, without MPI."""
    from proxies.core import report

    n = args.world_size or cli.env_world_size() or 1
    dtype = wire.numpy_dtype(args.dtype)
    rpn = args.ranks_per_node or machine.ranks_per_node
    if n > rpn and machine.inter is None:
        raise cli.UsageError(
            f"{args.machine}: {n} ranks at {rpn} per node need more than one node, but the "
            f"machine has no inter_node level; give --ranks-per-node {n}"
        )
    per = f"{rpn} rank{'s' * (rpn > 1)} per node"
    print(
        f"# {PROG}: allreduce on {n} ranks predicted on {machine.name} ({per}) "
        f"· busbw = algbw x 2(n-1)/n = algbw x {2 * (n - 1) / n:.3f}\n"
        f"# {'size':>10} {'count':>11} {'type':>8} {'algorithm':>9} {'time':>10} "
        f"{'algbw':>7} {'busbw':>7}\n"
        f"# {'(B)':>10} {'(elements)':>11} {'':>8} {'':>9} {'(us)':>10} {'(GB/s)':>7} "
        f"{'(GB/s)':>7}   (predicted)",
        flush=True,
    )
    rows = []
    for size in sizes(args.minbytes, args.maxbytes, args.stepfactor):
        count = size // dtype.itemsize
        for alg in algs:
            row = make_row(
                alg, count, dtype, n, predicted(machine, args, alg, count, dtype, n), None
            )
            row["predicted"] = True
            print(line(row, None)[:-8], flush=True)
            rows.append(row)
    origin = provenance.fields()
    rows = [{**row, **origin} for row in rows]  # each row says what made it
    if args.json and report.write_json(args.json, rows, prog=PROG) is None:
        return exits.FAILED
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    algs = resolve(args)
    machine = load_machine(args)
    if args.dry_run:
        cli.check_output(args.json)
        return dry_run(args, algs, machine)
    if args.world_size:
        raise cli.UsageError("--world-size only goes with --dry-run (a run has mpiexec's size)")
    from proxies.core import mpi, report
    from proxies.core.waiting import Waiter

    MPI = mpi.init()
    comm = MPI.COMM_WORLD
    mpi.abort_on_exception(comm, PROG)
    n, r = comm.size, comm.rank
    wait = resolve_wait(MPI, comm, args.wait)
    waiter = Waiter(MPI, wait)
    waitfn = waiter.waitall if wait == "yield" else None
    dtype = wire.numpy_dtype(args.dtype)
    steps = sizes(args.minbytes, args.maxbytes, args.stepfactor)

    # -- one buffer for every size (osu: allocate once), touched so no timing page-faults
    try:
        whole, error = np.zeros(steps[-1] // dtype.itemsize, dtype=dtype), None
        whole[...] = 0
    except MemoryError:
        whole, error = None, f"-e/--maxbytes {args.maxbytes}: cannot allocate that buffer"
    if error is None and r == 0:  # rank 0 writes the rows: refuse now, not after timing
        error = cli.output_problem(args.json)
    mpi.agree(comm, error, PROG)

    if r == 0:
        head = header(comm, MPI, args, wait)
        if machine is not None:
            rpn = args.ranks_per_node or machine.ranks_per_node
            head.insert(
                3,
                f"# predicted on {machine.name} ({rpn} ranks per node): pred = the "
                f"model's busbw, meas/pred = measured over predicted",
            )
            head[-2] += f" {'pred':>7} {'meas/':>6}"
            head[-1] += f" {'(GB/s)':>7} {'pred':>6}"
        print("\n".join(head), flush=True)
    rows: list[dict] = []
    for size in steps:
        count = size // dtype.itemsize
        buf = whole[:count]
        group = []
        for alg in algs:
            # -- timed calls on zeros
            buf[...] = 0
            seconds = time_one(comm, MPI, waiter, alg, buf, args, waitfn)
            # -- one checked call on small integers
            bad = None
            if args.check:
                buf[...] = check_inputs(count, r, dtype)
                allreduce(comm, buf, alg, wait=waitfn, ranks_per_node=args.ranks_per_node)
                mine, total = np.array([wrong(buf, n)], dtype=np.int64), np.zeros(1, np.int64)
                comm.Allreduce(mine, total, op=MPI.SUM)
                bad = int(total[0])
            group.append(make_row(alg, count, dtype, n, seconds, bad))
            if machine is not None and r == 0:
                row, t = group[-1], predicted(machine, args, alg, count, dtype, n)
                row["predicted_time_us"] = t * 1e6
                row["predicted_busbw"] = size / t / 1e9 * 2 * (n - 1) / n if t > 0 else 0.0
        if r == 0:
            mpi_busbw = next((g["busbw"] for g in group if g["algorithm"] == "mpi"), None)
            for g in group:
                extra = ""
                if machine is not None:
                    extra = (
                        f" {g['predicted_busbw']:>7.2f} {g['busbw'] / g['predicted_busbw']:>6.2f}"
                    )
                print(line(g, mpi_busbw) + extra, flush=True)
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
            print(f"# #wrong in all: {sum(g['wrong'] for g in rows)}")
        if args.json and report.write_json(args.json, rows, prog=PROG) is None:
            return exits.FAILED
    return 0


def entry() -> None:
    cli.run_main(PROG, main)
