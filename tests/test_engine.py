"""The engine's collectives against NumPy on 1, 2, 3 and 4 ranks (driver: engine_driver.py)."""

import os
import sys

import pytest
from launch import ROOT, mpiexec, run

DRIVER = os.path.join(ROOT, "tests", "engine_driver.py")


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("per_rank,wait", [(1, "spin"), (1000, "yield"), (0, "spin")])
def test_collectives_equal_numpy(ranks, per_rank, wait):
    r = run([mpiexec(), "-n", str(ranks), sys.executable, DRIVER, str(per_rank), wait], 90)
    assert r.returncode == 0, r.stderr
    assert "engine collectives OK" in r.stdout
