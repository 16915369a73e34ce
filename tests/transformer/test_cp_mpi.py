"""Context parallelism with real compute under mpiexec (driver: tests/cp_driver.py, many
configurations per process group): every split x comm at cp 4 alone, covering subsets at
cp 2 alone and at cp 2 and cp 4 with each of pp 2 / dp 2 / tp 2, trains exactly as the
one-process model (losses relative 1e-5); the key/value gradient reductions of
--cp-grad-reduce; gpt2; --check on real runs."""

from __future__ import annotations

import json
import os
import sys

import pytest
from launch import ROOT, mpiexec, run
from one_process import train

from proxies.transformer import cp as cpsplit
from proxies.transformer.config import PRESETS as GPT2_PRESETS
from proxies.transformer.setup import PRESETS as GPT3_PRESETS

pytestmark = pytest.mark.mpi  # every test here starts MPI

DRIVER = os.path.join(ROOT, "tests", "cp_driver.py")
T = 32  # tests/gpt3/test_model.py's reference sequence
GPT3 = ["gpt3", "--model", "gpt3-tiny", "--seq-len", str(T), "--iters", "2", "--warmup", "0"]
GPT3 += ["--quiet", "--lr", "1e-3", "--compute", "real"]
ALL = [(s, c) for s in cpsplit.SPLITS for c in cpsplit.COMMS]


def drive(tmp_path, ranks: int, runs: list[list[str]], timeout: float = 300) -> list[dict]:
    """Every run in one mpiexec of `ranks`; their JSON results in order."""
    argv = [a for r in runs for a in (*r, "--")]
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, DRIVER, str(tmp_path), *argv]
    r = run(cmd, timeout, env={"PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr
    return [json.loads((tmp_path / f"{k}.json").read_text()) for k in range(len(runs))]


def cp_run(n: int, split: str, comm: str, layers="2", stages="1", *extra: str) -> list[str]:
    return [*GPT3[:1], layers, stages, *GPT3[1:], "--cp", str(n), "--cp-split", split]  + [
        "--cp-comm", comm, *extra,
    ]  # fmt: skip


def check_losses(results: list[dict], runs: list[list[str]], want) -> None:
    for got, argv in zip(results, runs, strict=True):
        assert got["loss"] == pytest.approx(want, rel=1e-5), " ".join(argv)


# cp 2 alone: each split and each comm once (every pair at cp 2 runs with one of pp 2,
# dp 2 and tp 2 below); cp 4 alone: every pair
ALONE = {2: [(s, cpsplit.COMMS[i]) for i, s in enumerate(cpsplit.SPLITS)], 4: ALL}


@pytest.mark.parametrize("n", [2, 4])
def test_every_split_and_comm_alone_equals_one_process(tmp_path, n):
    """cp n on n ranks, 2 micro-batches: the cp 1 model's losses; one run with --check."""
    want, _ = reference(2, 2)
    runs = [cp_run(n, s, c, "2", "1", "--micro-batches", "2") for s, c in ALONE[n]]
    runs[0].append("--check")
    check_losses(drive(tmp_path, n, runs), runs, want)


# cp 2 with each layout: each split and each comm once per layout, all 9 pairs across the
# three (and, with cp 4's pairs below, 6 of the 9 per layout)
CP2 = {
    "pp2": [("contiguous", "ring"), ("interleaved", "alltoall"), ("zigzag", "allgather")],
    "dp2": [("contiguous", "alltoall"), ("interleaved", "allgather"), ("zigzag", "ring")],
    "tp2": [("contiguous", "allgather"), ("interleaved", "ring"), ("zigzag", "alltoall")],
}
LAYOUTS = [
    (("2", "2", "--micro-batches", "2"), 2, "pp2"),
    (("2", "1", "--micro-batches", "2"), 4, "dp2"),
    (("2", "1", "--micro-batches", "2", "--tp", "2"), 2, "tp2"),
]


@pytest.mark.parametrize("extra,samples,layout", LAYOUTS, ids=["pp2", "dp2", "tp2"])
def test_cp2_with_pp_dp_tp_equals_one_process(tmp_path, extra, samples, layout):
    """cp 2 x (pp 2 | dp 2 | tp 2) on 4 ranks, the pairs of CP2[layout] (tp 2: sequence
    parallel for zigzag): the losses of the one-process model on the same samples."""
    want, _ = reference(2, samples)
    layers, stages, *rest = extra
    runs = []
    for s, c in CP2[layout]:
        sp = ["--sequence-parallel"] if "--tp" in rest and s == "zigzag" else []
        runs.append(cp_run(2, s, c, layers, stages, *rest, *sp))
    runs[-1].append("--check")
    check_losses(drive(tmp_path, 4, runs), runs, want)


def test_grad_reduces_equal_one_process(tmp_path):
    """--cp-grad-reduce allreduce / reduce / reduce-scatter at cp 4 (contiguous: the
    reduce groups shrink; interleaved: they rotate)."""
    want, _ = reference(2, 2)
    runs = [
        cp_run(4, split, "allgather", "2", "1", "--micro-batches", "2", "--cp-grad-reduce", how)
        for how in cpsplit.GRAD_REDUCES
        for split in ("contiguous", "interleaved")
    ]
    check_losses(drive(tmp_path, 4, runs), runs, want)


def one_process(cfg, L: int, m: int, iters: int = 2, lr: float = 1e-3) -> list[float]:
    """The unsharded model with L layers in one process on the proxies' samples (m per
    iteration, B = 1): the cp 1 losses."""
    return train(cfg.with_layers(L), T, m, iters, lr)[0]


def reference(L: int, m: int) -> tuple[list[float], None]:
    return one_process(GPT3_PRESETS["gpt3-tiny"].to_gpt2(), L, m), None


def test_gpt2_cp_equals_one_process(tmp_path):
    """gpt2 --cp 2 (and with pp 2 on 4 ranks): the one-process GPT-2's losses."""
    base = ["gpt2", "--model", "gpt2-tiny", "--seq-len", str(T), "--iters", "2"]
    base += ["--warmup", "0", "--quiet", "--lr", "1e-3", "--compute", "real"]
    base += ["--micro-batches", "2", "--cp", "2"]
    runs = [
        [*base[:1], "2", "2", *base[1:], "--cp-comm", "ring", "--cp-split", "zigzag"],
        [*base[:1], "2", "2", *base[1:], "--cp-comm", "allgather", "--cp-split", "interleaved"],
        [*base[:1], "2", "2", *base[1:], "--cp-comm", "alltoall", "--cp-split", "contiguous"],
    ]
    check_losses(drive(tmp_path, 4, runs), runs, one_process(GPT2_PRESETS["gpt2-tiny"], 2, 2))


# cp 4 with each layout: each split and each comm at least once per layout; together 8 of
# the 9 split x comm pairs (contiguous x alltoall needs the 2 heads per tp rank to split over
# 4: not with tp 2; at cp 4 alone above).
CP4 = {
    "pp2": [("contiguous", "allgather"), ("interleaved", "ring"), ("zigzag", "alltoall")],
    "dp2": [("contiguous", "ring"), ("interleaved", "alltoall"), ("zigzag", "allgather")],
    "tp2": [("contiguous", "ring"), ("interleaved", "allgather"), ("zigzag", "ring")],
}


@pytest.mark.slow
@pytest.mark.parametrize("extra,samples,layout", LAYOUTS, ids=["pp2", "dp2", "tp2"])
def test_cp4_with_pp_dp_tp_equals_one_process(tmp_path, extra, samples, layout):
    """cp 4 x (pp 2 | dp 2 | tp 2) on 8 ranks, the pairs of CP4[layout]."""
    want, _ = reference(2, samples)
    layers, stages, *rest = extra
    runs = [cp_run(4, s, c, layers, stages, *rest) for s, c in CP4[layout]]
    check_losses(drive(tmp_path, 8, runs, timeout=600), runs, want)
