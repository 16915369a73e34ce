"""LLaMA with context parallelism and real compute under mpiexec (tests/cp_driver.py, many
runs per process group): RoPE at each rank's true positions and GQA's k,v exchanges give
the one-process losses (relative 1e-5) for every split and family (ring, all-gather,
Ulysses), and with tp 2 (sequence parallel) and pp 2 beside cp 2."""

from __future__ import annotations

import pytest
from transformer.test_cp_mpi import drive

from proxies.transformer import cp as cpsplit

from .test_model import T, one_process

pytestmark = pytest.mark.mpi

LLAMA = ["--model", "llama-tiny", "--seq-len", str(T), "--iters", "2", "--warmup", "0"]
LLAMA += ["--quiet", "--lr", "1e-3", "--compute", "real"]


def cp_run(split: str, comm: str, layers: str, stages: str, *extra: str) -> list[str]:
    return ["llama", layers, stages, *LLAMA, "--cp", "2", "--cp-split", split, "--cp-comm",
            comm, *extra]  # fmt: skip


def check(results: list[dict], runs: list[list[str]], want) -> None:
    for got, argv in zip(results, runs, strict=True):
        assert got["loss"] == pytest.approx(want, rel=1e-5), " ".join(argv)


def test_cp2_every_split_equals_one_process(tmp_path):
    want, _ = one_process(2, 2)
    runs = [
        cp_run(s, c, "2", "1", "--micro-batches", "2")
        for s in cpsplit.SPLITS
        for c in cpsplit.COMMS
    ]
    runs[0].append("--check")
    check(drive(tmp_path, 2, runs), runs, want)


def test_cp2_with_tp2_sp_and_with_pp2_equals_one_process(tmp_path):
    want, _ = one_process(2, 2)
    runs = [
        cp_run("zigzag", "ring", "2", "1", "--micro-batches", "2", "--tp", "2",
               "--sequence-parallel"),
        cp_run("interleaved", "allgather", "2", "1", "--micro-batches", "2", "--tp", "2"),
        cp_run("zigzag", "ring", "2", "2", "--micro-batches", "2"),
    ]  # fmt: skip
    check(drive(tmp_path, 4, runs), runs, want)
