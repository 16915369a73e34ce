"""MPI's own allreduce measured beside the predictor's price of it, around glibc's mmap
threshold: is the machine file's `fresh_memory` right?

    mpiexec -n 2 python benchmarks/predict_allreduce.py MACHINE.yaml [MiB ...]

Per size (default 16 32 64 128 MiB per rank): an in-place float32 MPI_Allreduce, one
warm-up, the median of 5 calls each timed by its slowest rank; the prediction on MACHINE
for this many ranks on one node (its `mpi:` table, MPICH's defaults else), with and without
its `fresh_memory` section.
"""

from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        print(__doc__.strip().splitlines()[3].strip(), file=sys.stderr)
        return 2
    import numpy as np
    from mpi4py import MPI

    from proxies.core import machine as M
    from proxies.core.prediction import collective_seconds

    comm = MPI.COMM_WORLD
    try:
        m = M.load(sys.argv[1])
        sizes = [int(x) for x in sys.argv[2:]] or [16, 32, 64, 128]
    except (M.MachineError, ValueError) as e:
        if comm.rank == 0:
            print(f"predict_allreduce: {e}", file=sys.stderr)
        return 2
    plain = M.from_mapping({**M.to_mapping(m), "fresh_memory": None}, m.source)
    n = comm.size
    for mib in sizes:
        buf = np.zeros(mib << 18, dtype=np.float32)
        comm.Allreduce(MPI.IN_PLACE, buf)
        times = []
        for _ in range(5):
            comm.Barrier()
            t0 = MPI.Wtime()
            comm.Allreduce(MPI.IN_PLACE, buf)
            times.append(comm.allreduce(MPI.Wtime() - t0, op=MPI.MAX))
        if comm.rank == 0:
            t = statistics.median(times)
            p = collective_seconds(m, "allreduce", "mpi", n, buf.size, "float32", n)
            p0 = collective_seconds(plain, "allreduce", "mpi", n, buf.size, "float32", n)
            print(
                f"{mib:5d} MiB  measured {t * 1e3:7.1f} ms (calls {min(times) * 1e3:.1f} - "
                f"{max(times) * 1e3:.1f})  predicted {p * 1e3:7.1f} ms ({100 * (p / t - 1):+.0f}%)"
                f"  without fresh_memory {p0 * 1e3:7.1f} ms ({100 * (p0 / t - 1):+.0f}%)",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
