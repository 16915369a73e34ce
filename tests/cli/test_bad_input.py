"""Bad input: one clear line on stderr from rank 0, exit status 2, every rank gone quickly."""

import pytest
from launch import mpirun

pytestmark = pytest.mark.mpi  # every test here starts MPI

CASES = [
    # (ranks, args, words the message must contain)
    (3, ["4", "2"], ["world size 3 is not a multiple of STAGES = 2"]),
    (4, ["2", "4"], ["STAGES = 4 is more than LAYERS = 2"]),
    (2, ["0", "1"], ["LAYERS", "positive integer", "0"]),
    (2, ["4", "-2"], ["STAGES", "positive integer", "-2"]),
    (2, ["4", "2", "0"], ["MICROBATCHES", "positive integer", "0"]),
    (2, ["four"], ["LAYERS", "'four'"]),
    (2, ["4", "--iters", "0"], ["--iters", "positive integer"]),
    (2, ["4", "--micro-batch", "x"], ["--micro-batch", "'x'"]),
    (2, ["4", "--model", "gpt5"], ["--model", "invalid choice", "gpt5"]),
    (2, ["4", "--seq-len", "4096"], ["--seq-len 4096", "context of 1024"]),
    (2, ["4", "--data", "/no/such/tokens.bin"], ["--data /no/such/tokens.bin: no such file"]),
    (2, ["4", "2", "--order", "pp-xx"], ["rank order", "pp-xx"]),
    (2, ["4", "--device-tflops", "-1"], ["--device-tflops", "TFLOP/s from"]),
    (2, ["4", "--world-size", "8"], ["--world-size only goes with --dry-run"]),
    (2, ["4", "--bogus"], ["unrecognized arguments: --bogus"]),
    (2, ["8", "2", "--num-layers", "6"], ["--num-layers 6 and LAYERS = 8 differ"]),
    (2, ["4", "--global-batch-size", "3", "--micro-batch-size", "2"], ["not a multiple of"]),
    (4, ["4", "--cp", "3", "--compute", "none"], ["world size 4", "not a multiple of --cp 3"]),
    (2, ["4", "--cp", "2", "--zero", "1"], ["--cp > 1 syncs gradients in buckets", "--zero 1"]),
    (2, ["4", "--cp", "2", "--seq-len", "66"], ["--seq-len 66 is not a multiple of 2 x --cp 2"]),
]


@pytest.mark.parametrize("ranks,args,words", CASES, ids=[" ".join(c[1]) for c in CASES])
def test_bad_input_is_one_line_and_exit_2(ranks, args, words):
    r = mpirun(ranks, "proxies.gpt2", *args, "--timeout", "20", timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("proxies.gpt2: error: ")
    for w in words:
        assert w in lines[0]
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_bad_data_file_header(tmp_path):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"\0" * 2048)
    r = mpirun(2, "proxies.gpt2", "4", "--data", str(bad), timeout=60)
    assert r.returncode == 2
    assert "not an llm.c token file" in r.stderr and r.stderr.count("\n") == 1


def test_help_is_printed_once():
    r = mpirun(2, "proxies.gpt2", "--help", timeout=60)
    assert r.returncode == 0
    assert r.stdout.count("usage:") == 1
    for option in (
        "--iters",
        "--warmup",
        "--compute",
        "--json",
        "--dry-run",
        "--seed",
        "--check",
        "--allreduce",
        "--schedule",
        "--data",
        "--timeout",
    ):
        assert option in r.stdout
