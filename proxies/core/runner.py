"""The run every proxy shares: plans -> communicators -> iterations -> report.

A proxy describes itself as a Job (its plans, its runtime, how to label ranks) and hands it
to `run` (real MPI run) or `dryrun.dry_run` (plans for any world size from one process).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from proxies.core import (
    cli,
    exits,
    faults,
    memory,
    provenance,
    report,
    threads,
    trace,
)
from proxies.core.grid import ProcessGrid
from proxies.core.live import Live
from proxies.core.plan import Compute, Plan, retype
from proxies.core.report import HIDDEN
from proxies.core.waiting import Waiter

if TYPE_CHECKING:  # the engine (and its collectives) is imported by `run`, after the header
    from proxies.core.engine import IterationTimes


@dataclass(kw_only=True)
class Job:
    """What a proxy's make_job hands to `run` and `dry_run`: built by keyword, every field
    declared here (nothing is attached after construction)."""

    prog: str  # "proxies.gpt2"
    proxy: str  # "gpt2"
    config: dict  # every resolved option, stored in the JSON results
    grid: ProcessGrid
    plan: Callable[[int], Plan]  # world rank -> one iteration of that rank
    group_names: tuple[str, ...]  # every group any plan may name, for communicators
    label: Callable[[int], str]  # world rank -> row label in the per-stage table
    header: list[str] = field(default_factory=list)  # lines describing the run
    # Built only when running: (rank, MPI, communicators, mode) -> Runtime.
    runtime: Callable | None = None
    # Group whose members run identical compute: replay measures on its rank 0 only
    # ("self", a name no group has: every rank measures its own).
    replay_share: str = "dp"
    # Wire dtypes (--dtype, --grad-dtype as plan dtype names): categories that are gradient
    # reductions travel as the second, other float32 traffic as the first, except buffers
    # kept in float32 (plan.retype). `plan` returns the retyped plans.
    dtypes: tuple[str, str] = ("float32", "float32")
    grad_categories: frozenset[str] = frozenset()
    fp32_buffers: frozenset[str] = frozenset()
    # Grid dimensions whose members run the same plan op for op (replicas): a prediction of
    # a large world simulates one rank per combination of the other coordinates.
    fold: tuple[str, ...] = ("dp",)
    # (world rank, its plan as `plan` returns it) -> its estimated memory for the run's
    # --compute mode: {part: bytes} (core/memory.py adds the shared parts); None: no
    # estimate, never refused. Read it through memory_estimate.
    memory: Callable[[int, Plan], dict[str, int]] | None = None
    # (plan) -> (buffer name, micro-batch) -> the buffer the runtime uses for it with
    # --compute none and model, where runtimes reuse a few buffers (the predictor prices
    # MPI's collectives on reused buffers with the machine's `reuse` figures); None: one
    # buffer per (name, micro-batch).
    buffers: Callable[[Plan], Callable[[Any, int], Any]] | None = None
    # The timing categories this proxy adds: label of each in display order, and short
    # column headers (its spec's tables, core/spec.py); core/report.py has the shared ones.
    categories: Mapping[str, str] = field(default_factory=dict)
    short: Mapping[str, str] = field(default_factory=dict)
    # The model's own resolved setup, for its own dry run and tests (gpt3: a transformer
    # Setup); core never reads it, hence no type core could name.
    setup: object | None = None
    # What a proxy adds to the shared dry run, given the representatives' plans {rank: plan}:
    # lines printed after the plan table, and fields for its JSON.
    dry_run_lines: Callable[[Any, dict[int, Plan]], None] | None = None  # (console, plans)
    dry_run_json: Callable[[dict[int, Plan]], dict] | None = None
    # (grid dimension, its table heading): the dry run's per-dimension traffic table and
    # JSON "traffic", one row group per coordinate of that dimension (core/traffic.py).
    traffic_by: tuple[str, str] | None = None
    # Without --show-ranks, list the ops of one rank per label (False: none, for plans of
    # thousands of ops per rank).
    ops_by_default: bool = True

    def report_categories(self) -> report.Categories:
        """The categories this job's tables name: core's and the proxy's."""
        return report.Categories.of(self.categories, self.short)

    def memory_estimate(self, rank: int) -> dict[str, int] | None:
        """Rank `rank`'s memory estimate (see `memory`), None without an estimator."""
        return None if self.memory is None else self.memory(rank, self.plan(rank))

    def __post_init__(self) -> None:
        act, grad = self.dtypes
        names = {v: k for k, v in cli.WIRE_DTYPES.items()}
        self.config.setdefault("dtype", names[act])
        self.config.setdefault("grad_dtype", names[grad])
        if act == grad == "float32":
            return

        def retyped(build: Callable[[int], Plan]) -> Callable[[int], Plan]:
            def plan(rank: int) -> Plan:
                return retype(build(rank), act, grad, self.grad_categories, self.fp32_buffers)

            return plan

        uncached = getattr(self.plan, "__wrapped__", None)  # a cached plan's own function
        self.plan = retyped(self.plan)
        if uncached is not None:
            self.plan.__wrapped__ = retyped(uncached)


# -- dry run -------------------------------------------------------------------------------


def communicators(MPI, plan: Plan, names: tuple[str, ...]) -> dict:
    """One communicator per group name (None where this rank is in no such group).

    Collective over the world: every rank calls Split for every name, in the same order.
    """
    world = MPI.COMM_WORLD
    comms = {}
    for name in names:
        members = plan.groups.get(name)
        color = min(members) if members else MPI.UNDEFINED
        key = members.index(world.rank) if members else 0
        comm = world.Split(color, key)
        comms[name] = None if comm == MPI.COMM_NULL else comm
    return comms


def calibrate(MPI, job: Job, plan: Plan, runtime, comms: dict, watchdog) -> dict:
    """Replay times: each compute op's duration with the real kernels, one rank at a time
    per node when ranks outnumber cores, so contention does not inflate them. Measured on
    rank 0 of each `replay_share` group (identical compute) and shared with the group."""
    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    share = comms.get(job.replay_share)
    measuring = share is None or share.rank == 0
    ops = [op for op in plan.ops if isinstance(op, Compute)]
    samples: dict[tuple[str, int], list[float]] = defaultdict(list)

    def measure():
        for rep in range(3):  # the first pass warms allocations and caches
            for op in ops:
                t0 = time.perf_counter()
                runtime.compute(op, 0)
                if rep:
                    samples[(op.name, op.chunk)].append(time.perf_counter() - t0)

    watchdog.busy("calibrating replay times (ranks take turns)")  # local work: no timer
    if node.size > threads.cores_available():
        # Waiting ranks must not spin in MPI_Barrier while one measures, nor wake often.
        waiter = Waiter(MPI, "yield", max_sleep=0.02)
        for turn in range(node.size):
            if node.rank == turn and measuring:
                measure()
            waiter.barrier(node)
    elif measuring:
        measure()
    times = {k: statistics.median(v) for k, v in samples.items()}
    if share is not None:
        times = share.bcast(times, root=0)
    node.Free()
    watchdog.beat("calibrated")
    return times


def book_overhead_and_tail(MPI, world, timed: list[IterationTimes]) -> None:
    """Make every rank's categories add up to the iteration time, in place.

    An iteration lasts as long as its slowest rank (all start together after a barrier and
    the next one waits for the last). A rank that ends earlier, such as the last pipeline
    stage, which finishes its final backward while stage 0 is still in the cool-down, waits
    the difference: that is idle, booked here. What is left of a rank's own time after its
    ops is the engine's overhead. One Allreduce(MAX) after the run, nothing inside iterations.
    """
    own = np.array([t.total for t in timed])
    slowest = np.empty_like(own)
    world.Allreduce(own, slowest, op=MPI.MAX)
    for t, end in zip(timed, slowest.tolist(), strict=True):
        spent = sum(v for k, v in t.seconds.items() if not k.endswith(HIDDEN))
        t.seconds["overhead"] = max(0.0, t.total - spent)
        t.seconds["idle"] += end - t.total
        t.total = end


def run(job: Job, args, MPI, machine=None) -> int:
    from proxies.core.mpi import Watchdog, abort_on_exception, end, set_where
    from proxies.core.mpi import describe as mpi_describe

    world = MPI.COMM_WORLD
    rank = world.rank
    abort_on_exception(world, job.prog)
    live = Live.start(args, MPI, job.header)  # rank 0 prints the header now (core/live.py)
    from proxies.core import waits
    from proxies.core.engine import CheckError, Engine

    # A diverging run says so once, at its end (exits.DIVERGED), not in a RuntimeWarning per
    # kernel per rank as its values overflow.
    np.seterr(over="ignore", invalid="ignore")
    watchdog = Watchdog(world, job.prog, args.timeout)
    set_where(lambda: watchdog.what)  # for the line Ctrl-C prints
    watchdog.busy("building this rank's plan")
    live.phase("building this rank's plan")
    plan = job.plan(rank)
    watchdog.beat("creating the communicators (a collective over every rank)")
    live.phase("creating the communicators")
    comms = communicators(MPI, plan, job.group_names)
    watchdog.busy("building the model and its buffers")  # local work: no timer
    live.phase("building the model and its buffers")
    runtime = job.runtime(rank, MPI, comms, args.compute)
    live.phase("calibrating replay times (ranks take turns)", args.compute == "replay")
    replay = calibrate(MPI, job, plan, runtime, comms, watchdog) if args.compute == "replay" else {}
    fault = ""
    spec = os.environ.get("PROXIES_FAULT", "")  # test hook, e.g. "corrupt:1"
    if spec and spec.split(":")[-1] in (str(rank), "all"):
        fault = spec.split(":")[0]
    crowded, largest = threads.placement(MPI, world)
    wait = ("yield" if crowded else "spin") if args.wait == "auto" else args.wait
    if machine is not None and not args.ranks_per_node:
        # the prediction beside this run places ranks as the run does (prediction.py)
        args.placed_per_node = largest
    job.config["wait"] = wait
    live.lines([run_line(world.size, mpi_describe(MPI), wait, args)])
    engine = Engine(
        MPI,
        plan,
        runtime,
        comms,
        mode=args.compute,
        device_tflops=args.device_tflops,
        replay=replay,
        check=args.check,
        watchdog=watchdog,
        fault=fault,
        wait=wait,
        allreduce=args.allreduce,
        progress=args.progress,
        faults=faults.for_engine(args, rank),
    )

    tracer = trace.start(MPI, world, plan, job, args)  # --trace: clocks aligned to rank 0
    timed, losses = [], np.zeros((args.warmup + args.iters, 2))
    for it in range(args.warmup + args.iters):
        watchdog.beat(f"barrier before iteration {it}")
        engine.waiter.barrier(world)
        engine.trace = tracer and tracer.recorder(it)
        if it == args.warmup and args.chakra is not None:  # per-op compute, timed iterations
            engine.durations = [0.0] * len(plan.ops)
        try:
            t = engine.run_iteration(it)
        except CheckError as e:
            print(f"{job.prog}: {e}", file=sys.stderr, flush=True)
            end(exits.CHECK, world)  # never returns, even where MPI_Abort does
        losses[it] = runtime.finish_iteration(it)
        if it >= args.warmup:
            timed.append(t)
        live.iteration(it, t.total, losses[it], engine.waiter, watchdog)  # between timed
    live.close()
    engine.close()
    job.config["progress"] = engine.progress_mode
    watchdog.beat("collecting results")
    waits.attribute_collectives(MPI, comms, plan.groups, timed)
    waits.attribute_tail(MPI, world, timed)
    waits.split_collective_waits(MPI, comms, timed)
    book_overhead_and_tail(MPI, world, timed)
    traced = trace.gather(tracer, MPI, comms, timed)  # the --trace document on rank 0
    cats = sorted({c for t in timed for c in t.seconds})
    row = {
        "rank": rank,
        "label": job.label(rank),
        "iter_s": [t.total for t in timed],
        "seconds": {c: [t.seconds.get(c, 0.0) for t in timed] for c in cats},
        "bytes": plan.bytes_by_category(),
        "waited_for": waits.per_iteration(timed),
    }
    rows = world.gather(row, root=0)
    # --chakra: each rank's per-op compute seconds, their mean over the timed iterations
    means = [s / args.iters for s in engine.durations] if engine.durations is not None else None
    measured = world.gather(means, root=0) if args.chakra is not None else None
    origin = provenance.fields(MPI, world)  # collective: rank 0 gathers the node names
    # replayed compute times per rank, for the prediction beside the measurement
    replays = world.gather(replay, root=0) if machine is not None and replay else None
    total_loss = np.zeros_like(losses)
    world.Reduce(losses, total_loss, op=MPI.SUM, root=0)
    # Each rank's first iteration with a non-finite loss (for the message; one gather).
    bad = np.flatnonzero(~np.isfinite(losses[:, 0]))
    firsts = world.allgather(int(bad[0]) if bad.size else -1)  # every rank exits alike
    watchdog.stop()
    if rank != 0:
        return exits.DIVERGED if args.compute == "real" and diverged(firsts) else exits.OK

    result = {
        "proxy": job.proxy,
        "config": job.config,
        "world_size": world.size,
        "grid": job.grid.describe(),
        "mpi": mpi_describe(MPI),
        "blas_threads": threads.decision[0] if threads.decision else None,
        "timestamp": report.timestamp(),
        **report.summarize(rows, job.report_categories()),
        **origin,
    }
    if args.compute == "real" and total_loss[:, 1].all():
        # Mean over every sample of the global batch, warm-up iterations first.
        result["loss"] = (total_loss[:, 0] / total_loss[:, 1]).tolist()
    if args.compute == "replay":
        result["replay_s"] = {f"{k[0]}/{k[1]}": v for k, v in sorted(replay.items())}
    report.print_report(
        result,
        [],  # the header and run line: printed before the first iteration (live.lines)
        quiet=args.quiet,
        table=job.report_categories(),
    )
    code = exits.OK
    if args.compute == "real" and diverged(firsts):
        it, who = diverged(firsts)
        print(
            f"{job.prog}: the loss is not finite from iteration {it} on (first seen on rank "
            f"{who}, {job.label(who)}): a learning rate too high for this model?",
            file=sys.stderr,
            flush=True,
        )
        code = exits.DIVERGED
        # strict JSON has no NaN or Infinity: null stands for a loss that was not finite
        result["loss"] = [x if np.isfinite(x) else None for x in result.get("loss", [])]
    if args.chakra is not None:  # before the JSON, which records what was written
        from proxies.core import chakra

        result["chakra"] = chakra.write_measured(job, args, measured)
        if result["chakra"] is None:
            code = exits.FAILED
    if args.json:
        written = report.write_json(args.json, result, prog=job.prog)
        if written is None:
            return exits.FAILED
        args.json = written  # compare() rewrites the same file
    if not trace.write(args.trace, traced, job.prog):
        return exits.FAILED
    if machine is not None:
        compare(job, args, machine, result, replays)
    return code


def diverged(firsts: list[int] | None) -> tuple[int, int] | None:
    """(iteration, rank) of the earliest non-finite loss over ranks (-1: none), or None."""
    seen = [(it, r) for r, it in enumerate(firsts or []) if it >= 0]
    return min(seen) if seen else None


def compare(job: Job, args, machine, result: dict, replays) -> None:
    """--machine on a real run: the prediction beside the measurement (rank 0, after the
    measured results are written, so a failing prediction loses nothing)."""
    from proxies.core import prediction

    console = report.console()
    replay = dict(enumerate(replays)) if replays else None
    pred, note = prediction.run_prediction(job, args, machine, replay=replay)
    predicted = prediction.as_result(pred, job, job.grid.size)
    console.print(note)
    prediction.print_comparison(result, predicted, console, job.report_categories())
    result |= prediction.json_fields(pred, predicted, note)
    if args.json:
        report.write_json(args.json, result, prog=job.prog)


def run_line(world_size: int, m: dict, wait: str, args) -> str:
    """The header's last line: how the run runs (printed once MPI and waits are known)."""
    th = threads.decision
    blas = f"BLAS threads {th[0]}/rank ({th[3]})" if th else ""
    return (
        f"ran on {world_size} ranks · {m['library']} · mpi4py {m['mpi4py']} · "
        f"thread level {m['thread_level']} · waits {wait} · {blas} · "
        f"compute {args.compute} · wire {args.dtype} (gradients {args.grad_dtype})"
        + (" · --check on" if args.check else "")
    )


def main(job_from_args: Callable, parser, argv: list[str] | None) -> int:
    """Parse, build the job for the right world size, then dry-run or run."""
    args = parser.parse_args(argv)
    machine = cli.use_machine(args)
    trace.check_args(args)
    if args.chakra is not None:
        from proxies.core import chakra

        chakra.check_option(args.chakra)  # the package and the folder, before planning
    if args.dry_run:
        cli.check_output(args.json)  # before planning, however long that takes
        cli.check_output(args.trace, "--trace")
        world = args.world_size or cli.env_world_size() or 1
        job = job_from_args(args, world)
        if cli.env_rank() != 0:  # under a launcher: rank 0 plans and prints, the rest exit
            faults.attach(job, args)  # bad input still exits 2 everywhere
            return 0
        from proxies.core.dryrun import dry_run

        return dry_run(job, args, machine)
    if args.world_size is not None:
        raise cli.UsageError(
            "--world-size only goes with --dry-run (a real run has mpiexec's size)"
        )
    from proxies.core import mpi, supervisor

    # Under a launcher this process forks: the child goes on as the rank, the parent stays
    # outside MPI to name the rank if it dies and to time its start-up (core/supervisor.py).
    supervisor.supervise(parser.prog.removeprefix("python -m "), args.timeout)
    MPI = mpi.init()
    # Checks that may differ between ranks (a file missing on one node) must not leave the
    # others waiting in a collective: every rank reports, the lowest failing one prints.
    try:
        job, error = job_from_args(args, MPI.COMM_WORLD.size), None
        faults.attach(job, args)  # checked against the job; in the header and config
        memory.refuse_rank(job, args, MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size)
    except cli.UsageError as e:
        job, error = None, str(e)
    if error is None and MPI.COMM_WORLD.rank == 0:  # rank 0 writes the results
        error = cli.output_problem(args.json) or cli.output_problem(args.trace, "--trace")
    mpi.agree(MPI.COMM_WORLD, error, parser.prog.removeprefix("python -m "))
    return run(job, args, MPI, machine)
