"""A collective's local work on the rank's core. Copies: MPICH's in-place all-to-all passes every
block through a temporary (Sendrecv_replace, or its non-blocking schedule's copy), the
pairwise one copies its received blocks out of scratch. The predictor prices the bytes
copied on the critical path at compute.memory (read + written: 2 bytes moved per byte),
slowed like compute where ranks outnumber cores; free with no compute.memory. And a
non-blocking collective's adds and copies, which MPI runs on the rank's core inside its
calls, delay the rank's own work they fall in (free while the rank waits)."""

import math
from dataclasses import replace

import pytest

from proxies.core.collectives import steps
from proxies.core.mpi_choice import chooser
from proxies.core.network import Topology
from proxies.core.plan import Collective, Compute, Plan, Wait
from proxies.core.predict import predict
from proxies.core.prediction import collective_seconds

from .test_network import machine

MEM = 4e9  # compute.memory, bytes read + written per second


def mach(mem=MEM, cores=64):
    m = replace(machine(rpn=4, intra=10e9, lat=1e-6), memory_bandwidth=mem)
    return replace(m, cores_per_node=cores, mpi={"alltoall": [(2**63, "inplace")]})


def a2a(m, n, count, detail, alg="mpi"):
    if alg != "mpi":
        m = replace(m, mpi={"alltoall": [(2**63, alg)]})
    return collective_seconds(m, "alltoall", "mpi", n, count, ranks_per_node=n, detail=detail)


@pytest.mark.parametrize("detail", ["steps", "coarse"])
def test_in_place_all_to_all_on_two_ranks_copies_one_block(detail):
    count = 1 << 22  # 16 MiB of float32: an 8 MiB block each way
    block = count * 4 // 2
    free = a2a(mach(mem=None), 2, count, detail)
    # one exchange: a latency and the block at 10 GB/s (each way on its own port)
    assert math.isclose(free, 1e-6 + block / 10e9, rel_tol=1e-9)
    # then the block through the temporary: 2 x block bytes moved at 4 GB/s
    assert math.isclose(a2a(mach(), 2, count, detail) - free, 2 * block / MEM, rel_tol=1e-9)


def test_in_place_chain_on_four_ranks_copies_five_blocks():
    # MPICH's global pair order makes a chain of 2n - 3 = 5 exchanges, each followed by its
    # copy on both ranks: 5 blocks on the critical path (coarse: phases one after another)
    count, n = 1 << 20, 4
    block = count * 4 // n
    added = a2a(mach(), n, count, "coarse") - a2a(mach(mem=None), n, count, "coarse")
    assert math.isclose(added, 5 * 2 * block / MEM, rel_tol=1e-9)
    phases = steps.coarse("alltoall", "inplace", n, count, 4, lambda s, d: 0.0)
    assert sum(ph.copy_bytes for ph in phases) == 5 * block


@pytest.mark.parametrize("detail", ["steps", "coarse"])
def test_pairwise_copies_its_received_blocks_once_at_the_end(detail):
    count, n = 1 << 20, 4
    block = count * 4 // n
    with_copies = a2a(mach(), n, count, detail, "pairwise")
    added = with_copies - a2a(mach(None), n, count, detail, "pairwise")
    assert math.isclose(added, (n - 1) * 2 * block / MEM, rel_tol=1e-9)


def test_copies_slow_down_where_ranks_share_cores():
    count = 1 << 22
    block = count * 4 // 2
    free = a2a(replace(mach(None), cores_per_node=1), 2, count, "steps")
    crowded = a2a(mach(cores=1), 2, count, "steps")  # 2 ranks on 1 core: half the rate
    assert math.isclose(crowded - free, 2 * 2 * block / MEM, rel_tol=1e-9)


def test_reductions_copy_nothing():
    for alg in ("ring", "rhd", "rd", "tree"):
        phases = steps.coarse("allreduce", alg, 4, 1000, 4, lambda s, d: 1.0)
        assert sum(ph.copy_bytes for ph in phases) == 0
    assert math.isclose(
        collective_seconds(mach(), "allreduce", "ring", 4, 1 << 20, ranks_per_node=4),
        collective_seconds(mach(None), "allreduce", "ring", 4, 1 << 20, ranks_per_node=4),
    )


# -- a non-blocking collective's local work takes its rank's core ------------------------------


def overlapped(m, compute_s: float, detail: str, req: str = "g"):
    """2 ranks: post a non-blocking rhd allreduce of 4 MiB, compute, wait for it."""
    ops = (
        Collective("allreduce", "w", "x", 1 << 20, req=req, category="dp"),
        Compute("backward", flops=compute_s * 1e9),
        Wait(req),
    )
    plans = [Plan(r, ops, {"w": (0, 1)}) for r in (0, 1)]
    cost = lambda r, op: op.flops / 1e9  # noqa: E731
    return predict(plans, Topology(m, 2), cost, chooser(m), detail=detail)


def reducing_machine():
    m = replace(machine(rpn=2, intra=10e9, lat=1e-6), reduce_bandwidth=5e9)
    return replace(m, mpi={"allreduce": [(2**63, "rhd")]})


@pytest.mark.parametrize("detail", ["steps", "coarse"])
def test_reduction_under_compute_delays_the_compute(detail):
    # rhd on 2 ranks: each adds half the message (2 MiB at 5 GB/s) and receives two halves
    # (the reduce-scatter's and the allgather's, 10 GB/s within the node) while its rank
    # computes 10 ms: MPI runs that add and those copies on the rank's core, so the rank
    # finishes that much later, booked to the collective's category (the rank did its
    # work, not compute)
    half = (1 << 20) * 4 / 2
    mpi_work = half / 5e9 + 2 * half / 10e9
    pred = overlapped(reducing_machine(), 10e-3, detail)
    assert math.isclose(pred.time, 10e-3 + mpi_work, rel_tol=1e-9)
    for b in pred.breakdown.values():
        assert math.isclose(b["compute"], 10e-3, rel_tol=1e-9)
        assert math.isclose(b["dp"], mpi_work, rel_tol=1e-9)


@pytest.mark.parametrize("detail", ["steps", "coarse"])
def test_reduction_while_the_rank_waits_is_free(detail):
    # no compute to delay: the rank waits in MPI and its idle core does the add; the
    # collective alone (textbook rhd on 2 ranks) is the iteration
    half = (1 << 20) * 4 / 2
    pred = overlapped(reducing_machine(), 0.0, detail)
    assert math.isclose(pred.time, 2 * (1e-6 + half / 10e9) + half / 5e9, rel_tol=1e-9)
