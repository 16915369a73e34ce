"""What one iteration of a plan sends, per grid dimension: the dry run's traffic table.

Model-agnostic: P2P traffic is filed under the dimension its category starts with
("pp_send" -> pp), collectives under their group. A job asks for the table with
`Job.traffic_by` (core/runner.py): one row group per coordinate of that dimension, adjacent
coordinates with identical traffic merged.
"""

from __future__ import annotations

from collections import defaultdict

from proxies.core import report
from proxies.core.plan import P2P, Collective, Plan
from proxies.core.tables import Column, show

Traffic = dict[tuple[str, str], list[int]]  # (dimension, what) -> [operations, elements, bytes]


def dimension_of(category: str) -> str:
    return category.split("_")[0]


def plan_traffic(plan: Plan) -> Traffic:
    """Per (dimension, what): [operations, elements, bytes] for one iteration of one rank."""
    out: Traffic = defaultdict(lambda: [0, 0, 0])
    for op in plan.ops:
        if isinstance(op, P2P):
            for way, msgs in (("send", op.sends), ("recv", op.recvs)):
                for msg in msgs:
                    row = out[(dimension_of(op.category), way)]
                    row[0] += 1
                    row[1] += msg.count
                    row[2] += msg.nbytes
        elif isinstance(op, Collective):
            row = out[(op.group, op.kind)]
            row[0] += 1
            row[1] += op.count
            row[2] += op.nbytes
    return dict(out)


def by_coordinate(job, plans: dict[int, Plan], dim: str) -> dict[int, Traffic]:
    """Traffic of the rank at each coordinate of `dim` (the others 0), from `plans` (rank ->
    plan) where it is there, else built."""
    grid = job.grid
    out = {}
    for c in range(grid.degree(dim)):
        r = grid.rank_of(**{dim: c})
        out[c] = plan_traffic(plans[r] if r in plans else job.plan(r))
    return out


def print_table(console, job, plans: dict[int, Plan], traffic: dict[int, Traffic]) -> None:
    """The per-dimension traffic table: `traffic` from by_coordinate(job, plans, dim)."""
    dim, title = job.traffic_by
    grid = job.grid
    cols = [Column(title, number=False, key=True), Column("ranks each")]
    cols += [Column("dimension", number=False), Column("group"), Column("op", number=False)]
    cols += [Column("count"), Column("elements"), Column("bytes"), Column("size", number=False)]
    sizes: dict[str, int] = {}
    for p in plans.values():
        sizes |= {n: len(m) for n, m in p.groups.items()}
    runs: list[list[int]] = []
    for c in sorted(traffic):
        if runs and traffic[runs[-1][-1]] == traffic[c]:
            runs[-1].append(c)
        else:
            runs.append([c])
    each = grid.size // grid.degree(dim)
    table: list[list[str] | None] = []
    for run in runs:
        name = str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"
        for i, ((d, what), (n, elems, nbytes)) in enumerate(sorted(traffic[run[0]].items())):
            size = sizes.get(d, grid.degree(d))  # P2P: a grid dimension, not a group
            table.append(
                [
                    name if i == 0 else "",
                    str(each) if i == 0 else "",
                    d,
                    str(size),
                    what,
                    f"{n:,}",
                    f"{elems:,}",
                    f"{nbytes:,}",
                    report.human_bytes(nbytes),
                ]
            )
        table.append(None)  # a rule between row groups
    show(console, "traffic per rank per iteration, by dimension", cols, table[:-1])


def json_fields(traffic: dict[int, Traffic]) -> dict:
    return {
        "traffic": {
            str(c): {f"{d}/{w}": v for (d, w), v in t.items()} for c, t in sorted(traffic.items())
        }
    }
