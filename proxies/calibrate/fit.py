"""Fit the machine's network figures to the measured allreduces, through the predictor.

Ping-pong gives a pair's latency and bandwidth with every other rank idle. The proxies'
runs do not look like that: every rank communicates at once, and where ranks outnumber
cores each message also waits for its receiver to be scheduled. The allreduce algorithms
measured on the whole allocation do look like the runs, and the predictor prices exactly
their steps; so the figures that the predictor reads (latency and bandwidth per level,
the node's and the interface's shared bandwidth) are fitted to make its predictions of
those measurements right: least squares on log(predicted / measured) over every
algorithm and size, by coordinate search in log space from the ping-pong figures. The
residual of every point is kept in the file. Then each measured size of MPI's own
allreduce is matched to the algorithm the fitted model predicts closest: the `mpi:` table.
"""

from __future__ import annotations

import math
from dataclasses import replace

from proxies.core.machine import ANY, Level, Machine
from proxies.core.prediction import collective_seconds

FACTORS = (4.0, 2.0, 1.41, 1.19, 1.09, 1.04)  # coordinate-search steps, coarse to fine


def _params(m: Machine) -> list[str]:
    names = ["intra.latency", "intra.bandwidth"]
    if m.node_bandwidth:
        names.append("node_bandwidth")
    if m.inter is not None:
        names += ["inter.latency", "inter.bandwidth"]
        if m.nic_bandwidth:
            names.append("nic_bandwidth")
    return names


def _get(m: Machine, name: str) -> float:
    if "." in name:
        level, field = name.split(".")
        return getattr(getattr(m, level), field)
    return getattr(m, name)


def _set(m: Machine, name: str, value: float) -> Machine:
    if "." in name:
        level, field = name.split(".")
        old = getattr(m, level)
        new = Level(**{**old.__dict__, field: value})
        return replace(m, **{level: new})
    return replace(m, **{name: value})


def predictions(m: Machine, measured: dict, n: int, rpn: int) -> dict[str, list[float]]:
    """Predicted seconds of every measured (alg, size); float32 buffers."""
    return {
        alg: [
            collective_seconds(m, "allreduce", alg, n, max(size // 4, 1), "float32", rpn)
            for size, _ in points
        ]
        for alg, points in measured.items()
        if alg != "mpi"
    }


def _cost(m: Machine, measured: dict, n: int, rpn: int) -> float:
    pred = predictions(m, measured, n, rpn)
    errs = [
        math.log(p / t) ** 2
        for alg, points in measured.items()
        if alg != "mpi"
        for (_, t), p in zip(points, pred[alg], strict=True)
        if t > 0 and p > 0
    ]
    return sum(errs) / max(len(errs), 1)


def fit(m: Machine, measured: dict, n: int, rpn: int) -> tuple[Machine, dict]:
    """The machine with its network figures fitted to `measured` ({alg: [(bytes,
    seconds)]}), and a record: the figures before and after, the cost, every residual."""
    before = {p: _get(m, p) for p in _params(m)}
    best = _cost(m, measured, n, rpn)
    start = best
    for factor in FACTORS:
        improved = True
        while improved:
            improved = False
            for p in _params(m):
                for f in (factor, 1 / factor):
                    trial = _set(m, p, _get(m, p) * f)
                    c = _cost(trial, measured, n, rpn)
                    if c < best * (1 - 1e-9):
                        m, best, improved = trial, c, True
                        break
    pred = predictions(m, measured, n, rpn)
    residuals = {
        alg: [[size, t, p, (p - t) / t] for (size, t), p in zip(points, pred[alg], strict=True)]
        for alg, points in measured.items()
        if alg != "mpi"
    }
    m = replace(m, mpi={"allreduce": mpi_table(m, measured.get("mpi", []), n, rpn)})
    record = {
        "from_pingpong": before,
        "fitted": {p: _get(m, p) for p in _params(m)},
        "rms_log_error_before": math.sqrt(start),
        "rms_log_error_after": math.sqrt(best),
        "residuals": residuals,
    }
    return m, record


def mpi_table(m: Machine, points, n: int, rpn: int) -> list[tuple[int, str]]:
    """For each measured size of MPI's allreduce, the algorithm whose fitted prediction is
    closest; consecutive sizes with the same answer merged, the last open-ended."""
    from proxies.core.collectives import steps

    algs = [a for a in steps.algorithms("allreduce") if a != "hier"]
    table: list[tuple[int, str]] = []
    for size, t in points:
        if t <= 0:
            continue
        count = max(size // 4, 1)
        alg = min(
            algs,
            key=lambda a: abs(
                math.log(collective_seconds(m, "allreduce", a, n, count, "float32", rpn) / t)
            ),
        )
        if table and table[-1][1] == alg:
            table[-1] = (size, alg)
        else:
            table.append((size, alg))
    if table:
        table[-1] = (ANY, table[-1][1])
    return table
