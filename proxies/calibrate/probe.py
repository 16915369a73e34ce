"""Is the machine still in the state it was calibrated in? A second's check between runs.

    mpiexec -n 2 python -m proxies.calibrate.probe [--machine FILE] [--json OUT]

Ranks 0 and 1 measure calibrate's `state` figures: an in-place 1 MiB MPI_Allreduce on a
cold buffer, the same on the buffer the previous call wrote (as a proxy's comm-only run
does, again and again), and a 64 MiB copy on both at once. Cloud VMs move these: on the
2-vCPU VM this project is developed on, the same-buffer ratio sat at 1.3 or at 2.6 for
tens of seconds to minutes at a time (and GPT-3's tensor-parallel comm-only point at 8.8
or 22.9 ms with it), and the copy rate at 22 or 44 GB/s, independently. A prediction made from a
file calibrated in one state misses a run made in the other by as much, whatever the
model. With --machine, each figure is printed beside the file's, and the line after it
names the one that moved most.
"""

from __future__ import annotations

import json

from proxies.core import cli

PROG = "proxies.calibrate.probe"


def parser() -> cli.Parser:
    p = cli.Parser(
        prog="python -m proxies.calibrate.probe",
        description="Measure calibrate's state figures again (a 1 MiB allreduce on a cold "
        "buffer and on the one the previous call wrote, a copy's rate) to tell whether the "
        "machine is in the state a machine file was calibrated in.",
    )
    p.add_argument("--machine", metavar="FILE", help="a calibrated machine file to compare with")
    p.add_argument("--json", metavar="OUT", help="also write the figures to OUT")
    return p


def calibrated_state(path: str) -> dict | None:
    """The state figures a machine file was calibrated at (None: not measured there)."""
    from proxies.core import machine as machines

    d = machines.load(path).calibration.get("state")
    return d if isinstance(d, dict) else None


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
                then = calibrated_state(args.machine)
            except Exception as e:  # the loader's one-line message names the file and key
                problem = str(e)
            if problem is None and then is None:
                problem = f"{args.machine}: calibration.state: missing (calibrate it again)"
    mpi.agree(comm, problem, PROG)
    from proxies.calibrate import state
    from proxies.calibrate.describe import state_text

    duo = comm.Split(0 if r < 2 else MPI.UNDEFINED, r)
    now = state.state(duo, MPI) if r < 2 else None
    if duo != MPI.COMM_NULL:
        duo.Free()
    comm.Barrier()
    if r == 0:
        print(state_text(now, then), flush=True)
        if then is not None:
            name, factor = state.worst_drift(now, then)
            print(f"moved most: {name}, x{factor:.2g} from {args.machine}'s", flush=True)
            now = now | {"calibrated": then, "drift": state.drift(now, then)}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(now, f, indent=1)
    return 0


def entry() -> None:
    cli.run_main(PROG, main)


if __name__ == "__main__":
    entry()
