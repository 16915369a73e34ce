"""BERT proxy under mpiexec on 4 ranks: real pipeline x tensor and pipeline x data parallel
training equals the one-rank model, --check verifies every message and collective in
every compute mode, the C++ preset runs its sizes, bad input is one line and exit 2."""

from __future__ import annotations

import json

import pytest
from launch import mpirun

from .test_model import emulate

pytestmark = pytest.mark.mpi  # every test here starts MPI

TINY = ["--model", "bert-tiny", "--seq-len", "16", "--micro-batch", "2", "--lr", "1e-3"]
QUIET = ["--iters", "2", "--warmup", "0", "--quiet", "--timeout", "120"]


def run(tmp_path, ranks: int, *args: str) -> dict:
    out = tmp_path / f"r{ranks}.json"
    r = mpirun(ranks, "proxies.bert", *args, *QUIET, "--json", str(out), timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def one_rank() -> list[float]:
    """4 layers, 4 micro-batches of 2 samples per iteration, in one process."""
    return emulate(["4", "1", *TINY, "--micro-batches", "4"], 1)


def test_pp2_tp2_trains_like_one_rank(tmp_path, one_rank):
    got = run(tmp_path, 4, "4", "2", *TINY, "--tp", "2", "--micro-batches", "4", "--check")
    assert got["loss"] == pytest.approx(one_rank, rel=1e-5)
    assert got["grid"] == {"order": "pp-tp-dp", "pp": 2, "tp": 2, "dp": 1}
    act = 2 * 16 * 64 * 4  # B*T*C floats
    assert got["bytes"]["pp_send"] == [4 * act] * 4
    # embedding (stage 0) + 2 layers x 4 allreduces per micro-batch, 4 micro-batches
    assert got["bytes"]["tp_allreduce"][0] == (1 + 2 * 4) * 4 * act
    # the tied word embedding: its 30,720 / 2 rows (padded to 256 x tp) x 64, stage 0 <-> 1
    assert got["bytes"]["embed_allreduce"] == [30720 // 2 * 64 * 4] * 4


def test_pp2_dp2_gpipe_trains_like_one_rank(tmp_path, one_rank):
    got = run(tmp_path, 4, "4", "2", *TINY, "--micro-batches", "2", "--schedule", "gpipe")
    assert got["loss"] == pytest.approx(one_rank, rel=1e-5)
    assert got["config"]["dp"] == 2 and got["config"]["schedule"] == "gpipe"
    assert {"compute", "pp", "dp_allreduce", "embed_allreduce"} <= set(got["breakdown_s"])


@pytest.mark.parametrize("compute", ["model", "none", "replay"])
def test_other_compute_modes_check(tmp_path, compute):
    got = run(tmp_path, 4, "2", "2", *TINY, "--tp", "2", "--compute", compute, "--check")
    assert got["config"]["compute"] == compute and len(got["iter_time_s"]) == 2


def test_cpp_preset_sends_the_cpp_sizes(tmp_path):
    got = run(tmp_path, 4, "--model", "dnn-cpp-proxies", "2", "2", "--micro-batches", "2")
    act = 8 * 128 * 1025 * 4  # P2PSIZE floats, in bytes
    assert got["bytes"]["pp_send"] == [2 * act] * 4
    first, last = 44_379_136 * 4, 45_984_572 * 4  # BEGINSIZE, ENDSIZE
    assert sorted(got["bytes"]["dp_allreduce"]) == [first, first, last, last]


@pytest.mark.parametrize(
    "args, words",
    [
        (["--cp", "2"], "--cp 2"),
        (["--tp", "3"], "--tp 3 does not divide"),
        (["--model", "dnn-cpp-proxies", "--compute", "real"], "--compute real does not apply"),
        (["--model", "dnn-cpp-proxies", "2", "1"], "needs STAGES >= 2"),
        (["--seq-len", "1000"], "longer than"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, words):
    r = mpirun(2, "proxies.bert", "--model", "bert-tiny", *args, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and words in lines[0], r.stderr
