"""BLAS threads per rank, set before NumPy is imported.

Oversubscribed BLAS threads ruin every timing: 32 ranks on 2 cores each starting 2 OpenBLAS
threads spend their time context-switching. Each rank gets cores / ranks-on-this-node
threads (at least 1) unless the user already set one of the variables below.
"""

from __future__ import annotations

import os

BLAS_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS")

# Launchers export the number of ranks on this node under different names.
LOCAL_SIZE_VARS = (
    "MPI_LOCALNRANKS",  # MPICH hydra
    "OMPI_COMM_WORLD_LOCAL_SIZE",  # Open MPI
    "MV2_COMM_WORLD_LOCAL_SIZE",  # MVAPICH
    "PALS_LOCAL_SIZE",  # Cray PALS
    "SLURM_NTASKS_PER_NODE",
)

# OpenBLAS's threads spin for 2^OPENBLAS_THREAD_TIMEOUT TSC ticks after each call before they
# sleep: 2^28 (about 0.1 s) by default. The elementwise kernels that follow a matmul run on the
# same cores (proxies/transformer/fast.py), so for that long they lost a core to the spinning: GPT-2
# 124M's AdamW right after the backward took 300-320 ms instead of 240-260 (2 cores). 2^18
# ticks (about 0.1 ms) still keeps the threads awake between back-to-back matmuls (shorter,
# 2^4, made the matmuls themselves slower). Set unless the user did.
OPENBLAS_SPIN_EXPONENT = "18"

# What pin_blas_threads decided, for the report: (threads, ranks_on_node, cores, source).
decision: tuple[int, int, int, str] | None = None


def cores_available() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def placement(MPI, comm) -> tuple[bool, int]:
    """By MPI's shared-memory split of `comm` (collective over it): whether this rank's node
    holds more ranks than it has cores (the proxies then wait yielding), and how many ranks
    the largest node holds (the placement predictions beside a run take)."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    crowded = node.allreduce(node.size > cores_available(), op=MPI.LOR)
    largest = comm.allreduce(node.size, op=MPI.MAX)
    node.Free()
    return crowded, largest


def launcher_local_size() -> tuple[int, str] | None:
    """(ranks on this node, the variable that said so) from the launcher; None without."""
    for var in LOCAL_SIZE_VARS:
        value = os.environ.get(var, "").split("(")[0]  # SLURM may say "4(x2)"
        if value.isdigit() and int(value) > 0:
            return int(value), var
    return None


def local_ranks() -> int:
    found = launcher_local_size()
    return found[0] if found else 1


# Set beside the variables when this module chose them: a process started from one that
# imported proxies (pytest, the sweep runner) must choose again for its own rank count,
# not take the parent's choice for the user's.
AUTO_MARK = "PROXIES_BLAS_THREADS_AUTO"


def parse_threads(value: str) -> int | None:
    """The thread count an OpenMP runtime takes from OMP_NUM_THREADS: a comma-separated list
    of positive integers, one per nesting level, of which a BLAS call uses the first ("4,2":
    4). None for anything else ("abc", "0", "-1", "", "4,x"): OpenMP ignores such a value,
    and so does OpenBLAS (its atoi reads 0, "unset"), so the library's own default applies.
    """
    levels = [v.strip() for v in value.split(",")]
    if all(v.isascii() and v.isdigit() and int(v) > 0 for v in levels):
        return int(levels[0])
    return None


def pin_blas_threads() -> None:
    global decision
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", OPENBLAS_SPIN_EXPONENT)
    cores, ranks = cores_available(), local_ranks()
    mark = os.environ.get(AUTO_MARK)
    ours = mark is not None and all(os.environ.get(v) == mark for v in BLAS_VARS)
    given = [] if ours else [v for v in BLAS_VARS if v in os.environ]
    valid = [v for v in given if parse_threads(os.environ[v]) is not None]
    if valid:
        user, value = valid[0], os.environ[valid[0]]
        threads = parse_threads(value)
        nested = f", {threads} at the outer level" if "," in value else ""
        decision = (threads, ranks, cores, f"user ({user}={value.strip()}{nested})")
        return
    # Values OpenMP would ignore are reported as ignored, and replaced by the choice below.
    ignored = "".join(f"; {v}={os.environ[v]!r} ignored (not a thread count)" for v in given)
    threads = max(1, cores // ranks)
    for var in BLAS_VARS:
        os.environ[var] = str(threads)
    os.environ[AUTO_MARK] = str(threads)
    decision = (threads, ranks, cores, "cores / ranks on node" + ignored)
