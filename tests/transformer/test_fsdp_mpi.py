"""--fsdp under mpiexec (driver: tests/cp_driver.py, several runs per process group): real
FSDP training at dp 2 and 4, pp 2 x dp 2, tp 2 x dp 2 and hybrid sharding (2 x 2), gpt3
and gpt2, equals the one-process model (losses relative 1e-5); --check verifies every
gather and reduce-scatter; a measured iteration's traffic is 3 x the padded parameters."""

from __future__ import annotations

import json
import os
import sys

import pytest
from launch import ROOT, mpiexec, run
from one_process import train

from proxies.gpt3 import proxy as gpt3
from proxies.transformer.fsdp import shard_units
from proxies.transformer.layout import Layout
from proxies.transformer.setup import PRESETS

pytestmark = pytest.mark.mpi  # every test here starts MPI

DRIVER = os.path.join(ROOT, "tests", "cp_driver.py")
T = 32
COMMON = ["--seq-len", str(T), "--iters", "2", "--warmup", "0", "--quiet", "--lr", "1e-3"]
GPT3 = ["gpt3", "--model", "gpt3-tiny", "--compute", "real", *COMMON]


def drive(tmp_path, ranks: int, runs: list[list[str]], timeout: float = 300) -> list[dict]:
    argv = [a for r in runs for a in (*r, "--")]
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, DRIVER, str(tmp_path), *argv]
    r = run(cmd, timeout, env={"PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr
    return [json.loads((tmp_path / f"{k}.json").read_text()) for k in range(len(runs))]


def reference(m: int) -> list[float]:
    """The 2-layer model in one process, m samples per iteration."""
    return train(PRESETS["gpt3-tiny"].with_layers(2).to_gpt2(), T, m, 2, 1e-3)[0]


def test_fsdp_on_2_ranks_with_check_and_its_traffic(tmp_path):
    """dp 2 trains as one process (--check on); one micro-batch: per rank all-gathers of
    twice the padded parameters and a reduce-scatter of them once."""
    runs = [
        [GPT3[0], "2", "1", *GPT3[1:], "--fsdp", "--micro-batches", "2", "--check"],
        [GPT3[0], "2", "1", *GPT3[1:], "--fsdp", "--micro-batches", "1"],
    ]
    checked, single = drive(tmp_path, 2, runs)
    assert checked["loss"] == pytest.approx(reference(4), rel=1e-5)
    assert single["loss"] == pytest.approx(reference(2), rel=1e-5)
    job = gpt3.make_job(gpt3.parser().parse_args(runs[1][1:]), 2)
    padded = sum(u.padded(2) for u, _, _ in shard_units(Layout(job.setup, 0)))
    assert single["bytes"]["fsdp_allgather"] == [2 * 4 * padded] * 2
    assert single["bytes"]["fsdp_reduce_scatter"] == [4 * padded] * 2


def test_fsdp_on_4_ranks_equals_one_process(tmp_path):
    """dp 4, pp 2 x dp 2 (the tied wte's shards summed over the embedding group), tp 2 x
    dp 2, HSDP 2 x 2; gpt2 at pp 2 x dp 2."""
    m2 = ["--micro-batches", "2"]
    runs = [
        [GPT3[0], "2", "1", *GPT3[1:], "--fsdp", *m2],
        [GPT3[0], "2", "2", *GPT3[1:], "--fsdp", *m2],
        [GPT3[0], "2", "1", *GPT3[1:], "--fsdp", "--tp", "2", *m2],
        [GPT3[0], "2", "1", *GPT3[1:], "--fsdp", "--fsdp-shard-size", "2", *m2],
        ["gpt2", "2", "2", "2", "--model", "gpt2-tiny", "--fsdp", *COMMON],
    ]
    got = drive(tmp_path, 4, runs)
    want = {4: reference(4), 8: reference(8)}
    for res, argv, samples in zip(got, runs, (8, 4, 4, 8, 4), strict=True):
        assert res["loss"] == pytest.approx(want[samples], rel=1e-5), " ".join(argv)
    assert "hsdp_allreduce" in got[3]["bytes"] and "embed_allreduce" in got[1]["bytes"]
