"""BLAS threads: chosen per rank, unless the user chose; a parent's choice is not the user's."""

import json
import subprocess
import sys

import pytest
from launch import mpirun

PROBE = "import proxies, os, json; print(json.dumps(dict(os.environ)))"


def child_env(env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True)
    return json.loads(out.stdout)


@pytest.mark.slow
def test_parent_choice_is_recomputed_and_user_choice_kept():
    import os

    from proxies.core import threads

    base = {k: v for k, v in os.environ.items() if k not in threads.BLAS_VARS}
    base.pop(threads.AUTO_MARK, None)
    # What a parent that imported proxies exports, for 8 ranks on this node.
    parent = {
        **base,
        **dict.fromkeys(threads.BLAS_VARS, "2"),
        threads.AUTO_MARK: "2",
        "MPI_LOCALNRANKS": str(8 * threads.cores_available()),
    }
    assert child_env(parent)["OMP_NUM_THREADS"] == "1"
    user = {**base, "OMP_NUM_THREADS": "3", "MPI_LOCALNRANKS": "64"}
    assert child_env(user)["OMP_NUM_THREADS"] == "3"


@pytest.mark.mpi
def test_ranks_launched_from_a_python_that_imported_proxies_get_one_thread(tmp_path):
    # This test process imported proxies (1 rank: threads = cores); 8 ranks must not inherit it.
    out = tmp_path / "r.json"
    r = mpirun(
        8,
        "proxies.gpt2",
        "2",
        "2",
        "4",
        "--seq-len",
        "16",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--quiet",
        "--json",
        str(out),
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["blas_threads"] == 1
