"""What the MPI library runs for each collective, as the predictor prices it: its algorithm
per kind and size (the machine file's `mpi:` table, else MPICH's defaults), which collectives
it runs itself rather than our point-to-point programs, and what its fresh temporaries cost.
"""

from __future__ import annotations

from collections.abc import Callable

from proxies.core.machine import ANY

# What MPICH runs when the machine file does not say (its default selection, MPICH 4):
# recursive doubling for short allreduces, Rabenseifner's reduce-scatter + allgather above;
# allgather by recursive doubling up to 80 KiB in all, ring above; reduce-scatter by
# recursive halving (commutative sums); all-to-all and all-to-all-v pairwise (the engine
# passes separate send and receive buffers; MPICH posts short messages' exchanges at once,
# "scattered", which on the predictor's links costs what pairwise does but for latencies);
# binomial broadcast and reduce.
MPICH_DEFAULTS: dict[str, list[tuple[int, str]]] = {
    "allreduce": [(2048, "rd"), (ANY, "rhd")],
    "allgather": [(80 << 10, "rd"), (ANY, "ring")],
    "reduce_scatter": [(ANY, "rh")],
    "alltoall": [(ANY, "pairwise")],
    "alltoallv": [(ANY, "pairwise")],
    "bcast": [(ANY, "binomial")],
    "reduce": [(ANY, "binomial")],
}


def mpi_algorithm(machine, kind: str, nbytes: int) -> str:
    """The algorithm the MPI library runs for a collective of nbytes (the machine file's
    `mpi:` table where it has the kind, else MPICH's defaults)."""
    table = (machine.mpi or {}).get(kind) or MPICH_DEFAULTS[kind]
    for upto, alg in table:
        if nbytes <= upto:
            return alg
    return table[-1][1]


def chooser(machine, allreduce: str = "mpi") -> Callable[[str, int], str]:
    """(kind, nbytes) -> algorithm, as the engine runs it: --allreduce for allreduces (ours
    over point-to-point), MPI's own for everything else."""

    def pick(kind: str, nbytes: int) -> str:
        if kind == "allreduce" and allreduce != "mpi":
            return allreduce
        return mpi_algorithm(machine, kind, nbytes)

    # the MPI library runs it (its temporaries may be fresh memory), or our program does
    pick.library = lambda kind: kind != "allreduce" or allreduce == "mpi"  # type: ignore[attr-defined]
    return pick


def fault_seconds_per_byte(machine, library: bool, nbytes: int) -> float:
    """Extra seconds per reduced byte of a collective of nbytes: MPI's temporary (as large
    as the message) is a fresh mapping above fresh_memory.above, and every received byte
    it reduces is faulted in first at fresh_memory.rate. 0 for our own programs (their
    buffers are kept) and below the threshold (glibc reuses the heap)."""
    if not library or machine.fresh_above is None or not machine.fault_rate:
        return 0.0
    return 1.0 / machine.fault_rate if nbytes > machine.fresh_above else 0.0
