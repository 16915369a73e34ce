import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import launch  # noqa: E402 (needs the path above)

# Every mpiexec a test starts, directly or through the sweep, gets what this venv's launcher
# needs (tests/launch.py: nothing for MPICH; root and oversubscription for Open MPI).
os.environ.update(launch.launcher_env())
