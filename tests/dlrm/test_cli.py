"""DLRM bad input: one clear line on stderr from rank 0, exit status 2, every rank gone."""

import pytest
from launch import mpirun, run

CASES = [
    # (ranks, args, words the message must contain)
    (4, ["--batch", "30"], ["global batch 30 is not a multiple of the world size 4"]),
    (
        2,
        ["--model", "dlrm-tiny", "--tables", "1", "--sharding", "table"],
        ["1 embedding tables for 2 ranks", "--tables 2"],
    ),
    (2, ["--model", "dlrm-9000"], ["--model", "invalid choice", "dlrm-9000"]),
    (2, ["--pooling", "0"], ["--pooling", "positive integer"]),
    (2, ["--sharding", "diagonal"], ["--sharding", "invalid choice", "diagonal"]),
    (
        2,
        ["--model", "dlrm-tiny", "--sharding", "column", "--column-shards", "3"],
        ["--column-shards 3 does not divide the embedding dimension D = 8"],
    ),
    (
        4,
        ["--model", "dlrm-tiny", "--sharding", "table", "--column-shards", "2"],
        ["--column-shards applies to --sharding column, not --sharding table"],
    ),
    (2, ["--column-shards", "0"], ["--column-shards", "positive integer"]),
]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,args,words", CASES, ids=[" ".join(c[1]) for c in CASES])
def test_bad_input_is_one_line_and_exit_2(ranks, args, words):
    r = mpirun(ranks, "proxies.dlrm", *args, "--timeout", "20", timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("proxies.dlrm: error: ")
    for w in words:
        assert w in lines[0]
    assert "Traceback" not in r.stderr and r.stdout == ""


@pytest.mark.slow
def test_dry_run_of_many_ranks_and_its_errors():
    import sys

    ok = run([sys.executable, "-m", "proxies.dlrm", "--model", "mlperf", "--dry-run",
              "--world-size", "16", "--show-ranks", "0"], timeout=120)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert (
        "plan valid: 16 ranks" in ok.stdout and "6 empty slot(s)" in ok.stdout
    )  # 16 x 2 slots, 26 tables
    bad = run([sys.executable, "-m", "proxies", "dlrm", "--model", "mlperf", "--dry-run",
               "--world-size", "32", "--sharding", "table"], timeout=60)  # fmt: skip
    assert bad.returncode == 2
    assert bad.stderr.strip() == (
        "proxies.dlrm: error: 26 embedding tables for 32 ranks: table-wise sharding places "
        "whole tables (table t on rank t % 32) and every rank needs one; use at most 26 "
        "ranks, --tables 32 or more, or --sharding row or column"
    )
    for sharding in ("row", "column"):
        ok = run([sys.executable, "-m", "proxies.dlrm", "--model", "mlperf", "--dry-run",
                  "--world-size", "128", "--sharding", sharding], timeout=120)  # fmt: skip
        assert ok.returncode == 0, ok.stderr
        assert "plan valid: 128 ranks" in ok.stdout and f"tables {sharding}-wise" in ok.stdout


@pytest.mark.mpi
def test_help_is_printed_once():
    r = mpirun(2, "proxies.dlrm", "--help", timeout=60)
    assert r.returncode == 0
    assert r.stdout.count("usage:") == 1
    for option in (
        "--model",
        "--batch",
        "--tables",
        "--schedule",
        "--model-times",
        "--check",
        "--sharding",
        "--column-shards",
    ):
        assert option in r.stdout
