"""python -m proxies calibrate: measure the allocation it runs on, write a machine file.

Nodes come from MPI (COMM_TYPE_SHARED) unless --ranks-per-node emulates them; then:
point-to-point ping-pong within a node (and across nodes, with 2 or more), fitted to
latency + bytes / bandwidth; concurrent flows into one node (its NIC); np.matmul, copy
and add rates with a rank on every core of a node at once; each allreduce algorithm of
proxies.collectives and MPI's all-to-all at a few sizes; the machine's state
(state.py, what calibrate.probe measures again later). Messages and collectives use cold
buffers, as the proxies' are (measure.Arena). Rank 0 writes the file
(proxies.core.machine_file.dump), with what was measured how in comments and the raw
points and fit residuals under `calibration:`. What one node cannot show (inter_node) is
listed under `unmeasured`.

Two regimes where a node has more ranks than cores: the figures the file has for every run
(intra_node, node_bandwidth, compute, the allreduce fit, MPI's fresh temporaries, the
engine's cost per op) are measured with only as many ranks per node active as cores, the
in a sleeping wait; then the `oversubscribed` figures with every rank active and the runs'
yielding waits. The predictor applies the second only to runs that crowd a node so.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import Counter
from dataclasses import dataclass

from proxies.calibrate import caches, exchange, measure, state, unexpected
from proxies.calibrate.describe import comments, summary
from proxies.calibrate.measure import sig
from proxies.core import cli, report
from proxies.core.machine import Level, Machine
from proxies.core.machine_file import dumps

PROG = "proxies.calibrate"


def parser() -> cli.Parser:
    p = cli.Parser(
        prog="python -m proxies calibrate",
        description="Measure this allocation (point-to-point latency and bandwidth within "
        "and across nodes, the NIC, NumPy compute rates, allreduce algorithms) and write "
        "a machine file for --machine.",
    )
    p.add_argument(
        "-o", "--output", required=True, metavar="FILE", help="the machine file to write"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="fewer sizes and repetitions: seconds instead of a minute, rougher figures",
    )
    p.add_argument(
        "--ranks-per-node",
        type=cli.positive_int,
        metavar="R",
        help="emulate nodes of R consecutive ranks (default: MPI's shared-memory split); "
        "on one machine the 'inter-node' figures then measure shared memory",
    )
    p.add_argument("--name", help="the machine's name (default: the output file's name)")
    from proxies.core.provenance import add_version

    add_version(p)  # --version
    return p


def output_problem(path: str) -> str | None:
    """Why `path` cannot be written, or None: checked before anything is measured."""
    return cli.output_problem(path, "-o")


@dataclass
class Topology:
    node_of: list[int]  # world rank -> node index
    ranks_per_node: int
    cores_per_node: int
    real_nodes: int  # machines (shared-memory domains)
    real_ranks: int  # ranks on the most crowded machine
    real_cores: int  # cores of the smallest machine
    crowded: bool  # some machine has more ranks than cores
    notes: list[str]


def topology(comm, MPI, emulate: int | None) -> Topology:
    from proxies.core.threads import cores_available

    shared = comm.Split_type(MPI.COMM_TYPE_SHARED)
    leader = shared.allreduce(comm.rank, op=MPI.MIN)
    try:
        mine = set(os.sched_getaffinity(0))
    except AttributeError:  # macOS: no affinity, all cores
        mine = set(range(cores_available()))
    cores = len(set().union(*shared.allgather(mine)))  # what this machine's ranks may use
    machines = dict(comm.allgather((leader, (shared.size, cores))))
    leaders = comm.allgather(leader)
    shared.Free()
    real_ranks = max(n for n, _ in machines.values())
    real_cores = min(c for _, c in machines.values())
    crowded = any(n > c for n, c in machines.values())
    notes = []
    if emulate:
        node_of = [q // emulate for q in range(comm.size)]
        # an emulated node gets its share of its machine's cores
        cores_per_node = max(1, real_cores * emulate // real_ranks)
        notes.append(f"nodes emulated: --ranks-per-node {emulate} on {len(machines)} machine(s)")
    else:
        ids: dict[int, int] = {}
        node_of = [ids.setdefault(q, len(ids)) for q in leaders]
        cores_per_node = real_cores
    sizes = Counter(node_of)
    if len(set(sizes.values())) > 1:
        notes.append(f"nodes hold different rank counts {sorted(sizes.values())}: took the most")
    if any(b < a for a, b in zip(node_of, node_of[1:], strict=False)):
        notes.append("MPI placed ranks round robin, not in blocks of consecutive ranks")
    return Topology(
        node_of, max(sizes.values()), cores_per_node, len(machines), real_ranks, real_cores,
        crowded, notes,
    )  # fmt: skip


def p2p(comm, MPI, barrier, a: int, b: int, quick: bool) -> tuple[Level, dict]:
    sizes = measure.QUICK_PINGPONG_SIZES if quick else measure.PINGPONG_SIZES
    points = measure.pingpong(comm, MPI, barrier, a, b, sizes, quick)
    latency, bandwidth, residuals = measure.fit_hockney(points)
    record = {
        "ranks": [a, b],
        "latency": sig(latency),
        "bandwidth": sig(bandwidth),
        "points": [[s, sig(t), sig(r, 3)] for (s, t), r in zip(points, residuals, strict=True)],
        "max_abs_residual": sig(max(abs(r) for r in residuals), 3),
    }
    return Level(sig(latency), sig(bandwidth)), record


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from proxies.core import mpi
    from proxies.core.waiting import Waiter

    MPI = mpi.init()
    comm = MPI.COMM_WORLD
    mpi.abort_on_exception(comm, PROG)
    n, r = comm.size, comm.rank
    say = print if r == 0 else (lambda *a, **k: None)

    # -- everything that can be refused, refused before measuring
    mpi.agree(comm, output_problem(args.output) if r == 0 else None, PROG)
    rpn = args.ranks_per_node
    if rpn and n % rpn:
        mpi.agree(comm, f"--ranks-per-node {rpn} does not divide the {n} ranks", PROG)
    topo = topology(comm, MPI, rpn)
    sizes = Counter(topo.node_of)
    pairs = [q for q in sorted(sizes) if sizes[q] >= 2]
    if not pairs:
        mpi.agree(
            comm,
            "every node has one rank: run 2 or more ranks on a node so that intra_node can "
            "be measured (predict with --ranks-per-node 1 afterwards)",
            PROG,
        )
    nodes = len(sizes)
    waiter = Waiter(MPI, "yield")
    idle = lambda: waiter.barrier(comm)  # noqa: E731
    quick = args.quick
    t_start = time.time()
    how = f"--ranks-per-node {rpn}" if rpn else "MPI's shared-memory split"
    say(
        f"{PROG}: {n} ranks, {nodes} node(s) of {topo.ranks_per_node} ({how}), "
        f"{topo.cores_per_node} core(s) per node" + (" · quick" if quick else ""),
        flush=True,
    )
    for note in topo.notes:
        say(f"  note: {note}", flush=True)

    calibration: dict = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "ranks": n,
        "nodes": nodes,
        "machines": topo.real_nodes,
        "library": mpi.describe(MPI)["library"],
        "quick": quick,
        "oversubscribed": topo.crowded,
    }
    if topo.notes:
        calibration["notes"] = topo.notes
    first = {q: topo.node_of.index(q) for q in sizes}

    # -- who is active in the first regime: as many ranks per node as cores
    crowded = topo.ranks_per_node > topo.cores_per_node
    position = [topo.node_of[:q].count(topo.node_of[q]) for q in range(n)]
    active = position[r] < topo.cores_per_node
    calm = comm.Split(0 if active else MPI.UNDEFINED, r)
    calm_rpn = min(topo.ranks_per_node, topo.cores_per_node)
    calm_nodes = [topo.node_of[q] if position[q] < calm_rpn else -1 for q in range(n)]
    if crowded:
        say(
            f"  ranks outnumber cores: {calm_rpn} rank(s) per node measure first, the rest "
            f"parked; then all {topo.ranks_per_node} (the oversubscribed figures)",
            flush=True,
        )

    # -- point to point within a node, then across nodes
    pa = first[pairs[0]]  # the first two ranks of a node: the ping-pong's, the state's
    pb = topo.node_of.index(pairs[0], pa + 1)
    say(f"  intra-node ping-pong, ranks {pa} and {pb} ...", flush=True)
    intra, calibration["intra_node"] = p2p(comm, MPI, idle, pa, pb, quick)
    # the node exchange: three passes (one with quick), here, after the allreduces and
    # after the state (exchange.Exchanges)
    sizes = exchange.QUICK_EXCHANGE_SIZES if quick else exchange.EXCHANGE_SIZES
    ex_reps = 2 if quick else 5  # per size and pass; the incast's too
    exchanges = [exchange.Exchanges(comm, MPI, idle, calm_nodes, sizes, ex_reps)]
    if crowded:
        exchanges.append(exchange.Exchanges(comm, MPI, idle, topo.node_of, sizes, ex_reps))

    def exchange_pass(k: int) -> None:
        if k and quick:
            return
        mib = ", ".join(f"{s / (1 << 20):g}" for s in sizes)
        say(f"  every rank of node 0 exchanging {mib} MiB at once (pass {k + 1}) ...", flush=True)
        for ex in exchanges:
            ex.measure()

    exchange_pass(0)
    inter, nic = None, None
    if nodes >= 2:
        a, b = first[0], first[1]
        say(f"  inter-node ping-pong, ranks {a} and {b} ...", flush=True)
        inter, calibration["inter_node"] = p2p(comm, MPI, idle, a, b, quick)
        size = (1 if quick else 16) << 20
        say(f"  concurrent flows into node 0, {size >> 20} MiB each ...", flush=True)
        nic, flows, seconds = exchange.incast(comm, MPI, idle, topo.node_of, size, ex_reps)
        calibration["nic"] = {
            "flows": flows,
            "bytes_each": size,
            "seconds": sig(seconds),
            "bandwidth": sig(nic),
        }

    # -- compute: as many ranks per node as cores at once (the rest parked), each on a core
    # of its own as in the runs that do not crowd the node; where ranks outnumber cores the
    # predictor slows compute by ranks_per_node / cores_per_node itself. (Measured with
    # every rank at once, the time-sliced ranks' medians vary by 2x from run to run.)
    reps = 3 if quick else 10  # the default run takes seconds: medians of 10
    say("  np.matmul, copy and add rates, a rank per core at once ...", flush=True)
    shapes = measure.QUICK_MATMUL_SHAPES if quick else measure.MATMUL_SHAPES
    copy_bytes = (8 if quick else 64) << 20
    add_bytes = (4 if quick else 32) << 20
    rates = None
    if active:
        mm = measure.matmul_rates(calm, MPI, calm.Barrier, shapes, reps)
        copies = measure.copy_rates(calm, MPI, calm.Barrier, copy_bytes, reps)
        adds = measure.add_rates(calm, MPI, calm.Barrier, add_bytes, reps)
        rates = (mm, copies, adds)
    idle()
    mm, copies, adds = comm.bcast(rates, root=0)
    per_shape = [statistics.median(rates) for _, rates in mm]
    matmul = statistics.median(per_shape)
    memory = statistics.median(copies)
    reduce = statistics.median(adds)
    calibration["compute"] = {
        "matmul": [[*shape, sig(rate)] for (shape, _), rate in zip(mm, per_shape, strict=True)],
        "copy_bytes": copy_bytes,
        "add_bytes": add_bytes,
        "ranks": calm_rpn * nodes,
    }

    # -- allreduce algorithms: the active ranks (spinning waits), then everyone (yielding)
    ar_sizes = measure.QUICK_ALLREDUCE_SIZES if quick else measure.ALLREDUCE_SIZES
    say(f"  allreduce algorithms on {calm_rpn * nodes} rank(s) ...", flush=True)
    times = {}
    pair = calm_rpn * nodes >= 2  # the first regime has ranks to exchange
    if active and pair:
        times = measure.allreduce_measurements(
            calm,
            MPI,
            ar_sizes,
            reps=reps,
            warmup=1 if quick else 2,
            ranks_per_node=calm_rpn if rpn else None,
        )
    idle()
    times = comm.bcast(times, root=0)
    calibration["allreduce"] = {k: [[s, sig(t)] for s, t in v] for k, v in times.items()}
    exchange_pass(1)
    # what else the fit answers to: MPI's all-to-all, and the node exchange's
    # plain messages (cold, both ways)
    from proxies.calibrate.fit import ALLTOALL, exchange_target

    a2a_sizes = measure.QUICK_ALLTOALL_SIZES if quick else measure.ALLTOALL_SIZES
    say(f"  MPI's all-to-all on {calm_rpn * nodes} rank(s) ...", flush=True)
    a2a = untouched = None
    if active and pair:
        a2a = measure.mpi_alltoall(calm, MPI, a2a_sizes, reps=reps, warmup=1 if quick else 2)
        # the largest two sizes again from a send buffer never written (zero_pages)
        untouched = measure.mpi_alltoall(
            calm, MPI, a2a_sizes[-2:], reps=reps, warmup=1 if quick else 2, untouched=True
        )
    idle()
    a2a, untouched = comm.bcast((a2a, untouched), root=0)
    targets = dict(times)
    if a2a:
        calibration["alltoall"] = {
            "mpi": [[s, sig(t)] for s, t in a2a],
            "untouched": [[s, sig(t)] for s, t in untouched],
        }
        targets[f"{ALLTOALL}mpi"] = a2a
    # -- the machine's state now, on the ping-pong's two ranks: python -m
    # proxies.calibrate.probe measures the same later (a run in another state is slower or
    # faster than predicted, whatever the model)
    say(f"  the machine's state (calibrate.probe's figures), ranks {pa} and {pb} ...", flush=True)
    duo = comm.Split(0 if r in (pa, pb) else MPI.UNDEFINED, r)
    now = None
    if duo != MPI.COMM_NULL:
        now = state.state(duo, MPI, reps=5 if quick else 15)
        duo.Free()
    idle()
    now = comm.bcast(now, root=pa)
    calibration["state"] = {k: sig(v) if isinstance(v, float) else v for k, v in now.items()}
    exchange_pass(2)
    calibration["node"] = exchange.exchange_record(exchanges[0].points(), exchanges[0].flows)
    node_bw = calibration["node"]["bandwidth"] or None  # one active rank: no pair to measure
    crowded_node_bw = None
    if crowded:
        calibration["oversubscribed_node"] = exchange.exchange_record(
            exchanges[1].points(), exchanges[1].flows
        )
        crowded_node_bw = calibration["oversubscribed_node"]["bandwidth"]
    targets |= exchange_target(calibration["node"])
    crowded_times = None
    if crowded:
        say(f"  allreduce algorithms on all {n} ranks, yielding waits ...", flush=True)
        crowded_times = measure.allreduce_measurements(
            comm,
            MPI,
            ar_sizes,
            reps=reps,
            warmup=1 if quick else 2,
            wait=waiter.waitall,
            barrier=idle,
            ranks_per_node=rpn,
        )
        if n >= 4 and n % 2 == 0:
            # the proxies' groups are often small (tensor-parallel pairs, pipeline pairs):
            # MPI's allreduce in every pair of ranks together, kept with its residual (the
            # fit leaves it out: all pairs woken at once is their slow case)
            from proxies.calibrate.fit import PAIRS

            say("  MPI's allreduce in every pair of ranks at once, yielding waits ...")
            duo = comm.Split(r // 2, r)
            mine = measure.allreduce_measurements(
                duo,
                MPI,
                ar_sizes,
                ["mpi"],
                reps=reps,
                warmup=1 if quick else 2,
                wait=waiter.waitall,
                barrier=idle,
            )["mpi"]
            duo.Free()
            every = comm.allgather(mine)
            crowded_times[f"mpi{PAIRS}"] = [
                (size, max(p[i][1] for p in every)) for i, (size, _) in enumerate(mine)
            ]
        calibration["oversubscribed_allreduce"] = {
            k: [[s, sig(t)] for s, t in v] for k, v in crowded_times.items()
        }
        say(f"  MPI's all-to-all on all {n} ranks, yielding waits ...", flush=True)
        a2a = measure.mpi_alltoall(
            comm, MPI, a2a_sizes, reps=reps, warmup=1 if quick else 2,
            wait=waiter.waitall, barrier=idle,
        )  # fmt: skip
        calibration["oversubscribed_alltoall"] = {"mpi": [[s, sig(t)] for s, t in a2a]}
        say("  unexpected messages into a rank inside MPI's all-to-all, yielding waits ...")
        odd = unexpected.measure(comm, MPI, 3 if quick else 15, quick)
        if odd is not None:
            calibration["oversubscribed_unexpected"] = {
                k: sig(v) if isinstance(v, float) else v for k, v in odd.items()
            }
        crowded_targets = {**crowded_times, f"{ALLTOALL}mpi": a2a}
        crowded_targets |= exchange_target(calibration["oversubscribed_node"])

    # -- MPI's temporaries: when fresh (page faults counted), and the fault rate
    say("  MPI allreduce page faults by size, fault rate of fresh memory ...", flush=True)
    fresh_sizes = measure.QUICK_FRESH_SIZES if quick else measure.FRESH_SIZES
    fresh_points, rates = [], []
    if active and pair:
        fresh_points = measure.mpi_fresh(calm, MPI, fresh_sizes, 2 if quick else 3)
    if active:
        rates = measure.fault_rates(calm, MPI, calm.Barrier, (16 if quick else 64) << 20, reps)
    idle()
    fresh_points, rates = comm.bcast((fresh_points, rates), root=0)
    above = measure.fresh_above(fresh_points)
    fill_rate = statistics.median(rates)
    calibration["fresh_memory"] = {
        "faulted_per_call": [[s, int(b)] for s, b in fresh_points],
        "fill_rate": sig(fill_rate),
    }

    # -- the engine's own cost per op, in each regime
    say("  the engine's own cost per op ...", flush=True)
    ops, iters = (40, 3) if quick else (200, 5)
    op_overhead, kinds = 0.0, {}
    if active and calm.size > 1:
        op_overhead, kinds = measure.engine_overhead(calm, MPI, ops, iters, "spin", kinds=True)
    idle()
    op_overhead, kinds = comm.bcast((op_overhead, kinds), root=0)
    say("  small ops after bulk data (cold caches) ...", flush=True)
    cold_points = None
    if active and calm.size > 1:
        sizes = caches.QUICK_SIZES if quick else caches.SIZES
        cold_points = caches.measure_cold(calm, MPI, sizes, 20 if quick else 40, iters)
    idle()
    cold_points = comm.bcast(cold_points, root=0)
    kinds = {kind: sig(seconds) for kind, seconds in kinds.items() if seconds > 0}
    crowded_overhead = None
    if crowded:
        crowded_overhead = measure.engine_overhead(comm, MPI, ops, iters, "yield")[0]
    # how much longer than asked a sleep lasts (slept compute, yielding waits' sleeps): a
    # rank per core at once
    wake = 0.0
    if active:
        wake = measure.sleep_overshoot(calm, MPI, 3 if quick else 10)
    idle()
    wake = max(0.0, comm.bcast(wake, root=0))
    calibration["engine"] = {"ops": ops, "op_overhead": sig(op_overhead), "wake": sig(wake)}
    calibration["engine"].update(kinds)
    if crowded_overhead is not None:
        calibration["engine"]["oversubscribed_op_overhead"] = sig(crowded_overhead)
    # -- last (it leaves glibc's thresholds raised): the fault rate MPI itself sees
    fault_rate = fill_rate
    if above is not None:
        size, faulted = fresh_points[-1]
        from_mpi = None
        if active:
            from_mpi = measure.mpi_fault_rate(calm, MPI, size, faulted, 3 if quick else 5)
        idle()
        from_mpi = comm.bcast(from_mpi, root=0)
        if from_mpi is not None:
            calibration["fresh_memory"]["from_mpi"] = {
                k: (sig(v) if isinstance(v, float) else v) for k, v in from_mpi.items()
            }
            if from_mpi.get("rate"):
                fault_rate = from_mpi["rate"]
    calibration["fresh_memory"]["fault_rate"] = sig(fault_rate)
    if calm != MPI.COMM_NULL:
        calm.Free()
    calibration["seconds"] = sig(time.time() - t_start, 3)

    unmeasured = (["inter_node"] if inter is None else []) + ["compute.device", "switch"]
    m = Machine(
        name=args.name or os.path.splitext(os.path.basename(args.output))[0],
        source="",
        ranks_per_node=topo.ranks_per_node,
        cores_per_node=topo.cores_per_node,
        intra=intra,
        inter=inter,
        nic_bandwidth=sig(nic) if nic else None,
        switch_nodes=None,
        oversubscription=1.0,
        matmul_flops=sig(matmul),
        memory_bandwidth=sig(memory),
        device_flops=None,
        reduce_bandwidth=sig(reduce),
        mpi={},
        unmeasured=tuple(unmeasured),
        calibration=calibration,
        node_bandwidth=sig(node_bw) if node_bw else None,
        fresh_above=above,
        fault_rate=sig(fault_rate) if above is not None else None,
        op_overhead=sig(op_overhead) if op_overhead > 0 else 0.0,
        op_overheads=kinds,
        wake=sig(wake),
    )
    error = None
    if r == 0:
        from proxies.calibrate.fit import fit

        say(
            "  fitting the network figures to the allreduces, the node exchange and MPI's "
            "all-to-all through the predictor ...",
            flush=True,
        )
        m, record = fit(m, targets, calm_rpn * nodes, calm_rpn)  # ping-pong alone if none
        m.calibration["fit"] = fit_record(record, "from_pingpong")
        say(
            f"  fit: rms of log(predicted / measured), the mean over kinds of measurement, "
            f"{record['rms_log_error_before']:.2f} (ping-pong figures) -> "
            f"{record['rms_log_error_after']:.2f}; MPI's allreduce follows "
            + (
                ", ".join(
                    f"{alg} up to {b} B" if b < 2**63 else f"{alg} above"
                    for b, alg in m.mpi.get("allreduce", [])
                )
                or "MPICH's defaults (not measured)"
            ),
            flush=True,
        )
        if crowded:
            from dataclasses import replace

            from proxies.calibrate.fit import fit_oversubscribed

            say("  fitting the oversubscribed figures to the measurements on every rank ...")
            m = replace(
                m,
                oversub=m.intra,
                oversub_node_bandwidth=sig(crowded_node_bw),
                oversub_op_overhead=sig(crowded_overhead) if crowded_overhead else None,
                oversub_wake=max(m.wake, 1e-5),  # the search scales it: not 0
            )
            m, over = fit_oversubscribed(m, crowded_targets, n, topo.ranks_per_node)
            m = replace(
                m,
                oversub=Level(sig(m.oversub.latency), sig(m.oversub.bandwidth)),
                oversub_node_bandwidth=sig(m.oversub_node_bandwidth),
                oversub_wake=sig(m.oversub_wake),
                oversub_mpi_latency=(
                    sig(m.oversub_mpi_latency) if m.oversub_mpi_latency is not None else None
                ),
            )
            m.calibration["oversubscribed_fit"] = fit_record(over, "start")
            odd = m.calibration.get("oversubscribed_unexpected")
            if odd:
                taken = unexpected.fitted(odd, m, n, topo.ranks_per_node)
                m = replace(m, oversub_unexpected=sig(taken))
            say(
                f"  oversubscribed fit: rms of log(predicted / measured) "
                f"{over['rms_log_error_before']:.2f} -> {over['rms_log_error_after']:.2f}",
                flush=True,
            )
        m = caches.with_zero_pages(caches.with_reuse(m, now), calm_rpn * nodes, calm_rpn)
        m = caches.with_cold(m, cold_points)
        summary(m, topo)
        # A minute of measuring is not lost to a full disk: save falls back and says where.
        text = dumps(m, comments(m, topo, quick))
        written = report.save(args.output, text, prog=PROG, suffix=".yaml")
        if written is None:
            error = f"-o {args.output}: cannot write it nor a fallback"
        else:
            print(f"wrote {written}", flush=True)
    mpi.agree(comm, error, PROG)
    return 0


def entry() -> None:
    cli.run_main(PROG, main)


def fit_record(record: dict, start: str) -> dict:
    """A fit's record as the machine file keeps it (calibration.fit / oversubscribed_fit):
    the starting and fitted figures, the rms log errors and every allreduce's residual,
    rounded to significant digits."""
    return {
        start: {k: sig(v) for k, v in record[start].items()},
        "fitted": {k: sig(v) for k, v in record["fitted"].items()},
        "rms_log_error_before": sig(record["rms_log_error_before"], 3),
        "rms_log_error_after": sig(record["rms_log_error_after"], 3),
        "residuals": {
            alg: [[b, sig(t), sig(p), sig(e, 3)] for b, t, p, e in rows]
            for alg, rows in record["residuals"].items()
        },
    }
