"""--machine: a job's iteration predicted on a machine model, printed and stored beside (or
instead of) the measurement. The simulation itself is predict.py; this is the glue every
proxy shares: what a compute op costs in each mode, which ranks are simulated, the tables.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import numpy as np

from proxies.core import cli, faults, report
from proxies.core.mpi_choice import chooser
from proxies.core.network import Topology
from proxies.core.plan import Collective, Compute, Plan, Wait
from proxies.core.predict import Prediction, predict
from proxies.core.simulate import PlanError

SIMULATE_OPS = 400_000  # fold identical ranks when every rank's ops would exceed this
DEFAULT_DEVICE_FLOPS = 150e12  # --device-tflops' default


def representatives(grid, fold: Sequence[str]) -> np.ndarray:
    """world rank -> the rank with the same coordinates except `fold` dimensions at 0."""
    dims = [d for d, _ in grid.degrees]
    ranks = grid._ranks
    index = tuple(
        slice(0, 1) if d in fold else slice(None) for d in dims
    )  # folded axes at coordinate 0, broadcast back over them
    reps = np.broadcast_to(ranks[index], ranks.shape)
    out = np.empty(grid.size, dtype=np.int64)
    out[ranks.reshape(-1)] = reps.reshape(-1)
    return out


def compute_cost(
    args, machine, world: int, replay: dict | None = None
) -> tuple[Callable[[int, Compute], float], str]:
    """(rank, op) -> predicted seconds of a Compute op in args.compute's mode, and a phrase
    saying how. model: the run's --device-tflops if given, else the machine's device rate;
    replay on a real run: the replayed times; real (and replay in a dry run): FLOPs at the
    machine's matmul rate, slowed by ranks per node over cores where they share cores.
    model and replay sleep each op's time, and a sleep lasts the machine's engine.wake
    longer than asked."""
    mode = args.compute
    wake = machine.wake
    if mode == "none":
        return (lambda r, op: 0.0), "no compute (--compute none)"

    def slept(d: float) -> float:
        return d + wake if d > 0 else 0.0

    if mode == "model":
        rate = args.device_tflops * 1e12  # the machine's device rate unless given (cli)
        return (
            lambda r, op: slept(op.model_seconds(rate))
        ), f"compute modelled at {rate / 1e12:g} TFLOP/s (or the proxy's known per-op times)"
    if mode == "replay" and replay:
        return (
            lambda r, op: slept(replay[r].get((op.name, op.chunk), 0.0))
        ), "compute as replayed (measured per op)"
    rate = machine.matmul_flops or machine.device_flops
    if not rate:
        raise cli.UsageError(
            f"{machine.source or machine.name}: compute.matmul (or compute.device) is needed "
            f"to predict --compute {mode}; give it, or predict --compute model or none"
        )
    rpn, cores = machine_rpn(args, machine, world), machine.cores_per_node
    share = max(1.0, rpn / cores)
    how = f"compute as FLOPs at {rate / 1e9:g} GFLOP/s per rank"
    if share > 1:
        how += f", {share:g}x slower: {rpn} ranks share {cores} cores"
    return (lambda r, op: op.flops / rate * share), how


def machine_rpn(args, machine, world: int) -> int:
    """Ranks per node of a prediction: --ranks-per-node; else on a real run the run's own
    placement (its largest node, by MPI's shared-memory split: the runner sets
    `placed_per_node`); else the file's nodes.ranks_per_node. Never more than the world:
    2 ranks on nodes of 4 are 2 ranks on one node (a file calibrated with 4 ranks on 2
    cores then prices a 2-rank run as uncrowded, as it runs)."""
    rpn = (
        getattr(args, "ranks_per_node", None)
        or getattr(args, "placed_per_node", None)
        or machine.ranks_per_node
    )
    return min(rpn, world)


def fold_dims(job, world: int, ops_per_rank: int, fold: str = "auto") -> tuple[str, ...]:
    """The grid dimensions folded (simulated once): the job's, when every rank would be
    too many ops to simulate one by one (or always/never, for tests)."""
    if fold == "never" or not job.fold:
        return ()
    if fold == "always" or world * ops_per_rank > SIMULATE_OPS:
        return tuple(d for d in job.fold if job.grid.degree(d) > 1)
    return ()


def run_prediction(
    job,
    args,
    machine,
    *,
    replay: dict | None = None,
    fold: str = "auto",
    detail: str | None = None,
    keep_spans: bool = False,
    plans: dict[int, Plan] | None = None,
) -> tuple[Prediction, str]:
    """Predict one iteration of the job; returns the prediction and a line saying what was
    simulated and how. `plans`: any already built (rank -> plan), not built again."""
    world = job.grid.size
    built = plans or {}
    first = built.get(0) or job.plan(0)
    perturbed = faults.of(args)  # --slow-rank, --jitter, --slow-link: ranks no longer alike
    fold = "never" if perturbed is not None and perturbed.perturbs else fold
    dims = fold_dims(job, world, len(first.ops), fold)
    rpn = machine_rpn(args, machine, world)
    topo = Topology(machine, rpn, getattr(args, "wait", None) or "auto")
    if world > rpn and machine.inter is None:
        raise cli.UsageError(
            f"{machine.source or machine.name}: {world} ranks at {rpn} per node need "
            f"{-(-world // rpn)} nodes, but the machine has no inter_node level (a one-node "
            f"calibration); give --ranks-per-node {world} or a multi-node machine file"
        )
    if dims:
        rep_of = representatives(job.grid, dims)
        ranks = sorted(set(rep_of.tolist()))
    else:
        rep_of, ranks = None, list(range(world))
    simulated = [first if r == 0 else built.get(r) or job.plan(r) for r in ranks]
    cost, how = compute_cost(args, machine, world, replay)
    cost, how = faults.perturbed_cost(perturbed, cost, how, args.warmup)
    algorithm = chooser(machine, args.allreduce)
    buffers = None
    if getattr(args, "compute", None) in ("none", "model"):  # the runtime's reused buffers
        buffers = job.buffers or (lambda plan: lambda name, mb: (name, mb))
    try:
        pred = predict(
            simulated,
            topo,
            cost,
            algorithm,
            detail=detail or getattr(args, "predict", "auto") or "auto",
            rep_of=rep_of,
            keep_spans=keep_spans,
            slow_links=perturbed.links if perturbed is not None else None,
            buffers=buffers,
            untouched_sends=buffers is not None and not getattr(args, "check", False),
        )
    except ValueError as e:  # a topology the machine cannot hold
        raise cli.UsageError(str(e)) from None
    nodes = -(-world // rpn)
    what = (
        f"all {world} ranks"
        if rep_of is None
        else f"{len(ranks)} of {world} ranks (identical ranks once: ranks differing only in "
        f"{'/'.join(dims)} are images of the one with those coordinates 0)"
    )
    placed = not getattr(args, "ranks_per_node", None) and getattr(args, "placed_per_node", None)
    note = (
        f"predicted on {machine.name} ({rpn} ranks per node"
        f"{', as this run placed them' if placed else ''}, {nodes} node{'s' * (nodes > 1)}): "
        f"simulated {what}, collectives {pred.detail}, {pred.flows:,} flows; {how}; "
        f"allreduce {args.allreduce}"
    )
    return pred, note


def as_result(pred: Prediction, job, world: int, plans: dict[int, Plan] | None = None) -> dict:
    """The prediction in the shape of a measured result (one iteration), for the tables.
    `plans`: any already built (rank -> plan), for the bytes each rank sends."""
    built = plans or {}
    reps = sorted(pred.breakdown)
    labels = {r: job.label(r) for r in reps}
    cats = report.ordered({c for b in pred.breakdown.values() for c in b}, job.report_categories())
    rep_of = pred.rep_of if pred.rep_of is not None else np.arange(world)
    per_rank = {c: [pred.breakdown[int(rep_of[r])].get(c, 0.0) for r in range(world)] for c in cats}
    plans_bytes = {r: (built.get(r) or job.plan(r)).bytes_by_category() for r in reps}
    byte_cats = sorted({c for b in plans_bytes.values() for c in b})
    return {
        "iter_time_s": [pred.time],
        "breakdown_s": {c: [statistics.fmean(v)] for c, v in per_rank.items()},
        "breakdown_per_rank_s": per_rank,
        "bytes": {
            c: [plans_bytes[int(rep_of[r])].get(c, 0) for r in range(world)] for c in byte_cats
        },
        "rank_labels": [labels[int(rep_of[r])] for r in range(world)],
    }


def dry_run_report(job, args, machine, console, plans: dict[int, Plan] | None = None):
    """--dry-run --machine: predict, print the note and the predicted tables; the JSON
    fields, or None (after saying why) when the plans cannot be predicted. `plans`: any
    already built (rank -> plan)."""
    from rich.markup import escape

    tracing = getattr(args, "trace", None) is not None  # --trace: the predicted timeline
    try:
        pred, note = run_prediction(job, args, machine, plans=plans, keep_spans=tracing)
    except PlanError as e:
        console.print(f"[bold red]cannot predict[/]: {escape(str(e))}")
        return None
    result = as_result(pred, job, job.grid.size, plans)
    console.print(note)
    report.print_report(result, [], predicted=True, table=job.report_categories())
    if tracing:
        from proxies.core import trace_predicted

        trace_predicted.write(job, args, pred, note)  # a failed write says where it went
    return json_fields(pred, result, note)


def json_fields(pred: Prediction, result: dict, note: str) -> dict:
    return {
        "predicted_iter_time_s": pred.time,
        "predicted_breakdown_s": {c: v[0] for c, v in result["breakdown_s"].items()},
        "predicted_breakdown_max_s": {c: max(v) for c, v in result["breakdown_per_rank_s"].items()},
        "prediction": note,
    }


def print_comparison(
    measured: dict, predicted: dict, console, table: report.Categories = report.CORE
) -> None:
    """Measured beside predicted per category (means over ranks), with the relative error;
    `table` names the categories (the job's)."""
    from rich.table import Table

    t = Table(title="measured vs predicted, per iteration", title_justify="left")
    for col in ("category", "measured", "predicted", "error"):
        t.add_column(col, justify="left" if col == "category" else "right")

    m_iter = statistics.fmean(measured["iter_time_s"])

    def row(name: str, m: float | None, p: float | None) -> None:
        # errors of categories under 1% of the iteration say nothing
        big = m is not None and m >= 0.01 * m_iter
        err = f"{100 * (p - m) / m:+.1f}%" if big and p is not None else "-"
        t.add_row(
            name,
            f"{m:.4f} s" if m is not None else "-",
            f"{p:.4f} s" if p is not None else "-",
            err,
        )

    row("iteration", m_iter, predicted["iter_time_s"][0])
    cats = report.ordered(set(measured["breakdown_s"]) | set(predicted["breakdown_s"]), table)
    for c in cats:
        mv = measured["breakdown_s"].get(c)
        pv = predicted["breakdown_s"].get(c)
        row(
            report.label(c, table),
            statistics.fmean(mv) if mv else None,
            pv[0] if pv else None,
        )
    console.print(t)


def collective_seconds(
    machine,
    kind: str,
    alg: str,
    n: int | Sequence[Sequence[int]],
    count: int,
    dtype: str = "float32",
    ranks_per_node: int | None = None,
    detail: str = "auto",
    library: bool = False,
) -> float:
    """Predicted seconds of one collective over ranks 0..n-1 (the collectives benchmark's
    "is my number normal?"): `alg` as --allreduce names it ("mpi": what the machine file
    says the library runs). library: `alg` is run by the MPI library (its temporaries may
    be fresh memory), as "mpi" always is. n may also be a list of groups (tuples of world
    ranks) that each run it at once: the time until the last finishes."""
    groups = [tuple(range(n))] if isinstance(n, int) else [tuple(g) for g in n]
    op = lambda g: Collective(kind, f"g{g[0]}", "x", count, dtype)  # noqa: E731
    plans = [Plan(r, (op(g),), {f"g{g[0]}": g}) for g in groups for r in g]
    topo = Topology(machine, ranks_per_node)
    pick = chooser(machine, alg)
    if library:
        pick.library = lambda kind: True  # type: ignore[attr-defined]
    pred = predict(plans, topo, lambda r, o: 0.0, pick, detail=detail)
    return pred.time


def validation_plans(plans: Sequence[Plan]) -> tuple[list[Plan], set[str]]:
    """Plans for the free-communication validation of a folded world, given the
    representatives' plans: without the collectives of groups reaching outside them (their
    members run the same plan op for op, so they can neither deadlock nor mismatch); and
    the names of the groups left out."""
    inside = {p.rank for p in plans}
    out, cut = [], set()
    for p in plans:
        keep = {n for n, members in p.groups.items() if inside.issuperset(members)}
        cut |= set(p.groups) - keep
        group_of = {o.req: o.group for o in p.ops if isinstance(o, Collective) and o.req}
        ops = tuple(
            o
            for o in p.ops
            if not (isinstance(o, Collective) and o.group not in keep)
            # a P2P batch's Wait (no group) stays with its batch
            and not (isinstance(o, Wait) and o.req in group_of and group_of[o.req] not in keep)
        )
        out.append(Plan(p.rank, ops, {n: p.groups[n] for n in keep}, p.coords))
    return out, cut


__all__ = [
    "PlanError",
    "as_result",
    "compute_cost",
    "json_fields",
    "print_comparison",
    "run_prediction",
    "validation_plans",
]
