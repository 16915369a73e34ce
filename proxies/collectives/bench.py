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

import statistics
import sys

import numpy as np

from proxies.collectives import bench_ops
from proxies.collectives.bench_ops import OPS
from proxies.collectives.options import PROG, parser, resolve, sizes
from proxies.core import cli, exits, pages, provenance, wire
from proxies.core.prediction import machine_rpn


def resolve_wait(MPI, comm, mode: str) -> tuple[str, int]:
    """The waits (auto: yield when some node has more ranks than cores, as the proxies
    decide) and the ranks on the run's largest node."""
    from proxies.core import threads

    crowded, largest = threads.placement(MPI, comm)
    return (("yield" if crowded else "spin") if mode == "auto" else mode), largest


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
        machine_rpn(args, machine, n),
        args.predict,
        getattr(args, "wait", None) or "auto",
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
    rpn = machine_rpn(args, machine, n)
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
    wait, args.placed_per_node = resolve_wait(MPI, comm, args.wait)
    waiter = Waiter(MPI, wait)
    waitfn = waiter.waitall if wait == "yield" else None
    dtype = wire.numpy_dtype(args.dtype)
    steps = sizes(args.minbytes, args.maxbytes, args.stepfactor)
    calls = {
        a: bench_ops.caller(MPI, op.name, a, comm, args.root, args.op, waitfn, args.ranks_per_node)
        for a in algs
    }

    # -- one buffer for every size (osu: allocate once), touched so no timing page-faults;
    # sendrecv and MPI's all-to-all receive into a second one
    try:
        top = bench_ops.counts(op, steps[-1], dtype.itemsize, n)[0]
        whole, error = pages.zeros(top, dtype), None
        two = op.name == "sendrecv" or (op.name == "alltoall" and "mpi" in algs)
        other = pages.zeros(top, dtype) if two else None
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
            rpn = machine_rpn(args, machine, n)
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
                    got = recv if op.name == "alltoall" and alg == "mpi" else buf
                    mine += bench_ops.check_wrong(op.name, args.op, args.root, got, recv, n, r)
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
