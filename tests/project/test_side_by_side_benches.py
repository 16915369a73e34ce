"""The side-by-side benchmarks (benchmarks/alltoall_place.py, huge_pages.py): every way
timed on 2 ranks, one row per size, a positive time in every cell; bad sizes are one line
and exit 2."""

import os
import sys

import pytest
from launch import ROOT, mpiexec, run

# script -> (the ways' columns, a line its output ends with)
BENCHES = {
    "alltoall_place.py": (6, None),
    "huge_pages.py": (4, "# on huge pages per rank at the end"),
}


@pytest.mark.mpi
@pytest.mark.parametrize("script", sorted(BENCHES))
def test_two_ranks_time_every_way_at_each_size(script):
    path = os.path.join(ROOT, "benchmarks", script)
    r = run([mpiexec(), "-n", "2", sys.executable, path, "0.0625", "1", "--calls", "2"], 120)
    assert r.returncode == 0, r.stderr
    ways, last = BENCHES[script]
    rows = [line.split() for line in r.stdout.splitlines() if line[:1] == " "]
    assert [row[0] for row in rows] == ["0.0625", "1"]
    assert all(len(row) == 1 + ways and all(float(x) > 0 for x in row[1:]) for row in rows)
    assert last is None or r.stdout.splitlines()[-1].startswith(last), r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(BENCHES))
@pytest.mark.parametrize("argv", [["0"], ["-3"], ["1", "--calls", "0"], ["many"]])
def test_bad_sizes_are_one_line_and_exit_2(script, argv):
    r = run([sys.executable, os.path.join(ROOT, "benchmarks", script), *argv], 60)
    assert r.returncode == 2 and r.stderr.count("\n") <= 3 and "Traceback" not in r.stderr
