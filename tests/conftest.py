import os
import sys

# One BLAS thread for the tests that run in this process: they check results, not speed, and
# on a shared 2-core machine OpenBLAS's threads (spinning between calls) made the GPT-3 shard
# tests 3x slower in wall time under load (7 s against 24 s for two of them, load 8). OpenBLAS
# reads the variables once, when NumPy loads; they are put back at once, so every process a
# test starts (a proxy under mpiexec, a CLI) sees the environment it would without this and
# chooses its own threads (proxies/core/threads.py), and so does `import proxies` here.
_BLAS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS")
if "numpy" not in sys.modules:
    _saved = {v: os.environ.get(v) for v in _BLAS}
    os.environ.update(dict.fromkeys(_BLAS, "1"))
    import numpy  # noqa: F401, E402 (loads OpenBLAS with one thread)

    for _var, _value in _saved.items():
        if _value is None:
            del os.environ[_var]
        else:
            os.environ[_var] = _value

sys.path.insert(0, os.path.dirname(__file__))

import launch  # noqa: E402 (needs the path above)

# Every mpiexec a test starts, directly or through the sweep, gets what this venv's launcher
# needs (tests/launch.py: nothing for MPICH; root and oversubscription for Open MPI).
os.environ.update(launch.launcher_env())


def pytest_configure(config) -> None:
    # `pytest -m "not mpi and not slow"`: the seconds-long inner loop (README, "Development").
    config.addinivalue_line("markers", "mpi: starts MPI (mpiexec, or a proxy run that inits MPI)")
    config.addinivalue_line(
        "markers",
        "one_mpi: what it checks does not depend on the MPI library (a schedule, a data file,"
        " an algorithm of ours built on the calls other tests run): CI's Open MPI run skips it",
    )
    config.addinivalue_line(
        "markers", "slow: starts a process (a CLI end to end, a build) or runs for seconds"
    )


def pytest_collection_modifyitems(config, items) -> None:
    """Refuse a test that reaches tests/launch.py's mpirun or mpiexec without the `mpi`
    marker, or starts any other process without `slow` (or `mpi`): tests/markers.py reads
    the module's source, so the marking cannot rot."""
    import markers
    import pytest

    here = os.path.dirname(os.path.abspath(__file__))
    unmarked, unslow = [], []
    for item in items:
        path = str(getattr(item, "path", "") or item.fspath)
        # every test module under tests/, its package folders included (tests/gpt2/...)
        inside = os.path.abspath(path).startswith(here + os.sep)
        if not inside or not path.endswith(".py") or not hasattr(item, "originalname"):
            continue
        marked = {m.name for m in item.iter_markers()}
        if item.originalname in markers.launching_in(path) and "mpi" not in marked:
            unmarked.append(item.nodeid)
        elif item.originalname in markers.spawning_in(path) and not marked & {"mpi", "slow"}:
            unslow.append(item.nodeid)
    if unmarked:
        raise pytest.UsageError(
            "tests that start MPI through tests/launch.py need @pytest.mark.mpi (or a module "
            "pytestmark): " + ", ".join(unmarked)
        )
    if unslow:
        raise pytest.UsageError(
            "tests that start a process (tests/launch.py's run, subprocess) need "
            "@pytest.mark.slow, or mpi if it starts MPI (or a module pytestmark): "
            + ", ".join(unslow)
        )
