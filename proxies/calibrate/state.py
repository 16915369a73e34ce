"""The machine's state: figures that drift between a calibration and a run.

calibrate records them (calibration.state) and python -m proxies.calibrate.probe measures
them again later; benchmarks/predict.py probes before and after every point. Collective over
`comm`, timed as measure.py times (MPI.Wtime, warm-ups, the slowest rank, medians).
"""

from __future__ import annotations

import statistics

import numpy as np

from proxies.calibrate.measure import Arena, copy_rates, slowest
from proxies.core import pages

STATE_BYTES = 1 << 20  # the allreduce: within every core's private cache, above eager sizes
STATE_COPY_BYTES = 64 << 20  # the copy: twice a large last-level cache, from memory
# figure -> words, in the order the probe prints them
STATE_FIGURES = {
    "cold_s": "a cold 1 MiB allreduce",
    "reread": "the same buffer's over a cold one's",
    "copy": "copy rate per rank, all at once",
}


def state(comm, MPI, reps: int = 15) -> dict:
    """Figures of this machine that moved by 2x within minutes on the VM this was developed
    on, measured in a second on the whole of `comm` (2 ranks or more):

    - cold_s, same_s, reread: an in-place 1 MiB MPI_Allreduce on a cold buffer (a fresh
      arena slice) and on the buffer the previous call left its result in (the proxies'
      comm-only runs reduce the same buffers again and again), and same_s / cold_s. The two
      alternate call by call, so drift touches them alike; each call's time is the slowest
      rank's, each figure the median. There the ratio sat at 1.3 for tens of seconds to
      minutes, then at 2.6, and the GPT-3 tensor-parallel comm-only point took 8.8 or
      22.9 ms with it (most likely the host placing the two vCPUs on cores that do or do
      not share a cache: reading back lines another core wrote then costs more than
      reading memory);
    - copy: bytes read + written per second by a 64 MiB np.copyto on every rank at once
      (compute.memory's measure), the median rank's: 22 or 44 GB/s there, independently.
    """
    nbytes = STATE_BYTES
    arena = Arena(nbytes * (reps + 2), np.float32)
    arena.data[...] = 0
    same = pages.zeros(max(1, nbytes // 4), np.float32)

    def timed(buf) -> float:
        call = lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)  # noqa: E731
        return slowest(comm, MPI, call, comm.Barrier)

    for _ in range(2):  # warm-up: MPI's paths, and the same buffer's result in the caches
        timed(arena.take(nbytes))
        timed(same)
    cold, hot = [], []
    for _ in range(reps):
        cold.append(timed(arena.take(nbytes)))
        hot.append(timed(same))
    c, h = statistics.median(cold), statistics.median(hot)
    del arena
    copies = copy_rates(comm, MPI, comm.Barrier, STATE_COPY_BYTES, max(3, reps // 3))
    return {
        "bytes": same.nbytes,
        "cold_s": c,
        "same_s": h,
        "reread": h / c if c > 0 else 1.0,
        "copy": statistics.median(copies),
    }


def drift(now: dict, then: dict) -> dict[str, float]:
    """now / then of each state figure both have (> 1: larger now)."""
    return {
        k: now[k] / then[k]
        for k in STATE_FIGURES
        if isinstance(now.get(k), (int, float)) and isinstance(then.get(k), (int, float))
        and now[k] > 0 and then[k] > 0
    }  # fmt: skip


def worst_drift(now: dict, then: dict) -> tuple[str, float] | None:
    """The state figure that moved most, as (figure, factor >= 1), or None."""
    d = drift(now, then)
    if not d:
        return None
    k = max(d, key=lambda k: max(d[k], 1 / d[k]))
    return k, max(d[k], 1 / d[k])
