"""Messages and allreduces on buffers from np.zeros against buffers on huge pages (what the
proxies and calibrate allocate: proxies.core.pages), side by side in one run.

    mpiexec -n R python benchmarks/huge_pages.py [MiB ...] [--calls N]

Per size (default 0.25 1 2 3.4 8 MiB): the ranks exchange that many bytes in pairs (0,1),
(2,3) ... both ways at once (Isend + Irecv, as a halo or a pipeline send/receive pair), and
all ranks run an in-place MPI_Allreduce of that many bytes; each on np.zeros buffers
(NumPy advises huge pages only from 4 MiB up) and on proxies.core.pages buffers. Before
every call each rank writes a 64 MiB array, so the buffers come from memory as in a run,
not from the caches. Each way `--calls` times (15) after 3 untimed, each call after a
barrier and timed by its slowest rank; the median, in microseconds. The ways alternate
call by call, so load that drifts touches them alike. The last line says how much of the
process's memory the kernel put on huge pages (AnonHugePages).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from side_by_side import medians  # noqa: E402  (beside this file)

WAYS = ("exchange np.zeros", "exchange pages", "allreduce np.zeros", "allreduce pages")
WARMUP = 3
FLUSH_BYTES = 64 << 20


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="huge_pages", description=__doc__.splitlines()[0])
    p.add_argument("mib", nargs="*", type=float, default=[0.25, 1, 2, 3.4, 8])
    p.add_argument("--calls", type=int, default=15)
    args = p.parse_args(argv)
    if args.calls < 1 or not all(0 < x <= 1024 for x in args.mib):
        p.error("sizes in (0, 1024] MiB and --calls >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import numpy as np
    from mpi4py import MPI

    from proxies.core import pages

    comm = MPI.COMM_WORLD
    r, n = comm.rank, comm.size
    peer = r ^ 1 if (r ^ 1) < n else None  # the odd rank out of an odd world only reduces
    flush = np.ones(FLUSH_BYTES // 4, np.float32)
    if r == 0:
        library = " ".join(MPI.Get_library_version().splitlines()[0].split())
        on = "on" if pages.enabled() else "off (PROXIES_HUGE_PAGES)"
        print(f"# {n} ranks: median of {args.calls} calls after {WARMUP}, slowest rank, us; "
              f"cold buffers; huge pages {on} · {library}")  # fmt: skip
        print("#" + f"{'MiB':>7}  " + "  ".join(f"{w:>18}" for w in WAYS))
    for mib in args.mib:
        count = max(int(mib * (1 << 20)) // 4, 1)
        made = {"np.zeros": np.zeros, "pages": pages.zeros}
        bufs = {k: (f(count, np.float32), f(count, np.float32)) for k, f in made.items()}

        def exchange(send, recv):
            if peer is not None:
                MPI.Request.Waitall([comm.Isend(send, peer, 7), comm.Irecv(recv, peer, 7)])

        calls = {
            f"exchange {k}": (lambda s=s, v=v: exchange(s, v)) for k, (s, v) in bufs.items()
        } | {
            f"allreduce {k}": (lambda v=v: comm.Allreduce(MPI.IN_PLACE, v))
            for k, (_, v) in bufs.items()
        }
        ordered = {w: calls[w] for w in WAYS}
        took = medians(comm, MPI, ordered, args.calls, WARMUP, lambda: np.add(flush, 1, out=flush))
        if r == 0:
            cells = "  ".join(f"{took[w] * 1e6:18.1f}" for w in WAYS)
            print(f"{count * 4 / (1 << 20):8.3g}  {cells}", flush=True)
    huge = pages.huge_bytes()
    every = comm.gather(huge, root=0)
    if r == 0:
        known = [h for h in every if h is not None]
        told = f"{min(known) >> 20}-{max(known) >> 20} MiB" if known else "not known here"
        print(f"# on huge pages per rank at the end: {told}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
