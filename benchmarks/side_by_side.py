"""Ways of doing one thing, timed side by side in one run (alltoall_place.py,
huge_pages.py): round after round, each way once per round in a fixed order, each call
after a barrier and timed by its slowest rank, so load that drifts touches every way
alike; the median per way over the rounds after the warm-up ones."""

from __future__ import annotations

import statistics
from collections.abc import Callable


def medians(
    comm,
    MPI,
    calls: dict[str, Callable[[], object]],
    rounds: int,
    warmup: int,
    before: Callable[[], object] | None = None,
) -> dict[str, float]:
    """Seconds per way (the slowest rank's, the median of `rounds` after `warmup`);
    `before` runs ahead of every call's barrier, untimed (to push the buffers out of the
    caches, say)."""
    times: dict[str, list[float]] = {way: [] for way in calls}
    for k in range(warmup + rounds):
        for way, call in calls.items():
            if before is not None:
                before()
            comm.Barrier()
            t0 = MPI.Wtime()
            call()
            took = comm.allreduce(MPI.Wtime() - t0, op=MPI.MAX)
            if k >= warmup:
                times[way].append(took)
    return {way: statistics.median(seen) for way, seen in times.items()}
