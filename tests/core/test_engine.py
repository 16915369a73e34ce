"""The engine's collectives against NumPy on 1, 2, 3 and 4 ranks (driver: engine_driver.py)."""

import os
import sys

import pytest
from launch import ROOT, mpiexec, run

pytestmark = pytest.mark.mpi  # every test here starts MPI

DRIVER = os.path.join(ROOT, "tests", "engine_driver.py")


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize(
    "per_rank,wait,extra", [(1, "spin", 0), (1000, "yield", 3), (0, "spin", 0), (5, "spin", 1)]
)
def test_collectives_equal_numpy(ranks, per_rank, wait, extra):
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, DRIVER, str(per_rank), wait, str(extra)]
    r = run(cmd, 90)
    assert r.returncode == 0, r.stderr
    assert "engine collectives OK" in r.stdout


@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize(
    "wire,held,alg",
    [
        ("bfloat16", "stage", "mpi"),
        ("bfloat16", "direct", "mpi"),
        ("float16", "stage", "mpi"),
        ("bfloat16", "stage", "ring"),
        ("bfloat16", "direct", "rhd"),
    ],
)
def test_16_bit_wire_dtypes_equal_numpy(ranks, wire, held, alg):
    """bf16/fp16 on the wire: float32 buffers staged or 16-bit ones sent as they are,
    sums within the wire dtype's rounding, point-to-point bit for bit, --check on."""
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, DRIVER, "1000", "yield", "3"]
    r = run(cmd + [wire, held, alg], 90)
    assert r.returncode == 0, r.stderr
    assert "engine collectives OK" in r.stdout
