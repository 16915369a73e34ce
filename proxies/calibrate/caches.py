"""The machine file's cache figures: `reuse` and `zero_pages` from what calibrate measured
(with_reuse, with_zero_pages), and `cold`, measured here: what a small op costs after its
rank moved bulk data (measure_cold, fit_cold, with_cold).

A proxy's ranks move megabytes in one op (a halo, a gradient bucket) and then run small
ops (a start, a Wait, a 1-element allreduce). The bulk data evicts the interpreter's,
mpi4py's and MPI's code and data from the caches, and the next op pays to bring them back:
on the 2-vCPU VM this was developed on, the engine's own time for a 64-byte exchange after
a copy of 32 MiB was 60 - 70 us instead of 5 - 6, and the MPI call itself 30 - 40 us
instead of 3 (benchmarks/engine_overhead.py --flush).

Measured through the real engine, as `engine_overhead` measures the warm figures: a plan of
cycles of two blocking exchanges with the neighbouring ranks (each rank sends to the next
and receives from the previous), the first moving B / 4 bytes each way (B read and
written, as plan_touched counts it) or 1 element, the second always 1 element. Per size B:
the engine's own seconds per cycle, bulk less small (`engine`), and the second exchange's
booked seconds (its category; a late partner's idle is left out), bulk less small
(`latency`), the slowest rank's median over iterations. Measured after a copy of B / 2
bytes instead of an exchange, the figures were alike (4 / 3, 20 / 13, 46 / 27 us at 4,
16, 64 MiB against 5 / 2, 13 / 5, 45 / 16 us after exchanges, one 2-rank run).

The fit: cost(B) = figure x (B / moved) ** exponent, `moved` the largest size measured and
held beyond it (the predictor takes min(1, B / moved)); the exponent by least squares on
log-log of the engine's points (the larger signal), the two figures by least squares at
that exponent.
"""

from __future__ import annotations

import math
import statistics

import numpy as np

from proxies.calibrate.measure import (
    TinyRuntime,
    cache_share,
    engine_iterations,
    neighbours,
    sig,
)
from proxies.core.machine import Machine

# B, bytes an exchange reads and writes on each rank (B / 4 sent, as much received)
SIZES = (4 << 20, 16 << 20, 64 << 20)
QUICK_SIZES = (4 << 20, 64 << 20)


class _BulkRuntime(TinyRuntime):
    """TinyRuntime's 1-element buffers ("r" received, "x" sent) and the bulk exchange's
    pair ("bs" sent, "br" received) of `count` float32 each."""

    def __init__(self, count: int) -> None:
        from proxies.core import pages

        super().__init__()
        self.bulk = {name: pages.zeros(count, np.float32) for name in ("bs", "br")}
        for buf in self.bulk.values():
            buf[...] = 1.0  # touched: the run's buffers are

    def buffer(self, name: str, mb: int, chunk: int) -> np.ndarray:
        return self.bulk[name] if name in self.bulk else super().buffer(name, mb, chunk)


def _cycles(comm, MPI, count: int, cycles: int, iters: int) -> tuple[float, float]:
    """(engine's own seconds per cycle, the small exchange's booked seconds per op), medians
    over `iters` iterations after one warm-up, per rank; the first exchange of each cycle
    moves `count` float32 each way (B = 16 x count bytes touched)."""
    from proxies.core.plan import P2P, Msg

    ahead, behind = neighbours(comm, MPI)
    small = P2P(
        "x", sends=(Msg(ahead, 7, "x", 0, 1),), recvs=(Msg(behind, 7, "r", 0, 1),), category="small"
    )
    bulk = P2P("b", sends=(Msg(ahead, 8, "bs", 0, count),), recvs=(Msg(behind, 8, "br", 0, count),))
    ops = (bulk, small) * cycles
    times = engine_iterations(comm, MPI, ops, _BulkRuntime(count), iters, "spin", "real")
    own = [(t.total - t.booked()) / cycles for t in times]
    booked = [t.seconds.get("small", 0.0) / cycles for t in times]
    return statistics.median(own), statistics.median(booked)


def measure_cold(comm, MPI, sizes=SIZES, cycles: int = 40, iters: int = 5) -> list[list[float]]:
    """[[B, engine seconds, latency seconds], ...]: what an op costs more after an exchange
    that touched B bytes than after a 1-element one, per size; the slowest rank's.
    Collective on `comm` (two ranks or more)."""
    points = []
    for nbytes in sizes:
        warm = _cycles(comm, MPI, 1, cycles, iters)
        cold = _cycles(comm, MPI, max(1, nbytes // 16), cycles, iters)
        extra = [comm.allreduce(c - w, op=MPI.MAX) for c, w in zip(cold, warm, strict=True)]
        points.append([int(nbytes), *extra])
    return points


def fit_cold(points: list[list[float]]) -> dict | None:
    """{moved, engine, latency, exponent} from measure_cold's points, or None where the largest
    size showed the engine no cost (nothing to model)."""
    moved = max(p[0] for p in points)
    top = max(points, key=lambda p: p[0])
    if top[1] <= 0:
        return None
    usable = [(math.log(p[0] / moved), math.log(p[1])) for p in points if p[1] > 0]
    exponent = 1.0
    if len(usable) >= 2:
        mx = statistics.fmean(x for x, _ in usable)
        my = statistics.fmean(y for _, y in usable)
        sxx = sum((x - mx) ** 2 for x, _ in usable)
        if sxx > 0:
            exponent = sum((x - mx) * (y - my) for x, y in usable) / sxx
    exponent = min(3.0, max(0.1, exponent))
    shape = [(p[0] / moved) ** exponent for p in points]
    norm = sum(s * s for s in shape)
    engine = sum(s * p[1] for s, p in zip(shape, points, strict=True)) / norm
    latency = max(0.0, sum(s * p[2] for s, p in zip(shape, points, strict=True)) / norm)
    if engine <= 0:
        return None
    return {"moved": int(moved), "engine": engine, "latency": latency, "exponent": exponent}


def with_cold(m: Machine, points: list[list[float]] | None) -> Machine:
    """The machine with its `cold` figures fitted to measure_cold's points (kept under
    calibration.cold with the fit's residuals); unchanged where nothing was measured or
    the largest size cost the engine nothing."""
    from dataclasses import replace

    got = fit_cold(points) if points else None
    if got is None:
        return m
    shape = [(p[0] / got["moved"]) ** got["exponent"] for p in points]
    m.calibration["cold"] = {
        "points": [[int(b), sig(e), sig(lat)] for b, e, lat in points],
        "fitted_engine": [sig(got["engine"] * s) for s in shape],
    }
    return replace(
        m,
        cold_moved=got["moved"],
        cold_engine=sig(got["engine"]),
        cold_latency=sig(got["latency"]) if got["latency"] > 0 else 0.0,
        cold_exponent=sig(got["exponent"], 3),
    )


def with_reuse(m: Machine, now: dict | None) -> Machine:
    """The machine with its `reuse` figures: reread makes the fitted model's price of the
    state's in-place MPI_Allreduce on two ranks of a node the time measured on the buffer
    the previous one wrote (same_s), so a reused buffer's collective is priced from that
    measurement (the cold price's error at that size included); cache: the largest
    cache's share per CPU. Unchanged where the state was not measured."""
    from dataclasses import replace

    from proxies.core.prediction import collective_seconds

    if not now or not now.get("same_s") or not now.get("bytes"):
        return m
    cold = collective_seconds(m, "allreduce", "mpi", 2, now["bytes"] // 4, ranks_per_node=2)
    if cold <= 0:
        return m
    m = replace(m, reuse_cache=cache_share(), reread=sig(now["same_s"] / cold))
    m.calibration["reuse"] = {"predicted_cold_s": sig(cold), "measured_same_s": now["same_s"]}
    return m


def with_zero_pages(m: Machine, n: int, rpn: int) -> Machine:
    """The machine with zero_pages.alltoall: the all-to-alls measured from a send buffer
    never written (calibration.alltoall.untouched) over the fitted model's price of them
    (cold), the median over the sizes, so such an all-to-all is priced from that
    measurement (the cold price's error at that size included). Unchanged where none was
    measured."""
    from dataclasses import replace

    from proxies.core.prediction import collective_seconds

    points = (m.calibration.get("alltoall") or {}).get("untouched") or []
    ratios = []
    for size, seconds in points:
        cold = collective_seconds(m, "alltoall", "mpi", n, size // 4, ranks_per_node=rpn)
        if cold > 0 and seconds > 0:
            ratios.append(seconds / cold)
    if not ratios:
        return m
    m.calibration["alltoall"]["untouched_over_predicted_cold"] = [sig(x) for x in ratios]
    return replace(m, zero_page_alltoall=sig(statistics.median(ratios)))
