"""Who waited for whom: every second of a rank's idle, attributed to the peer it waited for.

A rank's idle has three sources (engine.py), each with one peer to blame:
- a receive's wait until the message exists: the sender (the engine notes it per message);
- a blocking collective's wait for stragglers (its time beyond the group's fastest member,
  split_collective_waits): the member that arrived last, which is the member that spent
  the least time in that collective instance (durations, not clocks: ranks on different
  nodes need not share a clock);
- the tail after its last op until the slowest rank's end (book_overhead_and_tail): the
  slowest rank.
So on every rank the seconds waited for peers add up to its idle. Found after the run from
what the iterations recorded, one Allgather per group and one over the world: nothing is
added inside iterations.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from proxies.core.engine import IterationTimes


def attribute_collectives(MPI, comms: dict, groups: dict, runs: list[IterationTimes]) -> None:
    """Add each blocking collective's wait-for-stragglers to the last member to arrive.
    `groups`: group name -> member world ranks in group-rank order (Plan.groups)."""
    me = MPI.COMM_WORLD.rank
    by_group: dict[str, list[tuple[IterationTimes, float]]] = defaultdict(list)
    for t in runs:
        for group, _, dt in t.collectives:
            by_group[group].append((t, dt))
    for group in sorted(comms):
        comm = comms[group]
        if comm is None or group not in by_group:
            continue
        mine = np.array([dt for _, dt in by_group[group]])
        every = np.empty((comm.size, mine.size))
        comm.Allgather(mine, every)
        last, fastest = every.argmin(axis=0), every.min(axis=0)
        members = groups[group]
        for k, (t, dt) in enumerate(by_group[group]):
            who = members[int(last[k])]
            if who != me:
                t.waited[who] += dt - float(fastest[k])


def attribute_tail(MPI, world, runs: list[IterationTimes]) -> None:
    """Add each iteration's tail (this rank's end to the slowest rank's) to the slowest
    rank. Call before book_overhead_and_tail, which sets every total to the slowest."""
    own = np.array([t.total for t in runs])
    every = np.empty((world.size, own.size))
    world.Allgather(own, every)
    for t, who, end in zip(runs, every.argmax(axis=0), every.max(axis=0), strict=True):
        if int(who) != world.rank:
            t.waited[int(who)] += float(end) - t.total


def per_iteration(runs: list[IterationTimes]) -> dict[str, float]:
    """Peer (as a string, JSON's key) -> seconds waited for it per timed iteration (mean)."""
    total: dict[int, float] = defaultdict(float)
    for t in runs:
        for peer, s in t.waited.items():
            total[peer] += s
    n = max(len(runs), 1)
    return {str(p): s / n for p, s in sorted(total.items()) if s > 0}


def split_collective_waits(MPI, comms: dict, runs: list[IterationTimes]) -> None:
    """Move each collective's wait-for-stragglers into "idle", in place.

    For every collective instance, the group's smallest duration is the collective itself
    (the last member to arrive waited least); the rest of a member's time was waiting.
    One Allreduce(MIN) per group after the run: nothing is added inside iterations.
    """
    by_group: dict[str, list[float]] = defaultdict(list)
    for t in runs:
        for group, _, dt in t.collectives:
            by_group[group].append(dt)
    core: dict[str, np.ndarray] = {}
    for group in sorted(comms):
        comm = comms[group]
        if comm is None or group not in by_group:
            continue
        mine = np.array(by_group[group])
        core[group] = np.empty_like(mine)
        comm.Allreduce(mine, core[group], op=MPI.MIN)
    cursor: dict[str, int] = defaultdict(int)
    for t in runs:
        for group, category, dt in t.collectives:
            k = cursor[group]
            cursor[group] += 1
            fastest = float(core[group][k])
            t.seconds[category] += fastest
            t.seconds["idle"] += dt - fastest
