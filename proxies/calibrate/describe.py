"""What calibrate says about the file it wrote: the comments beside each figure (what was
measured, how) and the summary it prints."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from proxies.core.machine import Machine
from proxies.core.units import format_quantity

if TYPE_CHECKING:
    from proxies.calibrate.main import Topology


def comments(m: Machine, topo: Topology, quick: bool) -> dict[str, str]:
    c = m.calibration
    crowd = (
        f" Ranks outnumbered cores ({topo.real_ranks} ranks on {topo.real_cores} cores): the "
        "pair shared cores with waiting ranks, as the runs do."
        if topo.crowded
        else ""
    )
    span = "8 B .. 2 MiB" if quick else "8 B .. 64 MiB"
    fit = (
        f"Started from ping-pong ({span}, blocking Send/Recv, median round trip / 2, "
        "latency + bytes / bandwidth by least squares on the relative time; under "
        "calibration.{}), then latencies and bandwidths fitted so that the predictor "
        "prices the measured allreduce algorithms, the node exchange and MPI's all-to-all "
        "right, each kind weighing alike (calibration.fit: the figures before and after, "
        "the residual of every measurement)." + crowd
    )
    out = {
        "": f"Written by python -m proxies calibrate{' --quick' if quick else ''} on "
        f"{c['date']}: {c['ranks']} ranks, {c['nodes']} node(s), {c['library']}. "
        "Figures are per rank; see calibration: for what was measured.",
        "nodes.ranks_per_node": "from MPI's shared-memory split"
        if not any("emulated" in n for n in topo.notes)
        else "emulated nodes (--ranks-per-node)",
        "nodes.cores_per_node": "cores the node's ranks may run on (sched_getaffinity), "
        "the smallest node's",
        "intra_node": fit.format("intra_node"),
        "compute.matmul": "np.matmul float32 at the GPT-2 124M widths, a rank per core at "
        "once (the rest parked), the median shape's per-rank rate",
        "compute.memory": "np.copyto of a large array: bytes read + written per second "
        "(a copy of S bytes moves 2S), per rank, a rank per core at once",
        "compute.reduce": "np.add(acc, recv, out=acc): bytes of received data added per "
        "second, per rank, a rank per core at once",
        "unmeasured": "not measured: "
        + ("inter_node (one node: run on 2 or more nodes), " if m.inter is None else "")
        + "compute.device (NumPy runs on the CPU), switch (the topology is not probed)",
        "calibration": "raw measurements: [bytes, seconds, relative residual of the fit] per "
        "ping-pong size; allreduce: [bytes per rank, seconds per call, slowest rank, "
        "median of calls] per algorithm of proxies.collectives; alltoall: the same for "
        "MPI's all-to-all out of place from cold buffers (the whole array per rank; "
        "untouched: again from a buffer never written); state: what python -m "
        "proxies.calibrate.probe measures again later (a cold and a same-buffer 1 MiB "
        "allreduce, a copy's rate) to tell whether the machine is still in this state",
    }
    if m.oversub is not None:
        out["oversubscribed"] = (
            f"Ranks outnumber cores ({topo.ranks_per_node} per node on {topo.cores_per_node}): "
            "the figures above were measured with only as many ranks per node active as "
            "cores, the rest parked in a sleeping wait. These, which the predictor uses "
            "instead for runs that crowd a node so, are fitted to allreduces, MPI's "
            "all-to-all and the node exchange on every rank with yielding waits "
            "(calibration.oversubscribed_fit); "
            "node_bandwidth from every rank exchanging at once, op_overhead from the engine "
            "with yielding waits"
            + (
                "; unexpected: 8 tiny messages sent to a rank inside MPI's all-to-all, its "
                "delay over their 1 ms tests (calibration.oversubscribed_unexpected)."
                if m.oversub_unexpected is not None
                else "."
            )
        )
    if m.fresh_above is not None:
        out["fresh_memory"] = (
            "MPI_Allreduce's page faults per call counted (getrusage) at sizes around "
            "glibc's 32 MiB mmap threshold: above `above` its temporary is a fresh mapping "
            "every call; rate: the bytes faulted in over what they cost MPI, the largest "
            "size timed as glibc serves it and again with mallopt raising the mmap "
            "threshold (calibration.fresh_memory.from_mpi); if that is noise, filling a new "
            "4 KiB-page mapping less filling mapped memory (fill_rate)."
        )
    if m.reread is not None:
        out["reuse"] = (
            "reread: an in-place 1 MiB MPI_Allreduce on two ranks, measured on the buffer "
            "the previous one wrote (calibration.state.same_s), over the model's price of it "
            "(calibration.reuse): the predictor charges it on MPI's collectives over buffers a "
            "comm-only or modelled run reuses within `cache` bytes (the largest cache's "
            "share per CPU). It moves with the machine's state "
            "(python -m proxies.calibrate.probe)."
        )
    if m.zero_page_alltoall is not None:
        out["zero_pages"] = (
            "alltoall: MPI's all-to-all at the two largest sizes from a send buffer never "
            "written (calibration.alltoall.untouched) over the model's price of it from cold "
            "buffers, the median: the predictor charges it on the all-to-alls of runs "
            "without real compute or --check, whose send buffers are never written."
        )
    if m.op_overhead or m.wake:
        out["engine"] = (
            "op_overhead: the engine's own seconds per plan op (an iteration less its ops' "
            "own times, as runs book `overhead`): a plan of a non-blocking 1-element "
            "allreduce pending under two empty computes, its wait and a blocking 1-element "
            "allreduce, over and over, through the real engine on the active ranks, "
            "spinning waits; compute, exchange, collective, nonblocking: the same per op of "
            "plans of one kind each (empty computes; blocking 1-element batches to the next "
            "rank and from the previous; blocking 1-element allreduces; non-blocking ones "
            "waited for at once, the start and the Wait each an op), which the predictor "
            "charges on their kind of op. wake: how much longer than asked time.sleep of "
            "20 us to 1 ms lasted (median), a rank per core at once: each slept compute op "
            "and each sleep of a yielding wait lasts that much longer"
        )
    if m.cold_moved:
        out["cold"] = (
            "cycles of two blocking exchanges with the neighbouring ranks through the real "
            "engine, the first moving B / 4 bytes each way (B read and written) or 1 element, "
            "the second 1 element; per B (calibration.cold.points: B, engine, latency), the "
            "engine's own seconds per cycle and the second exchange's booked seconds, bulk "
            "less small, the slowest rank's median. Fitted as figure x (B / moved) ** "
            "exponent, held beyond moved: the predictor charges it on every op after a "
            "communication op that touched B bytes (twice what it sent and received), up to "
            "the next one"
        )
    if m.inter is not None:
        out["inter_node"] = fit.format("inter_node")
        if any("emulated" in n for n in topo.notes):
            out["inter_node"] += (
                " Nodes were emulated (--ranks-per-node) on one machine: this is shared "
                "memory, not a network."
            )
        nic = c["nic"]
        out["inter_node.nic_bandwidth"] = (
            f"{nic['flows']} flow(s) of {nic['bytes_each'] >> 20} MiB from the other nodes into "
            "node 0 at once, bytes / slowest time (a lower bound when few nodes send)"
        )
    return out


def summary(m: Machine, topo: Topology) -> None:
    q = format_quantity
    c = m.calibration
    print(
        f"  intra_node  latency {q(m.intra.latency, 'time')}, bandwidth "
        f"{q(m.intra.bandwidth, 'bandwidth')} (fit within "
        f"{100 * c['intra_node']['max_abs_residual']:.0f}%)"
    )
    if m.inter is not None:
        print(
            f"  inter_node  latency {q(m.inter.latency, 'time')}, bandwidth "
            f"{q(m.inter.bandwidth, 'bandwidth')} (fit within "
            f"{100 * c['inter_node']['max_abs_residual']:.0f}%), NIC "
            f"{q(m.nic_bandwidth, 'bandwidth')} ({c['nic']['flows']} flows)"
        )
    print(
        f"  compute     matmul {q(m.matmul_flops, 'rate')}, memory "
        f"{q(m.memory_bandwidth, 'bandwidth')}, reduce {q(m.reduce_bandwidth, 'bandwidth')} "
        "per rank, a rank per core"
    )
    largest = {k: v[-1] for k, v in c["allreduce"].items()}
    words = ", ".join(f"{k} {v[1] * 1e6:.0f} us" for k, v in largest.items())
    if largest:
        size = next(iter(largest.values()))[0]
        print(f"  allreduce   {q(size, 'count')} per rank: {words}")
    if "state" in c:
        print(f"  state       {state_text(c['state'])}")
    if m.oversub is not None:
        print(f"  oversubscribed  {oversubscribed_text(m)}")
    if m.fresh_above is not None:
        print(
            f"  fresh_memory  MPI's temporaries above {q(m.fresh_above, 'count')} faulted in "
            f"at {q(m.fault_rate, 'bandwidth')}"
        )
    if m.reread is not None:
        print(
            f"  reuse       MPI's collectives on a buffer reused within "
            f"{q(m.reuse_cache, 'count')}: x{m.reread:.3g} per byte"
        )
    if m.zero_page_alltoall is not None:
        print(
            f"  zero_pages  MPI's all-to-all from a never-written buffer: "
            f"x{m.zero_page_alltoall:.3g} per byte"
        )
    kinds = "".join(f", {k} {s * 1e6:.2f}" for k, s in m.op_overheads.items())
    print(f"  engine      {m.op_overhead * 1e6:.2f} us per op{kinds}")
    if m.cold_moved:
        print(
            f"  cold        after {q(m.cold_moved, 'count')} moved: engine "
            f"+{m.cold_engine * 1e6:.1f} us, MPI +{m.cold_latency * 1e6:.1f} us per op "
            f"(x (B / moved) ** {m.cold_exponent:.2f} below)"
        )
    missing = [u for u in m.unmeasured]
    print(f"not measured: {', '.join(missing)} (see the file's comments)", file=sys.stdout)


def oversubscribed_text(m: Machine) -> str:
    """The `oversubscribed` section in one line (calibrate's summary, the benchmark's)."""
    q = format_quantity
    parts = [
        f"latency {q(m.oversub.latency, 'time')}",
        f"bandwidth {q(m.oversub.bandwidth, 'bandwidth')}",
    ]
    if m.oversub_node_bandwidth:
        parts.append(f"node {q(m.oversub_node_bandwidth, 'bandwidth')}")
    if m.oversub_op_overhead:
        parts.append(f"{q(m.oversub_op_overhead, 'time')} per op")
    if m.oversub_wake:
        parts.append(f"wake {q(m.oversub_wake, 'time')}")
    if m.oversub_mpi_latency:
        parts.append(f"MPI's collectives {q(m.oversub_mpi_latency, 'time')} per step")
    if m.oversub_unexpected is not None:
        parts.append(f"{m.oversub_unexpected:g} test(s) per unexpected message")
    return ", ".join(parts)


def state_text(d: dict, then: dict | None = None) -> str:
    """calibrate's (or the probe's) state figures in one line; with `then` (the ones a
    machine file was calibrated at), each beside its calibrated value."""
    was = then or {}

    def at(key: str, text: str, fmt) -> str:
        return f"{text} ({fmt(was[key])} calibrated)" if key in was else text

    us = lambda s: f"{s * 1e6:.0f} us"  # noqa: E731
    gb = lambda b: f"{b / 1e9:.3g} GB/s"  # noqa: E731
    x = lambda v: f"x{v:.2g}"  # noqa: E731
    return ", ".join(
        [
            at("cold_s", f"1 MiB allreduce {us(d['cold_s'])} on a cold buffer", us),
            at("reread", f"{x(d['reread'])} on the buffer the previous one wrote", x),
            at("copy", f"copies {gb(d['copy'])} per rank", gb),
        ]
    )
