"""What produced a result: schema and package version, commit, hosts, launcher; --version.

Every JSON result carries these fields (README, "JSON results"; proxies/schema/
result.schema.json) so a number found months later says which code, which nodes and which
launcher made it. Fields are only ever added to results, never renamed (sweep report and
benchmarks read results of every version).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
from functools import cache

# Bumped when a field of a result changes meaning or disappears (adding one does not).
SCHEMA_VERSION = 1
DIST_NAME = "mpi-dl-proxies"  # the PyPI name: `proxies` there is an unrelated package
HOSTS_LISTED = 64  # at most this many node names in `hosts`; `host_count` counts them all


def version() -> str:
    """The package version (one source: proxies.__version__, which pyproject reads)."""
    import proxies

    return proxies.__version__


@cache
def commit() -> str | None:
    """`git describe` of the checkout the package runs from, None when installed (no .git
    beside the package) or when git is missing or fails. Asked once per process."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if not os.path.exists(os.path.join(root, ".git")):  # a worktree's .git is a file
        return None
    try:
        out = subprocess.run(
            ["git", "-C", root, "describe", "--always", "--dirty", "--tags"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    text = out.stdout.strip()
    return text if out.returncode == 0 and text else None


def version_text() -> str:
    """'mpi-dl-proxies 0.1.0' plus '(commit X)' when run from a checkout."""
    c = commit()
    return f"{DIST_NAME} {version()}" + (f" (commit {c})" if c else "")


def launcher(env: dict[str, str] | None = None) -> str | None:
    """The launcher that started this process, from the variables it exports; None for a
    process started without one (a singleton, a dry run).

    The launcher's own variables are checked before Slurm's: an mpiexec inside a batch
    script inherits SLURM_PROCID from the script, while srun sets SLURM_STEP_ID per step.
    """
    env = os.environ if env is None else env
    if "HYDI_CONTROL_FD" in env or ("PMI_FD" in env and "MPI_LOCALNRANKS" in env):
        return "hydra"  # MPICH's mpiexec (and Intel MPI's, which is hydra too)
    if "OMPI_COMM_WORLD_SIZE" in env:
        # Open MPI 5 launches through PRRTE (prterun, mpirun); 4.x through ORTE (orterun).
        return "prterun" if any(k.startswith("PRTE_") for k in env) else "orterun"
    if "PALS_RANKID" in env:
        return "pals"  # HPE Cray PALS mpiexec
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        return "srun"
    if "PMIX_RANK" in env:
        return "pmix"  # a PMIx launcher we do not know by name
    return None


def host_fields(names: list[str]) -> dict:
    """`hosts`: the node names in order of their first rank, at most HOSTS_LISTED of them;
    `host_count`: how many there are."""
    unique = list(dict.fromkeys(names))
    return {"hosts": unique[:HOSTS_LISTED], "host_count": len(unique)}


def fields(MPI=None, comm=None) -> dict:
    """The provenance fields of a result. With MPI and a communicator this is collective
    (every rank of `comm` must call it: rank 0 gathers the node names; the other ranks get
    {}); without, the hosts are this process's own (a dry run, a one-process tool)."""
    if comm is not None:
        names = comm.gather(MPI.Get_processor_name(), root=0)
        if comm.rank != 0:
            return {}
    else:
        names = [socket.gethostname()]
    return {
        "schema_version": SCHEMA_VERSION,
        "version": version(),
        "commit": commit(),
        **host_fields(names),
        "launcher": launcher(),
    }


class _Version(argparse.Action):
    """--version: the version text is computed when asked (git runs then, not at every
    parse), printed once per job (rank 0 under a launcher), exit 0."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, **kw):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        from proxies.core import cli

        if cli.env_rank() == 0:
            print(version_text(), flush=True)
        parser.exit(0)


def add_version(p: argparse.ArgumentParser) -> None:
    """Give the parser --version (every entry point has one)."""
    p.add_argument(
        "--version",
        action=_Version,
        help=f"print the {DIST_NAME} version (and git commit in a checkout) and exit",
    )
