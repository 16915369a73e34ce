"""Per-rank memory: the estimate every proxy gives, the node's memory, and the refusal.

A proxy's estimate is a breakdown, a dict of named parts in bytes (PARTS, plus any a proxy
adds), computed from the same shapes its runtime allocates for the --compute mode (only
real and replay build the model; model and none allocate what they send). This module adds
the parts every proxy shares: the MPI library's scratch for large collectives, 16-bit wire
staging buffers, and the interpreter with its libraries.

A real run refuses up front (cli.UsageError, exit 2, before the model exists) when ranks
per node x the rank's estimate exceeds the budget of --memory-limit: auto (the default) is
this node's memory (physical or cgroup limit, the lower), SIZE (e.g. 8GiB) a budget per
node, off never refuses. The dry run prints the estimate and writes it as `memory_bytes`.

Counts whose work explodes before any memory is touched (--iters 1e20, --world-size 1e8,
ten million layers) are refused here too, against the documented maxima below.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable

from proxies.core import cli, threads
from proxies.core.plan import P2P, Collective, Plan, itemsize

# The parts in the order they are printed; a proxy may add its own after these.
PARTS = (
    "parameters",
    "gradients",
    "optimizer",
    "activations",
    "logits",
    "workspace",
    "blas",
    "buffers",
    "staging",
    "mpi_scratch",
    "baseline",
)

# The interpreter, NumPy, mpi4py with MPICH initialised, rich and a proxy's modules, at the
# start of runner.run (Linux x86-64, Python 3.11, NumPy 2, MPICH 4 from the PyPI wheel):
# a lone process's resident set measured 62 MiB for every proxy; a supervised rank (core/
# supervisor.py: the pages its fork shares are not resident in the rank until touched)
# 40-41 MiB, plus 7-8 MiB its supervisor holds alone: 47-49 MiB. 56 MiB is within 15% of both.
# ml_dtypes, imported since only by bfloat16 runs, was 8 MiB of the lone process's 62; a
# supervised rank measures 47-50 MiB as before (test_memory's probe, gpt3-tiny and dlrm).
BASELINE_BYTES = 56 * 2**20

# MPI's own scratch for a large collective, as a fraction of the largest buffer a rank
# reduces over a group of two or more: the hardening issue measured the resident set of an
# MPICH allreduce of a GPT-3 175B layer shard (1.8 GB) grow by 48% of the buffer.
MPI_SCRATCH_FRACTION = 0.48

# OpenBLAS's GEMM buffers, per BLAS thread, touched by the first large matrix product: the
# resident set of a real GPT-2 run on 2 threads grew 55 MiB beyond every NumPy array at its
# first LM-head weight gradient (50257 x 64 x 256); a lone (50257, 256) x (256, 64) product
# 48 MiB on 2 threads. 32 MiB is OpenBLAS's per-thread buffer size.
BLAS_BYTES_PER_THREAD = 32 * 2**20

# Counts refused up front (documented in the README, "Memory and huge counts"); --iters,
# --warmup and --world-size are bounded by their option types (cli.MAX_ITERS, MAX_WORLD).
MAX_LAYERS = 10_000  # LAYERS: 100x today's deepest models; plans and layouts are per layer
MAX_TABLES = 100_000  # DLRM --tables: 4,000x Criteo's 26; plans and layouts are per table


def add_option(group: argparse._ArgumentGroup) -> None:
    """--memory-limit, in the common options (cli.add_common)."""
    group.add_argument(
        "--memory-limit",
        type=parse_limit,
        default="auto",
        metavar="auto|off|SIZE",
        help="refuse a real run whose estimated memory (ranks per node x per rank: "
        "parameters, gradients, optimizer state, activations, buffers, MPI scratch) exceeds "
        "this node's memory (auto, the default: physical or cgroup limit, the lower), or "
        "SIZE per node (e.g. 8GiB); off: never refuse",
    )


def parse_limit(text: str) -> str | int:
    """'auto', 'off', or a size in bytes ('8GiB', '512 MB', 4096)."""
    if text in ("auto", "off"):
        return text
    from proxies.core.units import parse_quantity

    try:
        size = parse_quantity(text, "count")
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected auto, off or a size like 8GiB: {e}") from None
    if not 1 <= size <= 2**60:  # 1 EiB: larger is no limit at all, which is `off`
        raise argparse.ArgumentTypeError(
            f"expected auto, off or a size from 1 B to 1 EiB, got {text!r}"
        )
    return int(size)


# -- the node ----------------------------------------------------------------------------


def physical_memory() -> int:
    """Bytes of RAM on this machine (0 if unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


CGROUP_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def cgroup_limit(files: Iterable[str] = CGROUP_FILES) -> int:
    """The container's memory limit in bytes (0: none; v2 says 'max', v1 a huge number)."""
    for path in files:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            return int(text)
    return 0


def node_memory() -> tuple[int, str]:
    """(bytes, what they are) of this node: physical memory or the cgroup limit, the lower."""
    phys, limit = physical_memory(), cgroup_limit()
    if limit and (not phys or limit < phys):
        return limit, "cgroup limit"
    return phys, "physical memory"


def ranks_per_node(world: int) -> tuple[int, str]:
    """(ranks sharing this node, where that came from): the launcher's local size, else
    every rank of the world (a launch without such a variable is taken as one node)."""
    return threads.launcher_local_size() or (world, "all ranks on this node")


# -- estimates ---------------------------------------------------------------------------


def blas_workspace() -> int:
    """Bytes of BLAS buffers of a rank running real compute (threads as core/threads.py
    pins them: the user's setting, else cores / ranks on the node)."""
    n = threads.decision[0] if threads.decision and threads.decision[0] > 0 else 0
    if not n:
        n = max(1, threads.cores_available() // threads.local_ranks())
    return BLAS_BYTES_PER_THREAD * n


def comm_parts(plan: Plan) -> dict[str, int]:
    """What the communication itself needs beside the proxy's buffers: MPI's scratch for the
    largest collective over two or more ranks, and the engine's pooled wire buffers
    (core/wire.py's Staging): 16-bit copies of the largest collective and the largest
    point-to-point op in flight, and an all-to-all's receive buffer (with its 16-bit send
    copy where the wire is 16-bit)."""
    sizes = {name: len(members) for name, members in plan.groups.items()}
    largest = stage_c = stage_p = 0
    for op in plan.ops:
        if isinstance(op, Collective):
            if sizes.get(op.group, 2) > 1:
                largest = max(largest, op.count * 4)  # reduced in float32 compute buffers
            if op.kind == "alltoall":
                stage_c = max(stage_c, op.nbytes * (2 if itemsize(op.dtype) < 4 else 1))
            elif itemsize(op.dtype) < 4:
                stage_c = max(stage_c, op.nbytes)
        elif isinstance(op, P2P):
            n = sum(m.nbytes for m in (*op.sends, *op.recvs) if itemsize(m.dtype) < 4)
            stage_p = max(stage_p, n)
    return {
        "staging": stage_c + stage_p,
        "mpi_scratch": int(MPI_SCRATCH_FRACTION * largest),
    }


def p2p_buffers(plan: Plan, names: Iterable[str] | None = None, itemsize_: int = 4) -> int:
    """Bytes of one float32 compute buffer per distinct (buffer, micro-batch) of the plan's
    point-to-point messages (restricted to `names`), as runtimes that keep one per key."""
    keep = None if names is None else set(names)
    size: dict[tuple[str, int], int] = {}
    for _, m, _ in plan.messages():
        if keep is None or m.buf in keep:
            size[(m.buf, m.mb)] = max(size.get((m.buf, m.mb), 0), m.count)
    return itemsize_ * sum(size.values())


def inflight(actions) -> int:
    """The most micro-batches whose forward ran and backward did not, over a schedule's
    actions (core/schedules.py): the saved activations a stage holds at once."""
    live = peak = 0
    for a in actions:
        live += 1 if a.kind == "F" else -1 if a.kind == "B" else 0
        peak = max(peak, live)
    return peak


def complete(parts: dict[str, int], plan: Plan) -> dict[str, int]:
    """A proxy's parts with the shared ones added, zero parts dropped, ordered as PARTS."""
    every = {**parts, **comm_parts(plan), "baseline": BASELINE_BYTES}
    order = [p for p in PARTS if p in every] + [p for p in every if p not in PARTS]
    return {p: int(every[p]) for p in order if every[p]}


def total(est: dict[str, int]) -> int:
    return sum(est.values())


def gib(n: float) -> str:
    from proxies.core.report import human_bytes

    return human_bytes(n)


def describe(est: dict[str, int]) -> str:
    """'1.20 GiB = parameters 400.00 MiB + gradients ...'."""
    return f"{gib(total(est))} = " + " + ".join(f"{k} {gib(v)}" for k, v in est.items())


def largest_part(est: dict[str, int]) -> tuple[str, int]:
    return max(((k, v) for k, v in est.items() if k != "baseline"), key=lambda kv: kv[1])


# -- the checks --------------------------------------------------------------------------


def check_layers(layers: int) -> None:
    check_count("LAYERS =", layers, MAX_LAYERS, "plans and parameter layouts are per layer")


def check_count(what: str, value: int, limit: int, why: str) -> None:
    """UsageError when a count is above its documented maximum."""
    if value > limit:
        raise cli.UsageError(f"{what} {value:,}: at most {limit:,} ({why})")


def budget(args) -> tuple[int, str] | None:
    """(bytes per node, what they are) of --memory-limit; None for off or unknown."""
    limit = getattr(args, "memory_limit", "auto")
    if limit == "off":
        return None
    if limit == "auto":
        have, what = node_memory()
        return (have, what) if have else None
    return int(limit), "--memory-limit"


def refuse(est: dict[str, int], args, world: int) -> None:
    """UsageError when ranks per node x this rank's estimate exceeds the budget."""
    have = budget(args)
    if have is None:
        return
    node, what = have
    local, source = ranks_per_node(world)
    need = total(est)
    if local * need <= node:
        return
    part, size = largest_part(est)
    raise cli.UsageError(
        f"--compute {args.compute} needs about {gib(need)} per rank (largest part: {part} "
        f"{gib(size)}) x {local} rank(s) per node ({source}) = {gib(local * need)}, more than "
        f"this node's {gib(node)} ({what}): use fewer ranks per node, a smaller model, batch "
        "or sequence, or --memory-limit off to run anyway"
    )


def by_label(job, ranks: Iterable[int]) -> dict[str, dict[str, int]]:
    """The estimate of the first of `ranks` with each label (stage, shard): label -> parts."""
    out: dict[str, dict[str, int]] = {}
    for r in ranks:
        name = job.label(r)
        if name not in out:
            out[name] = job.memory_estimate(r)
    return out


def dry_run_lines(estimates: dict[str, dict[str, int]], compute: str) -> list[str]:
    """The dry run's report: one line per distinct estimate, and what the node holds."""
    if not estimates:
        return []
    lines, seen = [], {}
    for name, est in estimates.items():
        seen.setdefault(tuple(est.items()), []).append(name)
    for parts, names in seen.items():
        where = ", ".join(names) if len(names) <= 3 else f"{names[0]} .. {names[-1]} ({len(names)})"
        prefix = "memory per rank" if len(seen) == 1 else f"memory per rank, {where}"
        lines.append(f"{prefix} (--compute {compute}, estimated): {describe(dict(parts))}")
    node, what = node_memory()
    worst = max(total(e) for e in estimates.values())
    if node:
        lines.append(
            f"this node's {gib(node)} ({what}) holds {node // worst} rank(s) of "
            f"{gib(worst)}; a real run refuses more per node (--memory-limit)"
        )
    return lines


def refuse_rank(job, args, rank: int, world: int) -> None:
    """The real run's check (runner.main, before the runtime is built): this rank's
    estimate; ranks that differ agree through mpi.agree, the lowest failing one prints."""
    if job.memory is not None:
        refuse(job.memory_estimate(rank), args, world)
