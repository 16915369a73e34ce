"""MPICH's node segment in /dev/shm: unlinked once every local rank has mapped it, so a run
that ends killed leaves no file behind (each kept 2-4 MiB of memory in /dev/shm)."""

import os
import sys

import pytest
from launch import flavour, mpiexec, run

SCRIPT = """
import os, signal, sys
from proxies.core import mpi
MPI = mpi.init()
maps = open("/proc/self/maps").read().splitlines()
mine = sorted({l.split(maxsplit=5)[-1] for l in maps if "/dev/shm/mpich_shm_" in l})
with open(os.path.join(sys.argv[2], str(MPI.COMM_WORLD.rank)), "w") as f:
    f.write("|".join(mine))
MPI.COMM_WORLD.Barrier()
if MPI.COMM_WORLD.rank == 1 and sys.argv[1] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)  # fail-stop, as --kill-rank
MPI.COMM_WORLD.Barrier()
"""

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(flavour() != "mpich", reason="MPICH's segment (Open MPI's left alone)"),
    pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm"),
]


@pytest.mark.parametrize("end", ["normal", "kill"])
def test_the_node_segment_has_no_name_once_mapped(end, tmp_path):
    r = run([mpiexec(), "-n", "2", sys.executable, "-c", SCRIPT, end, str(tmp_path)], timeout=60)
    if end == "normal":
        assert r.returncode == 0, r.stderr
    else:
        assert r.returncode != 0
    lines = [(tmp_path / str(rank)).read_text() for rank in (0, 1)]
    mapped = {p for line in lines for p in line.split("|") if p}
    # both ranks map the same segment, already without a name ("(deleted)" in their maps)
    assert mapped and all(p.endswith("(deleted)") for p in mapped), mapped
    names = {p.split()[0] for p in mapped}
    assert not any(os.path.exists(p) for p in names)
