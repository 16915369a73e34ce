"""Hierarchical allreduce: reduce within each node, allreduce across the node leaders,
broadcast within each node.

Nodes come from MPI (comm.Split_type(COMM_TYPE_SHARED): ranks that share memory) or, to
emulate a multi-node layout on one machine, from `ranks_per_node` (ranks k*R .. k*R+R-1
form node k; the last node may be smaller). The leader of a node is its lowest rank.

  intra-node reduce: binomial tree to the leader (tree.reduce);
  inter-node allreduce: ring among the leaders (ring.allreduce), so each leader sends only
      2(m-1)/m of the buffer over the network for m nodes;
  intra-node broadcast: binomial tree from the leader (tree.bcast).

The split communicators are built once per (communicator, ranks_per_node) and cached on
the communicator as an MPI attribute.

Summation order (deterministic): within node k, tree's order over the node's ranks gives
N_k; across nodes, ring's order over the leaders: block b of the leaders' ring collects
((N_{b+1} + N_{b+2}) + ...) + N_b.
"""

from __future__ import annotations

import numpy as np

from proxies.collectives import ring, tree
from proxies.collectives.common import Wait, flat, waitall

_keyval = None


def groups(comm, ranks_per_node: int | None = None):
    """(node communicator, leaders communicator or COMM_NULL) for this rank, cached."""
    from mpi4py import MPI

    global _keyval
    if _keyval is None:
        _keyval = MPI.Comm.Create_keyval()
    cache = comm.Get_attr(_keyval)
    if cache is None:
        cache = {}
        comm.Set_attr(_keyval, cache)
    if ranks_per_node not in cache:
        if ranks_per_node is None:
            node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
        elif ranks_per_node >= 1:
            node = comm.Split(comm.rank // ranks_per_node, comm.rank)
        else:
            raise ValueError(f"ranks_per_node must be positive, got {ranks_per_node}")
        leader = MPI.UNDEFINED if node.rank else 0
        cache[ranks_per_node] = (node, comm.Split(leader, comm.rank))
    return cache[ranks_per_node]


def allreduce(
    comm, buf: np.ndarray, wait: Wait | None = None, ranks_per_node: int | None = None
) -> None:
    x = flat(buf)
    if comm.size == 1 or x.size == 0:
        return
    wait = waitall(wait)
    node, leaders = groups(comm, ranks_per_node)
    # -- within the node, to the leader
    tree.reduce(node, x, wait)
    # -- across nodes, leaders only
    if node.rank == 0:
        ring.allreduce(leaders, x, wait)
    # -- within the node, from the leader
    tree.bcast(node, x, wait)
