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

Where ranks outnumber cores, calibrate fits twice: the figures above to allreduces on as
many ranks per node as cores (the rest parked in a sleeping wait), then the `oversubscribed`
figures (latency, bandwidth, node bandwidth) to allreduces on every rank with the runs'
yielding waits, MPI's own included (priced through the `mpi:` table, fresh temporaries and
all): `fit_oversubscribed`.
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


def _unbind(m: Machine, flow: str, node: str) -> Machine:
    """A flow's bandwidth above its node's is not seen by any prediction (the node's bus
    caps every flow, and every rank's port, at least as tightly), so the search may leave
    it anywhere above (156 GB/s once): cap it at the node's, which prices the same."""
    if _get(m, node) and _get(m, flow) > _get(m, node):
        return _set(m, flow, _get(m, node))
    return m


PAIRS = "@pairs"  # a measured key "ALG@pairs": ranks (0,1), (2,3) ... each ran ALG at once


def pairs(n: int) -> list[tuple[int, int]]:
    return [(q, q + 1) for q in range(0, n - 1, 2)]


def predictions(
    m: Machine, measured: dict, n: int, rpn: int, with_mpi: bool = False
) -> dict[str, list[float]]:
    """Predicted seconds of every measured (alg, size); float32 buffers. MPI's own ("mpi")
    only with_mpi (it is priced through the machine's `mpi:` table). "ALG@pairs": ALG run
    by every pair of ranks at once."""
    out = {}
    for key, points in measured.items():
        alg = key.removesuffix(PAIRS)
        if alg == "mpi" and not with_mpi:
            continue
        who = pairs(n) if key.endswith(PAIRS) else n
        out[key] = [
            collective_seconds(m, "allreduce", alg, who, max(size // 4, 1), "float32", rpn)
            for size, _ in points
        ]
    return out


def _cost(m: Machine, measured: dict, n: int, rpn: int, with_mpi: bool = False) -> float:
    pred = predictions(m, measured, n, rpn, with_mpi)
    errs = [
        math.log(p / t) ** 2
        for alg, points in measured.items()
        if alg in pred
        for (_, t), p in zip(points, pred[alg], strict=True)
        if t > 0 and p > 0
    ]
    return sum(errs) / max(len(errs), 1)


def _search(m: Machine, params, measured, n, rpn, with_mpi=False) -> tuple[Machine, float, float]:
    """Coordinate search in log space over `params`: (machine, cost before, cost after)."""
    best = _cost(m, measured, n, rpn, with_mpi)
    start = best
    for factor in FACTORS:
        improved = True
        while improved:
            improved = False
            for p in params:
                for f in (factor, 1 / factor):
                    trial = _set(m, p, _get(m, p) * f)
                    c = _cost(trial, measured, n, rpn, with_mpi)
                    if c < best * (1 - 1e-9):
                        m, best, improved = trial, c, True
                        break
    return m, start, best


def _residuals(m: Machine, measured: dict, n: int, rpn: int, with_mpi: bool = False) -> dict:
    pred = predictions(m, measured, n, rpn, with_mpi)
    return {
        alg: [[size, t, p, (p - t) / t] for (size, t), p in zip(points, pred[alg], strict=True)]
        for alg, points in measured.items()
        if alg in pred
    }


def fit(m: Machine, measured: dict, n: int, rpn: int) -> tuple[Machine, dict]:
    """The machine with its network figures fitted to `measured` ({alg: [(bytes,
    seconds)]}), and a record: the figures before and after, the cost, every residual."""
    before = {p: _get(m, p) for p in _params(m)}
    m, start, best = _search(m, _params(m), measured, n, rpn)
    m = _unbind(m, "intra.bandwidth", "node_bandwidth")
    residuals = _residuals(m, measured, n, rpn)
    table = mpi_table(m, measured.get("mpi", []), n, rpn)
    m = replace(m, mpi={"allreduce": table} if table else {})  # none measured: MPICH's
    record = {
        "from_pingpong": before,
        "fitted": {p: _get(m, p) for p in _params(m)},
        "rms_log_error_before": math.sqrt(start),
        "rms_log_error_after": math.sqrt(best),
        "residuals": residuals,
    }
    return m, record


OVERSUB_PARAMS = ("oversub.latency", "oversub.bandwidth", "oversub_node_bandwidth", "oversub_wake")


def fit_oversubscribed(m: Machine, measured: dict, n: int, rpn: int) -> tuple[Machine, dict]:
    """The machine with its `oversubscribed` figures fitted to `measured`, allreduces on
    every rank of nodes holding more ranks than cores (rpn > m.cores_per_node): latency,
    bandwidth, node bandwidth and wake to our algorithms (point-to-point programs, as the
    proxies' messages are), starting from m.oversub, m.oversub_node_bandwidth and
    m.oversub_wake; then mpi_latency to MPI's own ("mpi", over all ranks, and "mpi@pairs",
    every pair at once), starting from the fitted latency: MPI's non-blocking schedule
    advances only inside the yielding waits' tests, which makes each of its steps cost
    what no point-to-point message does. Same record as fit's."""
    params = [p for p in OVERSUB_PARAMS if _get(m, p)]
    before = {p: _get(m, p) for p in params}
    ours = {k: v for k, v in measured.items() if k.removesuffix(PAIRS) != "mpi"}
    theirs = {k: v for k, v in measured.items() if k.removesuffix(PAIRS) == "mpi"}
    m, _, _ = _search(m, params, ours or measured, n, rpn, with_mpi=not ours)
    m = _unbind(m, "oversub.bandwidth", "oversub_node_bandwidth")
    fitted = {p: _get(m, p) for p in params}
    if theirs:
        m = replace(m, oversub_mpi_latency=m.oversub.latency)
        before["oversub_mpi_latency"] = m.oversub_mpi_latency
        m, _, _ = _search(m, ["oversub_mpi_latency"], theirs, n, rpn, with_mpi=True)
        fitted["oversub_mpi_latency"] = m.oversub_mpi_latency
    return m, {
        "start": before,
        "fitted": fitted,
        "rms_log_error_before": math.sqrt(_cost_at(before, m, measured, n, rpn)),
        "rms_log_error_after": math.sqrt(_cost(m, measured, n, rpn, with_mpi=True)),
        "residuals": _residuals(m, measured, n, rpn, with_mpi=True),
    }


def _cost_at(figures: dict, m: Machine, measured: dict, n: int, rpn: int) -> float:
    """The cost over every measurement with `figures` put back (the fit's starting point)."""
    for p, v in figures.items():
        m = _set(m, p, v)
    return _cost(m, measured, n, rpn, with_mpi=True)


# The allreduce algorithms MPICH has (recursive doubling, Rabenseifner's reduce-scatter +
# allgather, ring, k-nomial tree): MPI's own is matched among these only; naive, dbtree
# (NCCL's) and hier are ours.
MPICH_ALLREDUCE = ("rd", "rhd", "ring", "tree")


def mpi_table(m: Machine, points, n: int, rpn: int) -> list[tuple[int, str]]:
    """For each measured size of MPI's allreduce, the algorithm whose fitted prediction is
    closest; a size between two measured ones takes the answer of the nearer (on a log
    scale: up to their geometric mean), consecutive answers merged, the last open-ended.
    (Extending each answer down to the size below let a 2 MiB allreduce take 16 MiB's
    answer over 1 MiB's: tree instead of ring on 2 ranks, 2x the time, when the two were
    a near tie at 16 MiB.)"""
    from proxies.core.collectives import steps

    algs = [a for a in steps.algorithms("allreduce") if a in MPICH_ALLREDUCE]
    chosen: list[tuple[int, str]] = []
    for size, t in sorted(points):
        if t <= 0:
            continue
        count = max(size // 4, 1)
        alg = min(
            algs,
            key=lambda a: abs(
                math.log(
                    collective_seconds(m, "allreduce", a, n, count, "float32", rpn, library=True)
                    / t
                )
            ),
        )
        chosen.append((size, alg))
    table: list[tuple[int, str]] = []
    for i, (size, alg) in enumerate(chosen):
        upto = math.isqrt(size * chosen[i + 1][0]) if i + 1 < len(chosen) else ANY
        if table and table[-1][1] == alg:
            table[-1] = (upto, alg)
        else:
            table.append((upto, alg))
    return table
