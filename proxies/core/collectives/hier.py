"""Hierarchical allreduce: reduce within each node, allreduce across the node leaders,
broadcast within each node.

The program takes the node of every group member (`nodes`, any labels: a group's members
need not be contiguous on nodes). A node's members, in rank order, form its tree; its
leader is its lowest rank; the leaders' ring runs in the order of the leaders' ranks. The
executor gets the nodes from MPI (comm.Split_type(COMM_TYPE_SHARED): ranks that share
memory) or, to emulate a multi-node layout on one machine, from `ranks_per_node` (ranks
k*R .. k*R+R-1 form node k; the last node may be smaller). All messages travel on the
group's communicator with tree's and ring's tags: tree messages stay inside a node, ring
messages go between leaders of different nodes, so they never meet on one pair of ranks.

  intra-node reduce: binomial tree to the leader (tree.reduce);
  inter-node allreduce: ring among the leaders (ring.allreduce), so each leader sends only
      2(m-1)/m of the buffer over the network for m nodes;
  intra-node broadcast: binomial tree from the leader (tree.bcast).

The node labels from MPI's split are gathered once per (communicator, ranks_per_node) and
cached on the communicator as an MPI attribute.

Summation order (deterministic): within node k, tree's order over the node's ranks gives
N_k; across nodes, ring's order over the leaders: block b of the leaders' ring collects
((N_{b+1} + N_{b+2}) + ...) + N_b.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from proxies.core.collectives import ring, tree
from proxies.core.collectives.program import EMPTY, Builder, Program

_keyval = None


def nodes_of(comm, ranks_per_node: int | None = None) -> tuple[int, ...]:
    """The node label of every rank of comm (its node's lowest rank), cached on comm."""
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
            label = node.allreduce(comm.rank, op=MPI.MIN)
            node.Free()
            cache[None] = tuple(comm.allgather(label))
        elif ranks_per_node >= 1:
            cache[ranks_per_node] = tuple(i // ranks_per_node for i in range(comm.size))
        else:
            raise ValueError(f"ranks_per_node must be positive, got {ranks_per_node}")
    return cache[ranks_per_node]


def layout(nodes: Sequence[int]) -> tuple[list[list[int]], list[int]]:
    """(members of each node in rank order, the nodes ordered by their lowest rank;
    leaders = [m[0] for m in members])."""
    groups: dict[int, list[int]] = {}
    for i, k in enumerate(nodes):
        groups.setdefault(k, []).append(i)
    members = sorted(groups.values())
    return members, [m[0] for m in members]


@lru_cache(maxsize=4096)
def allreduce(n: int, r: int, count: int, nodes: tuple[int, ...]) -> Program:
    if len(nodes) != n:
        raise ValueError(f"hier: {len(nodes)} node labels for a group of {n} ranks")
    if n == 1 or count == 0:
        return EMPTY
    members, leaders = layout(nodes)
    mine = next(m for m in members if r in m)
    i, b = mine.index(r), Builder()
    # -- within the node, to the leader
    tree.reduce_steps(b, mine, i, count)
    # -- across nodes, leaders only (one node: nothing)
    if i == 0 and len(leaders) > 1:
        ring.allreduce_steps(b, leaders, leaders.index(r), count)
    # -- within the node, from the leader
    tree.bcast_steps(b, mine, i, count)
    return b.program()
