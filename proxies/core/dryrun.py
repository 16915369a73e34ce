"""The dry run every proxy shares: one iteration's plan per rank for any world size, from one
process and without MPI: validated (core/simulate.py), tabulated, and with `--machine`
predicted (core/prediction.py)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from proxies.core import cli, exits, faults, memory, provenance, report, traffic
from proxies.core.plan import P2P, Collective, Compute

if TYPE_CHECKING:
    from proxies.core.runner import Job


def dry_run(job: Job, args, machine=None) -> int:
    from rich.markup import escape

    from proxies.core import prediction
    from proxies.core.simulate import PlanError, simulate

    faults.attach(job, args)  # checked against the job; in the header and config
    console = report.console()
    for line in job.header:  # now: planning a large world takes a while
        console.print(line)
    sys.stdout.flush()
    world = job.grid.size
    first = job.plan(0)
    dims = prediction.fold_dims(job, world, len(first.ops))
    rep_of = prediction.representatives(job.grid, dims) if dims else None
    reps = sorted(set(rep_of.tolist())) if dims else list(range(world))
    plans = {r: first if r == 0 else job.plan(r) for r in reps}

    print_plan_table(console, job, plans, rep_of if dims else None, dims)
    if job.dry_run_lines is not None:
        job.dry_run_lines(console, plans)
    estimates = memory.by_label(job, reps) if job.memory else {}
    for line in memory.dry_run_lines(estimates, args.compute):
        console.print(line)
    by_coord = traffic.by_coordinate(job, plans, job.traffic_by[0]) if job.traffic_by else {}
    if by_coord:
        traffic.print_table(console, job, plans, by_coord)
    shown = args.show_ranks is not None or job.ops_by_default
    for r in show_ranks(args.show_ranks, job, world, reps) if shown else []:
        print_ops(console, job, r, (plans[r] if r in plans else job.plan(r)).ops)

    rate = args.device_tflops * 1e12
    reps_plans = list(plans.values())
    checked, cut = prediction.validation_plans(reps_plans) if dims else (reps_plans, set())
    try:
        sim = simulate(
            checked,
            cost=lambda rank, op: op.model_seconds(rate) if isinstance(op, Compute) else 0.0,
        )
    except PlanError as e:
        console.print(f"[bold red]plan is invalid[/]: {escape(str(e))}")
        return 1
    nmsg = sum(1 for p in checked for _, _, d in p.messages() if d == "send")
    ncoll = sum(1 for p in checked for op in p.ops if isinstance(op, Collective))
    computes = ([op for op in p.ops if isinstance(op, Compute)] for p in checked)
    busy = max(sum(op.model_seconds(rate) for op in ops) for ops in computes)
    which = report.plural(world, "rank")
    if dims:
        # the folded dimensions' members run identical plans: one of each is simulated
        which = f"{len(reps)} representatives of {which} ({' = '.join(dims)} = 0)"
        if cut:
            which += f", without the {'/'.join(sorted(cut))} collectives"
    console.print(
        f"plan valid: {which}, {nmsg:,} messages matched, {ncoll:,} collective calls "
        f"matched, no deadlock. Iteration with "
        f"compute=model (known per-op times where the proxy has them, else FLOPs at "
        f"{args.device_tflops:g} TFLOP/s) and free communication: {sim.time:.4g} s (the "
        f"busiest rank computes {busy:.4g} s of it)"
        + ("" if machine else "; --machine FILE predicts communication too")
    )
    out = {
        "proxy": job.proxy,
        "dry_run": True,
        "config": job.config,
        "world_size": world,
        "grid": job.grid.describe(),
        "simulated_ranks": len(checked),
        "free_comm_iter_time_s": sim.time,
    }
    if estimates:
        out["memory_bytes"] = estimates  # per stage (label): {part: bytes}
    out |= traffic.json_fields(by_coord) if by_coord else {}
    out |= job.dry_run_json(plans) if job.dry_run_json is not None else {}
    out |= provenance.fields()  # schema_version, version, commit, hosts, launcher
    rep = rep_of if dims else range(world)
    by_rep = {r: p.bytes_by_category() for r, p in plans.items()}
    out["bytes"] = {
        c: [by_rep[int(rep[r])].get(c, 0) for r in range(world)]
        for c in sorted({c for b in by_rep.values() for c in b})
    }
    if machine is not None:
        fields = prediction.dry_run_report(job, args, machine, console, plans)
        if fields is None:
            return 1
        out |= fields
    if args.chakra is not None:  # every rank's trace, from its own plan (core/chakra.py)
        from proxies.core import chakra

        out["chakra"] = chakra.export(job, args.chakra, rate)
        console.print(chakra.summary_line(out["chakra"]))
    if args.json and report.write_json(args.json, out, prog=job.prog) is None:
        return exits.FAILED
    return 0


def print_plan_table(console, job: Job, plans: dict, rep_of, dims) -> None:
    """The plan of one iteration per rank, ranks whose rows are identical apart from their
    rank and coordinates grouped into one row (at 512 ranks: a row per distinct plan, not
    512). `rep_of`: world rank -> the representative whose plan it runs (None: every
    rank is in `plans`)."""
    from proxies.core.tables import Column, rank_ranges, show

    world = job.grid.size
    values = {}
    for p in plans.values():
        b = p.bytes_by_category()
        colls = [op for op in p.ops if isinstance(op, Collective)]
        values[p.rank] = (
            job.label(p.rank),
            str(len(p.ops)),
            str(sum(1 for _ in p.messages())),
            f"{sum(v for k, v in b.items() if k.endswith('_send')):,}",
            f"{sum(v for k, v in b.items() if k.endswith('_recv')):,}",
            str(len(colls)),
            f"{sum(op.nbytes for op in colls):,}",
        )
    groups: dict[tuple, list[int]] = {}
    for r in range(world):
        groups.setdefault(values[int(rep_of[r]) if rep_of is not None else r], []).append(r)
    single = all(len(g) == 1 for g in groups.values())
    title = "plan of one iteration, per rank"
    if not single:
        title += " (ranks with identical plans apart from their coordinates share a row)"
    if dims:
        title += f"; ranks differing only in {'/'.join(dims)} run the same plan"
    cols = [Column("ranks", number=False, key=True), Column("count")]
    cols += [Column("coords", number=False)] if single else []
    cols += [Column("stage", number=False), Column("ops"), Column("p2p msgs")]
    cols += [Column("p2p bytes sent"), Column("p2p bytes recv"), Column("collectives")]
    cols += [Column("collective bytes")]
    rows = []
    for vals, ranks in sorted(groups.items(), key=lambda kv: kv[1][0]):
        coords = plans[ranks[0]].coords if single else {}
        where = [" ".join(f"{k}{v}" for k, v in coords.items())] if single else []
        rows.append([rank_ranges(ranks), str(len(ranks)), *where, *vals])
    show(console, title, cols, rows)


def print_ops(console, job: Job, rank: int, ops) -> None:
    """One rank's ops in order: messages and collectives with their sizes, computes with
    their FLOPs (a column of their own)."""
    from proxies.core.tables import Column, show

    cols = [Column("#", key=True), Column("op", number=False), Column("group", number=False)]
    cols += [Column("peer"), Column("buffer", number=False), Column("elements")]
    cols += [Column("bytes"), Column("flop")]
    rows = [[str(i), *row] for i, op in enumerate(ops) for row in op_rows(op)]
    show(console, f"rank {rank} ({job.label(rank)}): ops in order", cols, rows)


def op_rows(op) -> list[tuple[str, ...]]:
    """Rows of the op listing: op, group, peer, buffer, elements, bytes, flop."""
    if isinstance(op, Compute):
        name = f"{op.name}" + (f" mb {op.mb}" if op.mb >= 0 else "")
        return [(name, "", "", "", "", "", f"{op.flops:.3g}" if op.flops else "")]
    if isinstance(op, P2P):
        rows = []
        posted = f" (start {op.req})" if op.req else ""  # non-blocking: its Wait completes it
        for d, msgs in (("send", op.sends), ("recv", op.recvs)):
            for m in msgs:
                rows.append(
                    (
                        f"{op.name}: {d}{posted}",
                        op.category,
                        str(m.peer),
                        f"{m.buf} mb {m.mb}",
                        f"{m.count:,}",
                        f"{m.nbytes:,}",
                        "",
                    )
                )
        return rows
    if isinstance(op, Collective):
        return [(op.kind, op.group, "", str(op.buf), f"{op.count:,}", f"{op.nbytes:,}", "")]
    from proxies.core.engine import describe

    return [(describe(op), "", "", "", "", "", "")]


def show_ranks(spec: str | None, job: Job, world: int, reps=None) -> list[int]:
    if spec == "all" or (spec is None and world <= 16):
        return list(range(world))
    if spec is None:
        seen, ranks = set(), []
        for r in reps if reps is not None else range(world):
            if job.label(r) not in seen:
                seen.add(job.label(r))
                ranks.append(r)
        return ranks
    try:
        ranks = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise cli.UsageError(f"--show-ranks {spec!r}: expected 'all' or ranks like 0,3,7") from None
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        raise cli.UsageError(f"--show-ranks: rank {bad[0]} is outside 0..{world - 1}")
    return ranks


# -- real run ------------------------------------------------------------------------------
