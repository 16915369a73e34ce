"""benchmarks/huge_pages.py: exchanges and allreduces on np.zeros and on pages buffers timed
side by side on 2 ranks, one row per size; bad sizes are one line and exit 2."""

import os
import sys

import pytest
from launch import ROOT, mpiexec, run

SCRIPT = os.path.join(ROOT, "benchmarks", "huge_pages.py")


@pytest.mark.mpi
def test_two_ranks_time_every_way_at_each_size():
    r = run([mpiexec(), "-n", "2", sys.executable, SCRIPT, "0.0625", "1", "--calls", "2"], 120)
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if line[:1] == " "]
    assert [row[0] for row in rows] == ["0.0625", "1"]
    assert all(len(row) == 5 and all(float(x) > 0 for x in row[1:]) for row in rows), r.stdout
    assert "on huge pages per rank at the end" in r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["0"], ["-3"], ["1", "--calls", "0"], ["many"]])
def test_bad_sizes_are_one_line_and_exit_2(argv):
    r = run([sys.executable, SCRIPT, *argv], 60)
    assert r.returncode == 2 and r.stderr.count("\n") <= 3 and "Traceback" not in r.stderr
