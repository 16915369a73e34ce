"""MPI's all-to-all in place against out of place, side by side in one run: what the engine
called before (MPI_IN_PLACE) and what it calls now (a send and a receive buffer, as
frameworks' all_to_all_single and the C++ proxies do), blocking and non-blocking, and out
of place from a send buffer never written (the proxies' send buffers without real compute:
its pages all the zero page; calibrate's zero_pages.alltoall).

    mpiexec -n R python benchmarks/alltoall_place.py [MiB per rank ...] [--calls N]

Per size (default 1 16 32 64 MiB per rank, the whole array in R blocks): each way `--calls`
times (15) after 3 untimed, each call after a barrier and timed by its slowest rank; the
median. The ways alternate call by call, so load that drifts touches them alike. A local
copy of the whole array (numpy) is the scale.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from side_by_side import medians  # noqa: E402  (beside this file)

WAYS = (
    "in place",
    "in place, non-blocking",
    "out of place",
    "out of place, non-blocking",
    "out of place, untouched send",
    "copy of the array",
)
WARMUP = 3


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="alltoall_place", description=__doc__.splitlines()[0])
    p.add_argument("mib", nargs="*", type=float, default=[1, 16, 32, 64])
    p.add_argument("--calls", type=int, default=15)
    args = p.parse_args(argv)
    if args.calls < 1 or not all(0 < x <= 4096 for x in args.mib):
        p.error("sizes in (0, 4096] MiB per rank and --calls >= 1")
    return args


def ways(comm, MPI, np, buf, recv, never, copy) -> dict:
    """Each way's call on this size's buffers."""
    return {
        "in place": lambda: comm.Alltoall(MPI.IN_PLACE, buf),
        "in place, non-blocking": lambda: comm.Ialltoall(MPI.IN_PLACE, buf).Wait(),
        "out of place": lambda: comm.Alltoall(buf, recv),
        "out of place, non-blocking": lambda: comm.Ialltoall(buf, recv).Wait(),
        "out of place, untouched send": lambda: comm.Alltoall(never, recv),
        "copy of the array": lambda: np.copyto(copy, buf),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    n = comm.size
    if comm.rank == 0:
        library = " ".join(MPI.Get_library_version().splitlines()[0].split())
        print(f"# MPI_Alltoall on {n} ranks: median of {args.calls} calls after {WARMUP}, "
              f"slowest rank, ms · {library}")  # fmt: skip
        print(f"{'MiB per rank':>12}  " + "  ".join(f"{w:>14}" for w in WAYS))
    for mib in args.mib:
        count = max(int(mib * (1 << 20)) // 4 // n, 1) * n
        buf = np.ones(count, np.float32)  # written: real pages
        recv = np.ones(count, np.float32)
        never = np.zeros(count, np.float32)  # never written: the zero page
        copy = np.ones(count, np.float32)
        calls = ways(comm, MPI, np, buf, recv, never, copy)
        took = medians(comm, MPI, {w: calls[w] for w in WAYS}, args.calls, WARMUP)
        if comm.rank == 0:
            cells = "  ".join(f"{took[w] * 1e3:14.3f}" for w in WAYS)
            print(f"{count * 4 / (1 << 20):12.3g}  {cells}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
