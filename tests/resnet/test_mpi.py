"""ResNet proxy under mpiexec: 1, 2 and 4 replicas train to the one-process losses (each
replica's batch norm on its own samples, gradients averaged), with every gradient sync
policy; --check verifies every allreduce; the C++ presets run."""

import dataclasses
import json

import numpy as np
import pytest
from launch import mpirun

from proxies.resnet.config import PRESETS
from proxies.resnet.model import reference_losses

pytestmark = pytest.mark.mpi  # every test here starts MPI

B, ITERS, LR, SIZE = 4, 3, 0.02, 64
TINY = ["--batch", str(B), "--lr", str(LR), "--image-size", str(SIZE)]
CFG = dataclasses.replace(PRESETS["resnet-tiny"], image_size=SIZE)
QUICK = ["--iters", str(ITERS), "--warmup", "0", "--quiet"]


def run(tmp_path, ranks, *extra, model=TINY):
    out = tmp_path / f"r{ranks}-{len(list(tmp_path.iterdir()))}.json"
    args = [*model, *QUICK, "--json", str(out), *extra]
    r = mpirun(ranks, "proxies.resnet", *args, timeout=240)
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    "ranks,sync",
    [
        (1, []),
        (2, ["--bucket-mb", "0.02"]),  # 3 buckets posted during the backward
        (4, []),
        (4, ["--grad-sync", "per-tensor"]),
        (2, ["--grad-sync", "fused"]),
    ],
)
def test_replicas_train_as_one_process(tmp_path, ranks, sync):
    # The reference in float64. Batch norm over a handful of values is ill-conditioned: at
    # 32x32 (layer4 1x1: 4 values per channel) float32 and float64 part by 1e-5 within 3
    # steps at lr 0.005 (2 images, lr 0.1: by 10%); at 64x64 (2x2) by 3e-7.
    want = reference_losses(CFG, ranks, B, ITERS, lr=LR)
    got = run(tmp_path, ranks, *sync)
    assert got["config"]["global_batch"] == ranks * B
    assert got["loss"] == pytest.approx(want, rel=1e-5)
    if ranks > 1:  # every gradient allreduced once per iteration: 34,962 floats
        assert got["bytes"]["dp_allreduce"] == [4 * 34_962] * ranks


def test_check_verifies_every_allreduce(tmp_path):
    got = run(tmp_path, 4, "--check", "--bucket-mb", "0.05")
    assert got["config"]["check"] is True
    assert got["config"]["bucket_mb"] == 0.05
    assert "dp_allreduce_hidden" in got["breakdown_s"]
    # rank 0's batch-norm buffers to every replica: 17 layers of 608 channels in all (tiny),
    # running mean and var in float32, one int64 counter per layer
    assert got["bytes"]["dp_bcast"] == [4 * 2 * 608 + 8 * 17] * 4


def test_cpp_resnet152_model_compute(tmp_path):
    """The C++ ResNet-152's A100 times: 119 ms forward + 10 x 23.8 ms backward = 357 ms of
    compute per iteration, its ten buckets non-blocking under the backward."""
    got = run(
        tmp_path, 2, "--iters", "1", "--check", model=["--model", "dnn-cpp-proxies-resnet152"]
    )
    assert got["config"]["compute"] == "model" and "loss" not in got
    assert got["breakdown_s"]["compute"][0] == pytest.approx(0.357, rel=0.05)
    assert got["bytes"]["dp_allreduce"] == [4 * 60_192_808] * 2


def test_cpp_resnet50_communication_only(tmp_path):
    got = run(tmp_path, 2, "--check", model=["--model", "dnn-cpp-proxies-resnet50"])
    assert got["config"]["compute"] == "none"
    assert got["bytes"]["dp_allreduce"] == [4 * 25_559_081] * 2


@pytest.mark.parametrize("sync", ["per-tensor", "buckets"])
def test_communication_only_runs_every_policy(tmp_path, sync):
    """Without the model (--compute none) the runtime holds the flat gradient array itself:
    per-tensor keys and bucket spans are slices of it."""
    got = run(tmp_path, 2, "--compute", "none", "--grad-sync", sync, "--check")
    assert "loss" not in got
    assert got["bytes"]["dp_allreduce"] == [4 * 34_962] * 2


@pytest.mark.one_mpi
def test_cpp_resnet152_buckets_train_resnet152(tmp_path):
    """Real compute with the C++ ResNet-152's ten buckets (they end at tensor boundaries):
    2 replicas train as one process does. Float32 and one BLAS thread on both sides (the
    ranks get one each on 2 cores, this process has one): the same sums, the same losses.
    (A float64 reference parts from float32 by 5e-5 at the first loss already: 150 batch
    norms over 8 values each.)"""
    got = run(
        tmp_path,
        2,
        "--iters", "2", "--compute", "real", "--batch", "2", "--image-size", "32",
        model=["--model", "dnn-cpp-proxies-resnet152"],
    )  # fmt: skip
    cfg = dataclasses.replace(PRESETS["resnet152"], image_size=32)
    want = reference_losses(cfg, 2, 2, 2, lr=0.1 * 4 / 256, dtype=np.float32)
    assert got["loss"] == pytest.approx(want, rel=1e-5)
    assert got["bytes"]["dp_allreduce"] == [4 * 60_192_808] * 2
