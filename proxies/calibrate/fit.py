"""Fit the machine's network figures to measured collectives and messages, through the
predictor.

Ping-pong gives a pair's latency and bandwidth with every other rank idle. The proxies'
runs do not look like that: every rank communicates at once, and where ranks outnumber
cores each message also waits for its receiver to be scheduled. The allreduce algorithms
measured on the whole allocation do look like the runs, and the predictor prices exactly
their steps; so the figures that the predictor reads (latency and bandwidth per level,
the node's and the interface's shared bandwidth) are fitted to make its predictions of
those measurements right: least squares on log(predicted / measured), by coordinate
search in log space from the ping-pong figures. The allreduces alone would set the
figures for data a collective keeps warm in the caches between its steps; the proxies'
pipeline and halo messages and their all-to-alls move cold data, each block once. So the
fit also answers to the node exchange (every pair of a node's ranks exchanging 1, 4 and
16 MiB at once) and to MPI's all-to-all, and each of these kinds of evidence (_family)
weighs as much as all the allreduce algorithms together. (Fitted to allreduces alone, the
figures priced a 16 MiB exchange at half its measured time; measured from one calibration,
refitted both ways: 6-7 of 16 benchmark points within 25%, against 12.) The residual of
every point is kept in the file. Then each measured size of MPI's own allreduce is
matched to the algorithm the fitted model predicts closest: the `mpi:` table.

Where ranks outnumber cores, calibrate fits twice: the figures above to measurements on as
many ranks per node as cores (the rest parked in a sleeping wait), then the `oversubscribed`
figures (latency, bandwidth, node bandwidth, wake) to our allreduces and the exchange on
every rank with the runs' yielding waits, and mpi_latency to MPI's own allreduce and
all-to-all (priced through the `mpi:` table, fresh temporaries and all):
`fit_oversubscribed`.
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
# a measured key "alltoall:mpi": MPI's own all-to-all (the proxies' embedding and
# expert exchanges), priced as the library runs it (the `mpi:` table or MPICH's default)
ALLTOALL = "alltoall:"
# a measured key "exchange": the pairs (0,1), (2,3) ... of the first node's ranks each
# exchanging SIZE bytes both ways at once (Sendrecv, cold buffers; 1, 4 and 16 MiB): plain
# messages, as the proxies' pipeline and halo traffic is. Every other key is an allreduce
# algorithm.
EXCHANGE = "exchange"


def exchange_target(record: dict) -> dict:
    """calibrate's node-exchange record ({flows, bytes_each, seconds[, points]}) as a fit
    target: every measured size (points; without them the one size), or none where no
    pair took part."""
    if not record["flows"]:
        return {}
    points = record.get("points") or [(record["bytes_each"], record["seconds"])]
    return {EXCHANGE: [(int(size), float(t)) for size, t in points]}


def _family(key: str) -> str:
    """The kind of evidence a measured key is: each weighs alike in the fit, however many
    points it has (7 allreduce algorithms at 5 sizes would drown one exchange)."""
    if key == EXCHANGE:
        return EXCHANGE
    kind, alg = _kind_alg(key)
    return f"{kind} {'mpi' if alg == 'mpi' else 'ours'}"


def exchange_seconds(m: Machine, nbytes: int, ranks: int, rpn: int) -> float:
    """Predicted seconds of `ranks` (even) ranks of node 0 exchanging nbytes both ways in
    pairs (0,1), (2,3) ... at once."""
    from proxies.core.network import Topology
    from proxies.core.plan import P2P, Msg, Plan
    from proxies.core.predict import predict

    count = max(nbytes // 4, 1)

    def plan(r: int) -> Plan:
        msg = Msg(r ^ 1, 0, "x", 0, count)
        return Plan(r, (P2P("sendrecv", (msg,), (msg,)),), {})

    plans = [plan(r) for r in range(ranks - ranks % 2)]
    return predict(plans, Topology(m, rpn), lambda r, o: 0.0, lambda k, b: "ring").time


def _kind_alg(key: str) -> tuple[str, str]:
    """(collective kind, algorithm) of a measured key."""
    key = key.removesuffix(PAIRS)
    return ("alltoall", key.removeprefix(ALLTOALL)) if key.startswith(ALLTOALL) else (
        "allreduce", key)  # fmt: skip


def _library(key: str) -> bool:
    """Whether a measured key is a collective MPI runs itself (its own, or MPI's alltoall)."""
    return _kind_alg(key)[1] == "mpi"


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
        if key == EXCHANGE:
            out[key] = [exchange_seconds(m, size, rpn, rpn) for size, _ in points]
            continue
        kind, alg = _kind_alg(key)
        if kind == "allreduce" and alg == "mpi" and not with_mpi:
            continue
        who = pairs(n) if key.endswith(PAIRS) else n
        members = n if isinstance(who, int) else 2
        out[key] = [
            collective_seconds(m, kind, alg, who, _count(kind, b, members), "float32", rpn)
            for b, _ in points
        ]
    return out


def _count(kind: str, nbytes: int, members: int) -> int:
    """float32 elements of a measured size: an all-to-all's, whole blocks per member."""
    count = max(nbytes // 4, 1)
    return max(count // members, 1) * members if kind == "alltoall" else count


def _cost(m: Machine, measured: dict, n: int, rpn: int, with_mpi: bool = False) -> float:
    """The mean over families (_family) of the mean squared log(predicted / measured)."""
    pred = predictions(m, measured, n, rpn, with_mpi)
    errs: dict[str, list[float]] = {}
    for key, points in measured.items():
        if key not in pred:
            continue
        for (_, t), p in zip(points, pred[key], strict=True):
            if t > 0 and p > 0:
                errs.setdefault(_family(key), []).append(math.log(p / t) ** 2)
    return sum(sum(e) / len(e) for e in errs.values()) / max(len(errs), 1)


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
    params = _params(m)
    before = {p: _get(m, p) for p in params}
    m, start, best = _search(m, params, measured, n, rpn)
    m = _unbind(m, "intra.bandwidth", "node_bandwidth")
    residuals = _residuals(m, measured, n, rpn)
    table = mpi_table(m, measured.get("mpi", []), n, rpn)
    m = replace(m, mpi={"allreduce": table} if table else {})  # none measured: MPICH's
    record = {
        "from_pingpong": before,
        "fitted": {p: _get(m, p) for p in params if _get(m, p) is not None},
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
    m.oversub_wake; then mpi_latency to MPI's own over all ranks (allreduce and all-to-all;
    "mpi@pairs", every pair at once, only reported), starting from the fitted latency:
    MPI's non-blocking schedule advances only inside the yielding waits' tests, which makes
    each of its steps cost what no point-to-point message does. Same record as fit's."""
    params = [p for p in OVERSUB_PARAMS if _get(m, p)]
    before = {p: _get(m, p) for p in params}
    ours = {k: v for k, v in measured.items() if not _library(k)}
    # MPI's allreduce in every pair at once, each call after one barrier, is the slow case:
    # 4 ranks woken together on 2 cores took 10 ms per 1 MiB pair allreduce, where the
    # proxies' pairs, out of step with the other groups, take 3.5 ms per 2 MiB (gpt3 tp 2
    # x pp 2); fitted to it too, mpi_latency priced those at twice their time. Its
    # residuals are still reported.
    theirs = {k: v for k, v in measured.items() if _library(k) and not k.endswith(PAIRS)}
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
