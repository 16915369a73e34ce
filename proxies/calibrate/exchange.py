"""The node exchange and the incast: plain messages between ranks at once, each side
starting together (calibrate's fit answers to the exchange; the incast gives the NIC's
bandwidth)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import numpy as np

from proxies.calibrate.measure import TAG, Arena, sig
from proxies.core import pages


def incast(
    comm, MPI, barrier: Callable[[], None], node_of: Sequence[int], size: int, reps: int
) -> tuple[float, int, float] | None:
    """Concurrent flows into one node: every rank of nodes 1.. sends `size` bytes to a rank
    of node 0 (round robin), all at once. (bytes/s into node 0, flows, median seconds);
    None with fewer than 2 nodes. What node 0's interface(s) took in at once is the NIC's
    bandwidth, unless the senders' side is narrower (few sending nodes): say so. Timed
    from an MPI_Barrier after `barrier` (node_exchange says why)."""
    if max(node_of) < 1:
        return None
    receivers = [q for q, n in enumerate(node_of) if n == 0]
    senders = [q for q, n in enumerate(node_of) if n != 0]
    target = {s: receivers[i % len(receivers)] for i, s in enumerate(senders)}
    mine = [s for s in senders if target[s] == comm.rank]
    buf = pages.zeros(size * max(1, len(mine)), np.uint8)
    buf[...] = 1
    times = []
    for rep in range(1 + reps):
        barrier()
        comm.Barrier()  # MPI's own, spinning: the yielding one lets ranks leave a sleep apart
        t0 = MPI.Wtime()
        if comm.rank in target:
            comm.Send(buf[:size], dest=target[comm.rank], tag=TAG + 1)
        elif mine:
            reqs = [
                comm.Irecv(buf[i * size : (i + 1) * size], source=s, tag=TAG + 1)
                for i, s in enumerate(mine)
            ]
            MPI.Request.Waitall(reqs)
        took = comm.allreduce(MPI.Wtime() - t0, op=MPI.MAX)
        if rep:
            times.append(took)
    seconds = statistics.median(times)
    return len(senders) * size / seconds, len(senders), seconds


# the node exchange's sizes: the proxies' halo and pipeline messages (1 and 4 MiB) and past
# the caches (16 MiB); quick: 1 MiB
EXCHANGE_SIZES = (1 << 20, 4 << 20, 16 << 20)
QUICK_EXCHANGE_SIZES = (1 << 20,)


def node_exchange(
    comm, MPI, barrier: Callable[[], None], node_of: Sequence[int], sizes: Sequence[int], reps: int
) -> tuple[dict[int, list[float]], int]:
    """Every rank of node 0 at once (node_of -1: a rank that takes no part): pairs (0,1),
    (2,3) ... exchange each size both ways (Sendrecv, cold buffers): what all of a node's
    intra-node messages together can reach, when the cores copy them. `reps` timed
    exchanges per size after one untimed, each pair meeting (an empty Sendrecv) after the
    barrier: calibrate's barrier is a yielding one, whose sleeps let one side start up to a
    millisecond late (timed from it, a 1 MiB exchange of 0.09 ms measured 0.17 - 1.0 ms).
    ({size: seconds of each, slowest rank}, flows); no times where fewer than 2 ranks take
    part."""
    mine = [q for q, n in enumerate(node_of) if n == 0]
    pairs = len(mine) // 2
    if not pairs:  # one rank takes part: nothing to measure (0 flows)
        barrier()
        return {}, 0
    paired = mine[: 2 * pairs]
    arena = Arena(2 * max(sizes))
    empty, none = np.zeros(0, np.uint8), np.zeros(0, np.uint8)
    times: dict[int, list[float]] = {size: [] for size in sizes}
    for size in sizes:
        for rep in range(1 + reps):
            out, into = arena.take(size), arena.take(size)
            barrier()
            took = 0.0
            if comm.rank in paired:
                peer = paired[paired.index(comm.rank) ^ 1]
                # both sides leave a yielding barrier up to a sleep apart: meet first
                comm.Sendrecv(empty, dest=peer, sendtag=TAG + 3, recvbuf=none, source=peer,
                              recvtag=TAG + 3)  # fmt: skip
                t0 = MPI.Wtime()
                comm.Sendrecv(
                    out, dest=peer, sendtag=TAG + 2, recvbuf=into, source=peer, recvtag=TAG + 2
                )
                took = MPI.Wtime() - t0
            barrier()  # ranks not taking part wait without spinning (they would take the cores)
            took = comm.allreduce(took, op=MPI.MAX)
            if rep:
                times[size].append(took)
    return times, 2 * pairs


class Exchanges:
    """The node exchange, measured in passes that calibrate spreads over its run (as the
    ping-pong spreads its round trips over sweeps): a disturbance of the machine, or a
    change of its state, while one pass runs moves a third of each size's times, not
    their median."""

    def __init__(self, comm, MPI, barrier, node_of, sizes: Sequence[int], reps: int) -> None:
        self.run = lambda: node_exchange(comm, MPI, barrier, node_of, sizes, reps)
        self.times: dict[int, list[float]] = {size: [] for size in sizes}
        self.flows = 0

    def measure(self) -> None:
        times, self.flows = self.run()
        for size, seen in times.items():
            self.times[size] += seen

    def points(self) -> list[tuple[int, float]]:
        """[(size, median seconds over every pass)]; none where no pair took part."""
        if not self.flows:
            return []
        return [(size, statistics.median(seen)) for size, seen in self.times.items()]


def exchange_record(points: list[tuple[int, float]], flows: int) -> dict:
    """The node exchange as the file records it: the largest size's seconds and what the
    node moved in all then (bandwidth), and every size's seconds (points, the fit's
    targets); flows 0 and no points where no pair took part."""
    if not points:
        return {"flows": 0, "bytes_each": 0, "seconds": 0.0, "bandwidth": 0.0, "points": []}
    size, seconds = points[-1]
    return {
        "flows": flows,
        "bytes_each": size,
        "seconds": sig(seconds),
        "bandwidth": sig(flows * size / seconds),
        "points": [[s, sig(t)] for s, t in points],
    }
