"""proxies.collectives: every algorithm against NumPy on 1..8 ranks (driver:
collectives_driver.py, which states the tolerances), the trees and blocks without MPI,
and the benchmark's table, JSON and bad-input handling."""

import json
import os
import sys

import numpy as np
import pytest
from launch import ROOT, mpiexec, run

from proxies.core.collectives import ALGORITHMS, bounds, dbtree

DRIVER = os.path.join(ROOT, "tests", "collectives_driver.py")
KEYS = {"algorithm", "bytes", "count", "time_us", "algbw", "busbw", "wrong"}


def test_blocks_are_array_split():
    for n in range(1, 10):
        for count in range(0, 3 * n + 2):
            off = bounds(count, n)
            sizes = [b.size for b in np.array_split(np.arange(count), n)]
            assert np.diff(off).tolist() == sizes and off[-1] == count


@pytest.mark.parametrize("n", range(1, 40))
def test_double_binary_trees(n):
    leaves = []
    for t in (0, 1):
        tree = [dbtree.trees(n, r)[t] for r in range(n)]
        roots = [r for r in range(n) if tree[r][0] < 0]
        assert len(roots) == 1
        for r, (parent, children) in enumerate(tree):
            assert len(children) <= 2 and all(tree[c][0] == r for c in children)
            assert parent < 0 or r in tree[parent][1]
        seen = roots[:]
        for r in seen:
            seen += tree[r][1]
        assert sorted(seen) == list(range(n)), "not spanning"
        leaves.append({r for r in range(n) if not tree[r][1]})
    if n >= 3:
        assert not leaves[0] & leaves[1], "a rank is a leaf in both trees"
    if n % 2 == 0:
        assert leaves[0] | leaves[1] == set(range(n)), "complementary trees"


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", range(1, 9))
def test_algorithms_equal_numpy(ranks):
    # "mpi,yield": every case once with MPI's Waitall and once with the engine's Waiter
    r = run([mpiexec(), "-n", str(ranks), sys.executable, DRIVER, "mpi,yield"], 150)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"collectives OK on {ranks} ranks" in r.stdout


@pytest.mark.mpi
def test_benchmark_table_and_json(tmp_path):
    out = tmp_path / "rows.json"
    args = ["-b", "8", "-e", "32K", "-f", "8", "-n", "2", "-w", "1", "--check"]
    cmd = [mpiexec(), "-n", "3", sys.executable, "-m", "proxies", "collectives", *args]
    r = run([*cmd, "--ranks-per-node", "2", "--json", str(out)], 150)
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())
    assert len(rows) == 5 * len(ALGORITHMS)  # sizes 8, 64, 512, 4K, 32K
    assert [row["algorithm"] for row in rows[: len(ALGORITHMS)]] == list(ALGORITHMS)
    for row in rows:
        assert KEYS <= set(row)
        assert row["wrong"] == 0 and row["count"] * 4 == row["bytes"]
        assert row["busbw"] == pytest.approx(row["algbw"] * 2 * 2 / 3)
    table = [line for line in r.stdout.splitlines() if not line.startswith("#")]
    assert len(table) == len(rows)
    assert "# average busbw" in r.stdout and "vs mpi" in r.stdout


BAD = [
    (["-a", "ring,fast"], "unknown algorithm 'fast'"),
    (["-b", "12Q"], "-b/--minbytes"),
    (["-b", "1M", "-e", "1K"], "smaller than -b/--minbytes"),
    (["-f", "1"], "integer >= 2"),
    (["-d", "float8"], "invalid choice: 'float8'"),
    (["--ranks-per-node", "0"], "positive integer"),
    (["-n", "0"], "positive integer"),
]


@pytest.mark.mpi
@pytest.mark.parametrize("args,words", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_input_is_one_line_and_exit_2(args, words):
    r = run([mpiexec(), "-n", "2", sys.executable, "-m", "proxies.collectives", *args], 60)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("proxies.collectives: error: ")
    assert words in lines[0] and r.stdout == ""


def test_every_algorithm_is_an_allreduce_option():
    from proxies.core import cli
    from proxies.core.collectives import ALGORITHMS

    p = cli.Parser()
    cli.add_common(p)
    (action,) = [a for a in p.arguments if a.dest == "allreduce"]
    assert set(action.choices) == set(ALGORITHMS) and action.choices[0] == action.default


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_benchmark_checks_16_bit_sums(tmp_path, dtype):
    """bf16/fp16 through every algorithm and MPI's (a user-defined float32-accumulating
    sum): the checked small integers come out exact at 3 ranks."""
    out = tmp_path / "rows.json"
    args = ["-b", "2", "-e", "64K", "-f", "32", "-n", "2", "-w", "1", "-d", dtype, "--check"]
    cmd = [mpiexec(), "-n", "3", sys.executable, "-m", "proxies", "collectives", *args]
    r = run([*cmd, "--json", str(out)], 150)
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())
    assert len(rows) == 4 * len(ALGORITHMS)  # sizes 2, 64, 2K, 64K
    for row in rows:
        assert row["wrong"] == 0 and row["count"] * 2 == row["bytes"] and row["dtype"] == dtype
