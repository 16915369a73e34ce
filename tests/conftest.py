import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import launch  # noqa: E402 (needs the path above)

# Every mpiexec a test starts, directly or through the sweep, gets what this venv's launcher
# needs (tests/launch.py: nothing for MPICH; root and oversubscription for Open MPI).
os.environ.update(launch.launcher_env())


def pytest_configure(config) -> None:
    # `pytest -m "not mpi"`: the seconds-long inner loop (README, "Development").
    config.addinivalue_line("markers", "mpi: starts MPI (mpiexec, or a proxy run that inits MPI)")
    config.addinivalue_line("markers", "slow: an end-to-end subprocess run of a CLI, seconds")


def pytest_collection_modifyitems(config, items) -> None:
    """Refuse a test that reaches tests/launch.py's mpirun or mpiexec without the `mpi`
    marker (tests/markers.py reads the module's source), so the marking cannot rot."""
    import markers
    import pytest

    here = os.path.dirname(os.path.abspath(__file__))
    unmarked = []
    for item in items:
        path = str(getattr(item, "path", "") or item.fspath)
        # every test module under tests/, its package folders included (tests/gpt2/...)
        inside = os.path.abspath(path).startswith(here + os.sep)
        if not inside or not path.endswith(".py") or not hasattr(item, "originalname"):
            continue
        if item.originalname in markers.launching_in(path) and not item.get_closest_marker("mpi"):
            unmarked.append(item.nodeid)
    if unmarked:
        raise pytest.UsageError(
            "tests that start MPI through tests/launch.py need @pytest.mark.mpi (or a module "
            "pytestmark): " + ", ".join(unmarked)
        )
