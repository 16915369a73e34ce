"""python -m proxies.collectives as nccl-tests: every op's rows checked against NumPy at 3, 4
and 5 ranks (the bench's -c, whose counting is itself tested here on corrupted buffers), the
bus-bandwidth factors and sizes per op, the flags, bad combinations (exit 2, one line), -J
rows and -I per-iteration times, predictions against hand arithmetic."""

import json
import os
import sys

import numpy as np
import pytest
from launch import ROOT, mpiexec, mpirun, run

from proxies.collectives import bench, bench_ops
from proxies.collectives.bench_ops import OPS
from proxies.core import cli

PROG = "proxies.collectives"
FACTORS = {  # nccl-tests doc/PERFORMANCE.md, "Summary"
    "allreduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "alltoall": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "sendrecv": lambda n: 1.0,
}


@pytest.mark.parametrize("name", list(FACTORS))
def test_busbw_factor(name):
    assert set(FACTORS) == set(OPS)
    for n in range(1, 9):
        assert OPS[name].factor(n) == pytest.approx(FACTORS[name](n))
    args = bench.parser().parse_args([name])
    bench.resolve(args)
    row = bench.make_row(args, "mpi", 1000, 1000, np.dtype("float32"), 5, 2e-6, None)
    assert row["algbw"] == pytest.approx(4000 / 2e-6 / 1e9)
    assert row["busbw"] == pytest.approx(row["algbw"] * FACTORS[name](5))


def test_sizes_as_nccl_tests_count_them():
    # whole buffer per rank; the count column is the per-rank block for blocked ops
    assert bench_ops.counts(OPS["allgather"], 1000, 4, 3) == (249, 83)
    assert bench_ops.counts(OPS["reduce_scatter"], 1024, 2, 4) == (512, 128)
    assert bench_ops.counts(OPS["alltoall"], 100, 4, 5) == (25, 5)
    for name in ("allreduce", "broadcast", "reduce", "sendrecv"):
        assert bench_ops.counts(OPS[name], 1000, 8, 3) == (125, 125)


def _expected(name, redop, root, count, n, r, dtype):
    """What rank r must hold, written out per op without bench_ops' code paths."""
    X = [bench_ops.check_inputs(name, redop, count, i, dtype) for i in range(n)]
    red = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[redop]
    acc = X[0].astype(np.float64)
    for x in X[1:]:
        acc = red(acc, x.astype(np.float64))
    b = count // n
    if name == "allgather":
        return np.concatenate([X[i][i * b : i * b + b] for i in range(n)])
    if name == "alltoall":
        return np.concatenate([X[j][r * b : r * b + b] for j in range(n)])
    if name == "broadcast":
        return X[root]
    if name == "sendrecv":
        return X[(r - 1) % n]
    return acc.astype(dtype)


CHECKED = [(name, "sum", "float32") for name in OPS] + [
    (name, redop, dtype)
    for name in ("allreduce", "reduce_scatter", "reduce")
    for redop, dtype in (("prod", "float16"), ("max", "int32"), ("min", "bfloat16"))
]


@pytest.mark.parametrize("name,redop,dtype", CHECKED)
def test_check_counts_wrong_elements(name, redop, dtype):
    """check_wrong: 0 on the right result, exactly k on k corrupted elements (where that
    rank's result is checked), so a #wrong of 0 in the MPI runs means something."""
    dtype = bench_ops.wire.numpy_dtype(dtype)
    n, root, count = 4, 2, 24
    for r in range(n):
        good = _expected(name, redop, root, count, n, r, dtype)
        buf = good.copy() if name != "sendrecv" else np.zeros(count, dtype)
        recv = good.copy() if name == "sendrecv" else None
        assert bench_ops.check_wrong(name, redop, root, buf, recv, n, r) == 0
        bad = recv if name == "sendrecv" else buf
        mine = slice(r * 6, r * 6 + 6) if name == "reduce_scatter" else slice(0, count)
        bad[mine][[0, 3, 5]] += 1
        want = 0 if name == "reduce" and r != root else 3
        assert bench_ops.check_wrong(name, redop, root, buf, recv, n, r) == want


# -- the MPI runs: every op, its rows checked against NumPy --------------------------------
# One MPI job per world size runs the benchmark's main once per case (a separate mpiexec per
# op would cost most of the time budget in start-up).
CASES = [
    ["allreduce", "-b", "4", "-e", "4K", "-f", "32"],
    ["allgather", "-b", "100", "-e", "4K", "-f", "40"],
    ["reduce_scatter", "-b", "100", "-e", "4K", "-f", "40"],
    ["alltoall", "-b", "100", "-e", "4K", "-f", "40", "-d", "half"],
    ["broadcast", "-b", "100", "-e", "4K", "-f", "40", "-r", "1", "-d", "bfloat16"],
    ["reduce", "-b", "100", "-e", "4K", "-f", "40", "-r", "2", "-d", "double"],
    ["sendrecv", "-b", "100", "-e", "4K", "-f", "40", "-d", "int"],
    ["allreduce", "-b", "64", "-e", "64", "-o", "max", "-d", "bfloat16"],
    ["reduce_scatter", "-b", "64", "-e", "64", "-o", "prod", "-a", "mpi"],
]
COMMON = ["-n", "2", "-w", "1", "-c", "1", "-I", "1"]
JOB = """
import sys
from proxies.collectives import bench
cases, out = {cases!r}, sys.argv[1]
for i, case in enumerate(cases):
    code = bench.main([*case, *{common!r}, "-J", f"{{out}}/{{i}}.json"])
    assert code == 0, (case, code)
"""
TYPES = {"half": "float16", "bfloat16": "bfloat16", "double": "float64", "int": "int32"}


@pytest.mark.mpi
@pytest.mark.parametrize("n", [3, 4, 5])
def test_every_op_checked_against_numpy(tmp_path, n):
    code = JOB.format(cases=CASES, common=COMMON)
    r = run([mpiexec(), "-n", str(n), sys.executable, "-c", code, str(tmp_path)], 120)
    assert r.returncode == 0, r.stderr[-3000:]
    for i, case in enumerate(CASES):
        rows = json.loads((tmp_path / f"{i}.json").read_text())
        name, op = case[0], OPS[case[0]]
        algs = ["mpi"] if "-o" in case and "-a" not in case else list(op.algorithms)
        if "-a" in case:
            algs = case[case.index("-a") + 1].split(",")
        assert [row["algorithm"] for row in rows[: len(algs)]] == algs
        dtype = TYPES.get(case[case.index("-d") + 1], "x") if "-d" in case else "float32"
        itemsize = np.dtype(bench_ops.wire.numpy_dtype(dtype)).itemsize
        for row in rows:
            assert row["wrong"] == 0, (case, row)  # checked, and right
            assert row["collective"] == name and row["ranks"] == n and row["dtype"] == dtype
            per_rank = n if op.blocked else 1
            assert row["bytes"] == row["count"] * itemsize * per_rank
            assert row["busbw"] == pytest.approx(row["algbw"] * FACTORS[name](n))
            redop = case[case.index("-o") + 1] if "-o" in case else "sum"
            assert row["redop"] == (redop if op.reduces else "none")
            assert row["root"] == (int(case[case.index("-r") + 1]) if op.rooted else -1)
            it = row["per_iter"]
            assert len(it["times_us"]) == 2 and it["min_us"] <= it["p99_us"] <= it["max_us"]
    assert "#wrong in all: 0" in r.stdout and "i_p99" in r.stdout


# -- flags and bad input -------------------------------------------------------------------
def test_nccl_tests_spellings_parse():
    args = bench.parser().parse_args(
        ["all_gather", "-d", "half", "--warmup_iters", "3", "-J", "x.json", "-c", "1"]
    )
    assert bench.resolve(args) == ["ring", "rd", "mpi"]
    assert (args.collective, args.dtype, args.warmup, args.json, args.check) == (
        "allgather",
        "float16",
        3,
        "x.json",
        1,
    )
    args = bench.parser().parse_args(["--check"])  # the old flag form: one checked call
    assert args.check == 1 and bench.resolve(args)[-1] == "mpi"
    args = bench.parser().parse_args(["reduce", "-o", "min", "-r", "3"])
    assert bench.resolve(args) == ["mpi"] and (args.op, args.root) == ("min", 3)


BAD = [
    (["gather"], "unknown collective 'gather'"),
    (["-o", "allgather"], "name the collective first"),
    (["-o", "avg"], "MPI has no average"),
    (["allgather", "-o", "max"], "-o/--op goes with allreduce"),
    (["allreduce", "-o", "max", "-a", "ring,mpi"], "our algorithms only sum"),
    (["allgather", "-r", "1"], "-r/--root goes with broadcast and reduce"),
    (["allgather", "-a", "rhd"], "unknown algorithm 'rhd' for allgather"),
    (["-d", "int8"], "-d/--datatype int8: not supported"),
    (["-d", "float8"], "invalid choice: 'float8'"),
    (["-I", "2"], "-I/--per_iter_timing: 2: at most 1"),
    (["-K", "1"], "-K/--per_iter_skip goes with -I 1"),
    (["-I", "1", "-K", "20"], "leaves none of the -n 20"),
    (["-c", "-1"], "-c/--check"),
    (["--check", "allgather"], "the collective goes first"),
    (["broadcast", "-r", "7", "--dry-run", "--machine", "configs/machines/10gbe.yaml"], "0..0"),
]


@pytest.mark.parametrize("args,words", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_input_is_a_usage_error(args, words):
    with pytest.raises(cli.UsageError) as e:
        bench.main(args)
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.mpi
@pytest.mark.parametrize("args", [["broadcast", "-r", "2"], ["-o", "prod", "-a", "tree"]])
def test_bad_input_under_mpi_is_one_line_and_exit_2(args):
    """-r past the world (known only once MPI runs) and a parse-time refusal, end to end."""
    r = mpirun(2, PROG, *args, "-b", "8", "-e", "8", timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{PROG}: error: ") and r.stdout == ""


# -- predictions against hand arithmetic ---------------------------------------------------
def test_dry_run_rows_match_hand_arithmetic(tmp_path, capsys):
    """10 GbE, 5 nodes of 1 rank, 125 MiB: ring allgather is 4 steps of S/5 bytes, each one
    latency (25 us) + S/5 at 9.41 Gb/s; sendrecv one message of S per rank, all at once."""
    S, bw, lat = 125 << 20, 9.41e9 / 8, 25e-6
    ten = os.path.join(ROOT, "configs", "machines", "10gbe.yaml")
    common = ["--dry-run", "--world-size", "5", "--machine", ten, "-b", "125M", "-e", "125M"]
    for name, alg, want in (
        ("allgather", "ring", 4 * (lat + S / 5 / bw)),
        ("sendrecv", "mpi", lat + S / bw),
    ):
        out = tmp_path / f"{name}.json"
        assert bench.main([name, *common, "-a", alg, "-J", str(out)]) == 0
        (row,) = json.loads(out.read_text())
        assert row["time_us"] == pytest.approx(want * 1e6, rel=1e-4)
        assert row["predicted"] and row["busbw"] == pytest.approx(
            S / want / 1e9 * FACTORS[name](5), rel=1e-4
        )
    assert "busbw = algbw x (n-1)/n = algbw x 0.800" in capsys.readouterr().out
