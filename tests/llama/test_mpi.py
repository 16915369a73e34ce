"""The LLaMA proxy under mpiexec on 4 ranks: real pipeline x tensor (x sequence) x data
parallel training and Mixtral's experts over ep equal the one-process model; --check
verifies every message and collective."""

from __future__ import annotations

import json

import pytest
from launch import mpirun

from .test_model import MIXTRAL, TINY, emulate, one_process

pytestmark = pytest.mark.mpi

RUN = ["--iters", "2", "--warmup", "0", "--quiet", "--check"]


def run(tmp_path, ranks: int, *args: str) -> dict:
    out = tmp_path / f"r{ranks}.json"
    r = mpirun(
        ranks, "proxies.llama", *args, *RUN, "--json", str(out), "--timeout", "120", timeout=300
    )
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())


@pytest.mark.parametrize("sp", [False, True], ids=["", "sp"])
def test_tp2_pp2_trains_like_one_process(tmp_path, sp):
    want, _ = one_process(4, 4)
    extra = ["--sequence-parallel"] if sp else []
    got = run(tmp_path, 4, "4", "2", "--tp", "2", "--micro-batches", "4", *TINY, *extra)
    assert got["loss"] == pytest.approx(want, rel=1e-5)
    assert got["grid"] == {"order": "pp-tp-dp", "pp": 2, "tp": 2, "dp": 1}
    assert "embed_allreduce" not in got["breakdown_s"]  # the LM head is untied


def test_dp2_pp2_interleaved_trains_like_one_process(tmp_path):
    want, _ = one_process(4, 8)
    argv = ["4", "2", "--micro-batches", "4", "--virtual-stages", "2", *TINY]
    got = run(tmp_path, 4, *argv)
    assert got["loss"] == pytest.approx(want, rel=1e-5)
    assert got["config"]["schedule"] == "interleaved" and got["config"]["dp"] == 2


def test_mixtral_pp2_ep2_trains_like_one_process(tmp_path):
    moe = ["--capacity-factor", "4"]  # no token dropped: routing independent of the split
    want, _ = emulate(["2", "1", "--micro-batches", "4", *MIXTRAL, *moe], 1)
    got = run(tmp_path, 4, "2", "2", "--ep", "2", "--micro-batches", "2", *MIXTRAL, *moe)
    assert got["loss"] == pytest.approx(want, rel=1e-5)
    assert got["config"]["ep"] == 2 and "ep_alltoall" in got["breakdown_s"]


@pytest.mark.parametrize("mode", ["replay", "model", "none"])
def test_every_compute_mode_checks_every_message(tmp_path, mode):
    argv = ["4", "2", "--tp", "2", "--micro-batches", "4", *TINY, "--sequence-parallel"]
    got = run(tmp_path, 4, *argv, "--compute", mode)
    assert got["config"]["compute"] == mode and len(got["iter_time_s"]) == 2
