"""Is the machine in the state calibrate measured? A second's check between runs.

    mpiexec -n 2 python -m proxies.calibrate.probe [--machine FILE] [--json OUT]

Ranks 0 and 1 time an in-place 1 MiB MPI_Allreduce on the buffer the previous call wrote
against one on a cold buffer (calibrate's `reread`). Where the caches of two cores hand
lines to each other slowly, the same buffer takes longer than a cold one; the proxies'
comm-only runs reduce the same buffers again and again, so their iteration moves with
it. On the 2-vCPU VM this project is developed on the ratio sat at 1.3 or at 2.6 for
tens of seconds at a time, and GPT-3's tensor-parallel point with it at 8.8 or 22.9 ms.
With --machine, the line also gives the ratio the file was calibrated at.
"""

from __future__ import annotations

import json

from proxies.core import cli

PROG = "proxies.calibrate.probe"


def parser() -> cli.Parser:
    p = cli.Parser(
        prog="python -m proxies.calibrate.probe",
        description="Time a 1 MiB allreduce on the buffer the previous one wrote against a "
        "cold one (calibrate's reread), to tell whether the machine is in the state a "
        "machine file was calibrated in.",
    )
    p.add_argument("--machine", metavar="FILE", help="a calibrated machine file to compare with")
    p.add_argument("--json", metavar="OUT", help="also write the figures to OUT")
    return p


def calibrated_ratio(path: str) -> float | None:
    """The reread ratio a machine file was calibrated at (None: not measured there)."""
    from proxies.core import machine as machines

    d = machines.load(path).calibration.get("reread")
    return float(d["ratio"]) if isinstance(d, dict) and "ratio" in d else None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from proxies.core import mpi

    MPI = mpi.init()
    comm = MPI.COMM_WORLD
    mpi.abort_on_exception(comm, PROG)
    r = comm.rank
    problem, then = None, None
    if r == 0:
        if comm.size < 2:
            problem = "needs 2 or more ranks (ranks 0 and 1 measure)"
        elif args.json:
            problem = cli.output_problem(args.json, "--json")
        if problem is None and args.machine:
            try:
                then = calibrated_ratio(args.machine)
            except Exception as e:  # the loader's one-line message names the file and key
                problem = str(e)
    mpi.agree(comm, problem, PROG)
    from proxies.calibrate import measure
    from proxies.calibrate.describe import reread_text

    pair = comm.Split(0 if r < 2 else MPI.UNDEFINED, r)
    out = measure.reread(pair, MPI) if r < 2 else None
    if pair != MPI.COMM_NULL:
        pair.Free()
    comm.Barrier()
    if r == 0:
        if then is not None:
            out["calibrated_ratio"] = then
        line = reread_text(out)
        if then is not None:
            line += f" (x{then:.2g} when {args.machine} was calibrated)"
        print(line, flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    return 0


def entry() -> None:
    cli.run_main(PROG, main)


if __name__ == "__main__":
    entry()
